"""Swarm registry at 10,000 peers: every peer simulated, full tables only for a sample of observers.

    python -m bench.registry --peers 10000              # this mode from 2,001 peers up: ~3 min here
    python -m bench.registry --peers 1000 --sampled     # the same model at 1,000 peers, to set
                                                        # beside the full simulation's numbers

The full simulation (:mod:`bench.registry`) gives every peer its own table and gossiper: N^2
entries and N^2 record receptions (10,000 peers: 24 GB and hours). Here:

* One shared version map stands for what every peer holds: the newest version of each record that
  has reached every peer. A peer keeps its own entries only for versions still spreading (a
  joiner's record, an offline record, a sampled refresh), dropped once every peer holds them.
* Refreshes spread as gossip one in ``1 / sampled`` (``--sample-rate`` per second, in the
  steady-state window only); the others enter the shared map at once. What one record's spread
  costs (offer entries, wanted ids, pushes and their duplicates, sync repairs) is the same for
  every record, so the window's bytes are the sampled records' costs times the signing rate, plus
  what does not depend on the records: message framing (offer batches as often as the offers
  loop sends them, and their replies and pushes) and sync digests (16 bytes per record).
* The gossip policy is :class:`~shoal.swarm.gossip.Gossiper`'s, restated over the version map:
  news is offered to ``fanout`` random peers at the peer's next batch (every ``push_delay`` while
  news keeps coming), a peer wants what it holds older, and pushes it back; every ``sync_every``
  rounds a sync with one random peer exchanges what differs; a leave pushes the offline record to
  every peer; a crashed peer's record is dropped by each peer at its first round after expiry.
  Message sizes are the msgpack encodings of :mod:`shoal.swarm.messages` (checked against them).
  Senders' budgets (:mod:`shoal.swarm.quota`) are not restated: an honest sender is asked for a
  few records per offer, far under its budget (the full simulation runs them).
* ``--observers`` peers also hold a real :class:`~shoal.swarm.table.RecordTable` with the default
  :class:`~shoal.limits.RegistryLimits`, merging every version that reaches them: the caps must
  take a 10,000-server swarm without refusing a record, and their tables' sizes are reported.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

from bench.registry import (
    EPOCH,
    TARGET_BYTES_RATIO,
    TARGET_CONVERGENCE_S,
    SimConfig,
    _stats,
    finish,
    run_settings,
)
from bench.scale_sim import PUSH_HEADER, ScaleSim, digest_payload, wanted_payload
from shoal.swarm.messages import ENTRY, ID_BYTES


def run(config: SimConfig, window: float, trials: int, observers: int, sample_rate: float, say) -> dict:
    started = time.perf_counter()
    g = config.gossip
    sim = ScaleSim(config, observers, sample_rate)
    sim.populate(config.peers)
    say(f"populated {config.peers} peers in {time.perf_counter() - started:.1f} s")
    sim.run_until(1.0)
    crashed = min((p for p in sim.running if p.observer is None), key=lambda p: p.signed.timestamp)
    crashed_ts = crashed.signed.timestamp
    crash_begun = sim.now
    sim.crash(crashed)

    sim.run_until(max(2 * g.period, 10.0))
    env0, t0 = Counter(sim.envelopes), sim.now
    sim.sampling = True
    sim.run_until(t0 + window)
    sim.sampling = False
    env1 = Counter(sim.envelopes)
    sampled = [s for s in list(sim.spreads.values()) + sim.finished if s.tracked_for_bytes]
    sim.run_while(lambda: any(s.done is None for s in sampled), 10 * g.refresh)
    say(f"steady state measured until t={sim.now:.0f} s, {len(sampled)} refreshes sampled "
        f"({time.perf_counter() - started:.1f} s)")  # fmt: skip

    joins, leaves = [], []
    for _ in range(trials):
        spread = sim.join()
        sim.run_while(lambda s=spread: s.done is None, 10 * g.refresh)
        joins.append(None if spread.done is None else spread.done - spread.begun)
        spread = sim.leave(sim.pick_leaver())
        sim.run_while(lambda s=spread: s.done is None, 10 * g.refresh)
        leaves.append(None if spread.done is None else spread.done - spread.begun)
        say(f"join and leave converged at t={sim.now:.0f} s ({time.perf_counter() - started:.1f} s)")
    sim.run_while(lambda: sim.crash_done is None, 2 * g.expiry + 2 * g.period)
    say(f"crash forgotten at t={sim.now:.0f} s ({time.perf_counter() - started:.1f} s)")

    n = config.peers
    minutes = window / 60
    record_bytes = statistics.fmean(size for t, size in sim.signed_sizes if t0 <= t < t0 + window)
    # What one record's spread cost, per peer (its own bytes: entries, ids, records).
    per_record: Counter[str] = Counter()
    for spread in sampled:
        per_record.update(spread.bytes)
    per_record = Counter({op: b / len(sampled) / n for op, b in per_record.items() if op != "duplicate_records"})
    duplicates = sum(s.bytes["duplicate_records"] for s in sampled) / len(sampled) / n
    records_per_minute = n * 60 / g.refresh + 60 / g.refresh  # server records, and the model record
    by_op = Counter({op: b * records_per_minute for op, b in per_record.items()})
    # Framing of the offers loop's batches, whatever they carry: news comes at rate r, and a batch
    # leaves push_delay after the first news; each batch is offered to fanout peers, answered, and
    # (when anything of it is wanted, as nearly always when batches hold several records) pushed.
    rate = records_per_minute / 60
    batches_per_minute = 60 * rate / (1 + rate * g.push_delay)
    batch = 1 + rate * g.push_delay
    wanted_share = per_record["offer.reply"] / ID_BYTES / (per_record["offer"] / ENTRY.size)
    pushed = 1 - (1 - wanted_share) ** batch
    framing = config.overhead
    by_op["offer"] += g.fanout * batches_per_minute * (framing + digest_payload(0))
    by_op["offer.reply"] += g.fanout * batches_per_minute * (framing + wanted_payload(1) - ID_BYTES)
    by_op["push"] += g.fanout * batches_per_minute * pushed * (framing + PUSH_HEADER)
    by_op["push.reply"] += g.fanout * batches_per_minute * pushed * (framing + 1)
    for op in ("sync", "sync.reply", "push"):
        by_op[op] += (env1[op] - env0[op]) / n / minutes
    per_peer_minute = sum(by_op.values())
    floor = n * record_bytes * 60 / g.refresh
    ratio = per_peer_minute / floor

    join, leave = _stats(joins, g.period), _stats(leaves, g.period)
    join["bootstrap_sync_bytes_sent_received"] = list(sim.join_sync_bytes)
    tables = [p.observer for p in sim.observers if p.alive]
    out = {
        "mode": "sampled",
        **run_settings(n, g, config),
        "sampling": {
            "refreshes_spread_per_s": sample_rate,
            "refreshes_sampled": len(sampled),
            "observers": len(tables),
            "model": "every peer simulated; full tables only at the observers (bench/registry_scale.py)",
        },
        "join": join,
        "leave": leave,
        "crash": {
            "seconds_until_all_dropped": None if sim.crash_done is None else round(sim.crash_done - crash_begun, 2),
            "record_age_at_crash_s": round(crash_begun + EPOCH - crashed_ts, 2),
            "bound_since_last_signature_s": round(g.expiry + 1.2 * g.period + 0.1, 2),
        },
        "steady_state": {
            "window_s": [round(t0, 1), round(t0 + window, 1)],
            "record_bytes": round(record_bytes, 1),
            "bytes_per_peer_per_minute": round(per_peer_minute),
            "floor_bytes_per_peer_per_minute": round(floor),
            "ratio": round(ratio, 3),
            "bytes_per_peer_per_minute_by_op": {op: round(b) for op, b in sorted(by_op.items())},
            "per_record_per_peer_bytes": {op: round(b, 1) for op, b in sorted(per_record.items())},
            "duplicate_copies_per_record_per_peer": round(duplicates, 3),
            "failed_calls_total": sim.failed_calls,
        },
        "observer_tables": {
            "records": max(len(t) for t in tables),
            "record_bytes": max(t.bytes for t in tables),
            "rejected": dict(sum((t.rejected for t in tables), start=Counter())),
        },
        "targets": {"convergence_s": TARGET_CONVERGENCE_S, "bytes_ratio": TARGET_BYTES_RATIO},
    }
    return finish(out, join, leave, ratio, sim.now, started)


__all__ = ["run"]
