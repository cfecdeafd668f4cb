"""Swarm registry at scale: the real record, table and gossip code over a simulated network.

    python -m bench.registry          # 1,000 peers, 5 s rounds, 60 s refresh: ~2.5 min on 2 busy cores
    python -m bench.registry --peers 200 --period 2 --refresh 20 [--fanout F --push-delay S --sync-every R]
    python -m bench.registry --peers 10000   # sampled mode (bench/registry_scale.py): ~30 s, ~400 MB

Past ``FULL_MAX_PEERS`` (2,000) peers, or with ``--sampled``, the run is :mod:`bench.registry_scale`:
every peer simulated, full tables only at a sample of observers (this mode's N^2 tables take 24 GB
at 10,000 peers). What follows describes the full mode (its peers: :mod:`bench.registry_peer`; its
network: :mod:`bench.registry_sim`).

One process, a virtual clock, no sockets. Every peer has its own :class:`RecordTable` (whose clock
is the virtual clock) and :class:`Gossiper`, driven the way :class:`shoal.swarm.service.SwarmService`
drives them: a round every ``period * U(0.8, 1.2)`` (random phase) that republishes the peer's own
records when due and calls ``tick``; an offers loop that waits for news, sleeps ``push_delay`` and
sends the offers without awaiting them; follow-ups of replies at most ``MAX_FOLLOW_UPS`` deep;
``table.expire()`` before answering each request; ``join`` syncs with two bootstrap peers, then
publishes; a clean leave is ``announce_to_all`` of the offline record.

Records are real: each peer has an ed25519 key and signs its :class:`ServerRecord` (32-block
model, spans of 4-8 blocks, round-trip times to up to 8 servers of the next span, as
``Announcement`` measures them); every payload is a real :mod:`shoal.swarm.messages` struct as
msgpack, its records through ``records.decode`` and the tables' checks. A message takes
``U(20, 80)`` ms one way; a call to a peer that is gone fails after ``--dead-timeout`` s (default
``SwarmService.call_timeout``, ``min(60, 5 + 2 * period)``). Bytes are every payload sent
(requests and replies) plus ``overhead`` (64) bytes of framing per message.

Signature checks are memoised per process (``records._verified``), and all simulated peers share
that cache: each distinct record is verified once in the whole run, as one real peer verifies each
distinct record once. By default ``records.decode`` is shared the same way (see
:class:`SharedDecode`: it is a pure function of the bytes; 1,000 peers each decoding every copy
would take ~20 minutes here); ``--per-peer-decode`` turns that off. Table checks and merges always
run per peer.

Prints JSON: convergence after joins, clean leaves and a crash, and steady-state traffic per peer
against the floor ``N * record_bytes * 60 / refresh``, with ``targets_met``; in both modes a summary
of ``join_convergence_s`` and ``leave_convergence_s`` (the worst trial), ``bytes_ratio`` and
``peak_rss_mb``. Tables run with the default :class:`~shoal.limits.RegistryLimits` (caps, and
senders' budgets: ``rejected_records`` counts what they refused of honest traffic).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import sys
import time
from collections import Counter

from bench.registry_peer import EPOCH, SharedDecode, SimConfig, shared_decode
from bench.registry_sim import Sim
from shoal.swarm.gossip import GossipConfig
from shoal.swarm.records import decode

FULL_MAX_PEERS = 2000  # past this the full simulation's N^2 tables do not fit: sampled mode
TARGET_CONVERGENCE_S = 30.0
TARGET_BYTES_RATIO = 2.0


# ---- the benchmark ---------------------------------------------------------------------------------


def _rounded(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _decode_us(sim: Sim) -> float:
    """Microseconds one real ``records.decode`` of a server record (the one with the most rtts)
    takes here: what each real peer spends per record it receives."""
    data = max((p.signed for p in sim.peers if p.signed is not None), key=lambda s: len(s.record.rtts)).data
    decode(data)
    started, n = time.perf_counter(), 300
    for _ in range(n):
        decode(data)
    return (time.perf_counter() - started) / n * 1e6


def run(config: SimConfig, window: float = 60.0, trials: int = 3, per_peer_decode: bool = False, log=None) -> dict:
    """The benchmark: a crash at t=1 s, the steady-state window, then ``trials`` joins each followed
    by a clean leave (one at a time, each once the previous converged), then the crash's expiry."""
    started = time.perf_counter()
    say = log or (lambda *_: None)
    with contextlib.nullcontext() if per_peer_decode else shared_decode() as shared:
        return _run(config, window, trials, shared, started, say)


def run_settings(n: int, g: GossipConfig, config: SimConfig) -> dict:
    """What a run simulated (peers, gossip periods, the network): the head of both modes' reports."""
    return {
        "peers": n,
        "period_s": g.period,
        "refresh_s": g.refresh,
        "expiry_s": g.expiry,
        "gossip": {"fanout": g.fanout, "push_delay_s": g.push_delay, "sync_every_rounds": g.sync_every},
        "network": {
            "latency_ms_one_way": [config.latency[0] * 1e3, config.latency[1] * 1e3],
            "overhead_bytes_per_message": config.overhead,
            "dead_peer_timeout_s": config.dead_timeout,
            "seed": config.seed,
        },
    }


def _stats(seconds: list[float | None], period: float) -> dict:
    done = [s for s in seconds if s is not None]
    worst = max(done) if len(done) == len(seconds) and done else None
    return {
        "seconds": [_rounded(s) for s in seconds],
        "max_s": _rounded(worst),
        "max_rounds": _rounded(worst / period if worst is not None else None),
    }


def _run(config: SimConfig, window: float, trials: int, shared: SharedDecode | None, started: float, say) -> dict:
    g = config.gossip
    sim = Sim(config)
    sim.populate(config.peers)
    say(f"populated {config.peers} peers in {time.perf_counter() - started:.1f} s")

    # A crash at t=1 s, of the server whose record is the oldest (its refresh was due next): the
    # earliest its record can lapse. From its last signature, any crash takes the same time.
    sim.run_until(1.0)
    crashed = min((p for p in sim.peers if p.running), key=lambda p: p.signed.timestamp)
    crashed_ts = crashed.signed.timestamp
    crash_watch = sim.crash(crashed)

    # Steady state: all traffic over the window.
    sim.run_until(max(2 * g.period, 10.0))
    bytes0, messages0 = sim.meter.snapshot()
    signed0, calls0 = len(sim.signed_records), shared.calls if shared else 0
    t0 = sim.now
    sim.run_for(window)
    bytes1, messages1 = sim.meter.snapshot()
    signed_in_window = sim.signed_records[signed0:]
    decodes = (shared.calls if shared else 0) - calls0
    minutes = (sim.now - t0) / 60
    say(f"steady state measured until t={sim.now:.0f} s ({time.perf_counter() - started:.1f} s)")

    # Joins and clean leaves, one at a time.
    joins, leaves, sync_bytes = [], [], []
    for _ in range(trials):
        joining = sim.join()
        sim.run_while(lambda j=joining: not j.done, 10 * g.refresh)
        joins.append(joining.watch.seconds if joining.watch else None)
        sync_bytes.append(joining.sync_bytes)
        _, watch = sim.leave(sim.pick(exclude=[crashed]))
        sim.run_while(lambda w=watch: not w.done, 10 * g.refresh)
        leaves.append(watch.seconds)
        say(f"join and leave converged at t={sim.now:.0f} s ({time.perf_counter() - started:.1f} s)")
    sim.run_while(lambda: not crash_watch.done, 2 * g.expiry + 2 * g.period)
    say(f"crash forgotten at t={sim.now:.0f} s ({time.perf_counter() - started:.1f} s)")

    n = config.peers
    window_bytes = {op: bytes1[op] - bytes0[op] for op in sorted(bytes1) if bytes1[op] > bytes0[op]}
    window_messages = {op: messages1[op] - messages0[op] for op in sorted(messages1) if messages1[op] > messages0[op]}
    record_bytes = statistics.fmean(size for _, size in signed_in_window)
    per_peer_minute = sum(window_bytes.values()) / n / minutes
    floor = n * record_bytes * 60 / g.refresh
    signed_floor = len(signed_in_window) * record_bytes / minutes  # each peer receives each record signed once
    ratio = per_peer_minute / floor
    join, leave = _stats(joins, g.period), _stats(leaves, g.period)
    join["bootstrap_sync_bytes_sent_received"] = sync_bytes[0]
    out = {
        **run_settings(n, g, config),
        "signature_cache": (
            "shared: every simulated peer runs in this one process and uses the same records._verified "
            "lru_cache, so each distinct record's signature is verified once in the run (a real peer "
            "verifies each distinct record once)"
        ),
        "decode": (
            "per peer: every peer decodes every copy it receives"
            if shared is None
            else "shared: records.decode memoised on the record bytes for all peers (a pure function of them: "
            "outcomes are unchanged); every table check and merge runs per peer"
        ),
        "join": join,
        "leave": leave,
        "crash": {
            "seconds_until_all_dropped": _rounded(crash_watch.seconds),
            "record_age_at_crash_s": _rounded(crash_watch.begun + EPOCH - crashed_ts),
            "seconds_since_last_signature": _rounded(
                crash_watch.begun + crash_watch.seconds + EPOCH - crashed_ts if crash_watch.done else None
            ),
            # each peer drops it at its first round after it expired; the probe looks every 0.1 s
            "bound_since_last_signature_s": round(g.expiry + 1.2 * g.period + 0.1, 2),
        },
        "steady_state": {
            "window_s": [round(t0, 1), round(t0 + minutes * 60, 1)],
            "record_bytes": round(record_bytes, 1),
            "bytes_per_peer_per_minute": round(per_peer_minute),
            "floor_bytes_per_peer_per_minute": round(floor),
            "ratio": round(ratio, 3),
            "records_signed_per_minute": round(len(signed_in_window) / minutes, 1),
            "ratio_to_records_actually_signed": round(per_peer_minute / signed_floor, 3),
            "bytes_per_peer_per_minute_by_op": {op: round(b / n / minutes) for op, b in window_bytes.items()},
            "messages_per_peer_per_minute": {op: round(m / n / minutes, 1) for op, m in window_messages.items()},
            "record_decodes_per_peer_per_second": round(decodes / n / (minutes * 60), 2) if shared else None,
            "decode_us_per_record": round(_decode_us(sim), 1),
            "failed_calls_total": sim.failed_calls,
            # every table's refusals over the run but stale copies (normal in gossip): honest
            # traffic under the registry's caps and senders' budgets (shoal.limits.RegistryLimits)
            "rejected_records": {
                reason: n
                for reason, n in sum((p.table.rejected for p in sim.peers), start=Counter()).items()
                if reason != "stale"
            },
        },
        "targets": {"convergence_s": TARGET_CONVERGENCE_S, "bytes_ratio": TARGET_BYTES_RATIO},
    }
    out["mode"] = "full"
    return finish(out, join, leave, ratio, sim.now, started)


def finish(out: dict, join: dict, leave: dict, ratio: float, virtual: float, started: float) -> dict:
    """The summary keys every mode prints, and whether the targets are met."""
    out["join_convergence_s"] = join["max_s"]
    out["leave_convergence_s"] = leave["max_s"]
    out["bytes_ratio"] = round(ratio, 3)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["targets_met"] = bool(
        join["max_s"] is not None
        and join["max_s"] < TARGET_CONVERGENCE_S
        and leave["max_s"] is not None
        and leave["max_s"] < TARGET_CONVERGENCE_S
        and ratio <= TARGET_BYTES_RATIO
    )
    out["virtual_s"] = round(virtual, 1)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--period", type=float, default=5.0, help="gossip round, seconds")
    parser.add_argument("--refresh", type=float, default=60.0, help="record refresh, seconds")
    parser.add_argument("--expiry", type=float, default=None, help="record lifetime (default 3 x refresh)")
    parser.add_argument("--fanout", type=int, default=None)
    parser.add_argument("--push-delay", type=float, default=None)
    parser.add_argument("--sync-every", type=int, default=None)
    parser.add_argument("--window", type=float, default=60.0, help="steady-state measurement, seconds")
    parser.add_argument("--trials", type=int, default=3, help="joins (each followed by a leave) to time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dead-timeout", type=float, default=None, help="seconds a call to a crashed peer takes to fail"
    )
    parser.add_argument(
        "--per-peer-decode", action="store_true", help="every peer decodes every copy (slow: minutes for 200 peers)"
    )
    parser.add_argument(
        "--sampled",
        action="store_true",
        help=f"every peer simulated, full tables only at observers (bench/registry_scale.py; "
        f"the default above {FULL_MAX_PEERS} peers)",
    )
    parser.add_argument("--observers", type=int, default=16, help="sampled: peers that hold a real table")
    parser.add_argument("--sample-rate", type=float, default=1.0, help="sampled: refreshes per second spread as gossip")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    base = GossipConfig()
    gossip = GossipConfig(
        period=args.period,
        refresh=args.refresh,
        expiry=args.expiry if args.expiry is not None else 3 * args.refresh,
        fanout=args.fanout if args.fanout is not None else base.fanout,
        push_delay=args.push_delay,
        sync_every=args.sync_every if args.sync_every is not None else base.sync_every,
    )
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.verbose else None
    config = SimConfig(peers=args.peers, gossip=gossip, seed=args.seed, dead_timeout=args.dead_timeout)
    if args.sampled or args.peers > FULL_MAX_PEERS:
        from bench import registry_scale  # it imports this module

        say = log or (lambda *_: None)
        result = registry_scale.run(config, args.window, args.trials, args.observers, args.sample_rate, say)
    else:
        result = run(config, window=args.window, trials=args.trials, per_peer_decode=args.per_peer_decode, log=log)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
