"""Chaos under load: API streams against a swarm whose servers are killed, drained, replaced and
joined by liars, every answer checked against plain transformers.

    scripts/isolated python -m bench.soak [--minutes 10] [--streams 6] [--kill-every 30]
        [--drain-every 90] [--liar-every 40] [--liar-life 60] [--seed 0] [--out FILE]
        [--rtt-ms 20,80] [--jitter-ms 5] [--loss 0.01] [--no-wan]

A tiny random 4-block llama (SmolLM2's tokenizer and chat template) is served by 6 honest ``shoal
serve`` processes (three of each span 0:2 and 2:4) behind ``shoal api --verify audit
--require-verified``. For the
budget's wall-clock time the driver keeps ``--streams`` API requests going (seeded: chat and
completions, greedy and position-seeded sampling, half the chats under one of three shared system
prompts, a tenth cancelled by the caller mid-stream), and meanwhile
- every ``--kill-every`` s SIGKILLs a random honest server (one whose span has two other honest
  replicas) and starts a fresh one (a new key; ``--join`` without ``--blocks``: placement picks);
- every ``--drain-every`` s SIGTERMs one (it drains) and starts a fresh one likewise;
- every ``--liar-every`` s starts a byzantine server (:mod:`testkit.faulty_server`, the kinds of
  :data:`bench.soak_swarm.LIAR_KINDS` and :data:`~bench.soak_swarm.BROKEN_KINDS` in turn, over a
  random span), which leaves (SIGTERM) after ``--liar-life`` s.
Then no new request starts; those running get 90 s; every process is ended.

Every process talks over the in-tree WAN emulator (:mod:`bench.soak_wan`, :mod:`testkit.wan`;
``--no-wan``: plain loopback): each server announces its own UDP proxy (``--announce-addr``) and is
sealed so that nothing reaches it around the proxies, the gateway too; each link between two nodes
gets a round trip drawn (seeded) from ``--rtt-ms``, +- ``--jitter-ms`` per datagram and ``--loss``
each way.

The reference is computed in this process with transformers on the same checkpoint (equivalent to
a clean reference swarm, whose greedy answers equal transformers' exactly, and cheaper): greedy
answers must be identical, sampled ones identical under the gateway's position-seeded sampler, a
cancelled stream's text a prefix of the reference. Prints one JSON object:

- ``requests``; ``completed`` (the answer the caller wanted, equal to the reference; a cancelled
  stream counts when its text so far is the reference's prefix); ``completed_share``; ``altered``
  (an answer that differs); ``failed_clear`` (an OpenAI error body or an SSE error event, properly
  closed); ``lost`` (no answer within the request's 120 s, or a stream that ended without [DONE]);
  ``cancelled``;
- ``kills``, ``drains``, ``liars`` (liar servers started), ``liars_lied`` (those whose fault record
  shows a step served wrong), ``liars_banned`` (convicted by the gateway), ``liars_lied_unbanned``
  (names: every liar that served a wrong step must be banned), ``broken`` and ``broken_banned``
  (stalling and malformed servers: routed around, never convicted), ``honest_banned``;
- ``p50_ms``, ``p99_ms``: wall time per generated token of the completed uncancelled answers
  (request start to its last byte, over the reference's token count);
- ``peak_rss_mb``: per process (``driver``, ``gateway``, each server by name), ``peak_rss_mb_max``;
- ``wan``: the links' settings, datagrams forwarded, dropped and stray, and ``lateness``: how late
  the emulator delivered against each datagram's due time (mean, max, shares over 1, 5, 20 ms);
  null with ``--no-wan``;
- ``targets_met``: altered 0, lost 0, honest_banned 0, every liar that lied banned, share >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench.soak_checks import Outcome, check, make_request, send
from bench.soak_swarm import BROKEN_KINDS, LIAR_KINDS, REPLICAS, SPANS, Swarm, build_model
from bench.soak_wan import SoakWan, WanPlan, parse_rtt
from testkit.faults import FaultRecord

GRACE = 90.0  # seconds the requests running at the budget's end get to finish
SETTLE = 20.0  # seconds a new server runs before it counts as a replica the gateway knows


def chaos(swarm: Swarm, args: argparse.Namespace, until: float, stop: threading.Event, events: dict) -> None:
    """Kills, drains and byzantine servers on their schedules until ``until`` (or ``stop``)."""
    rng = random.Random(args.seed + 1)
    start = time.monotonic()
    next_kill, next_drain, next_liar = start + args.kill_every, start + args.drain_every, start + args.liar_every / 2
    kinds = [*LIAR_KINDS, *BROKEN_KINDS]
    rng.shuffle(kinds)
    while not stop.is_set() and time.monotonic() < until:
        now = time.monotonic()
        try:
            for member in swarm.alive():
                if member.kind != "honest" and now - member.started > args.liar_life:
                    swarm.leave(member, "left")
            if now >= next_kill or now >= next_drain:
                drain = now >= next_drain
                victim = _victim(swarm, rng)
                if victim is not None:
                    swarm.leave(victim) if drain else swarm.kill(victim)
                    events["drains" if drain else "kills"] += 1
                    _in_background(swarm.start, events)  # a fresh key; placement chooses its span
                if drain:
                    next_drain += args.drain_every
                else:
                    next_kill += args.kill_every
            if now >= next_liar:
                kind = kinds[events["byzantine"] % len(kinds)]
                events["byzantine"] += 1
                _in_background(lambda kind=kind, span=rng.choice(SPANS): swarm.start(kind, span), events)
                next_liar += args.liar_every
        except Exception as exc:  # a server that did not start: noted, the soak goes on
            events["chaos_errors"].append(f"{type(exc).__name__}: {str(exc)[-500:]}")
        swarm.sample_rss()
        stop.wait(1.0)


def _in_background(start, events: dict) -> None:
    """Start a server without holding up the schedule (loading takes seconds on a busy machine)."""

    def run() -> None:
        try:
            start()
        except Exception as exc:  # a server that did not start: noted, the soak goes on
            events["chaos_errors"].append(f"{type(exc).__name__}: {str(exc)[-500:]}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    events["starting"].append(thread)


def _victim(swarm: Swarm, rng: random.Random):
    """A random honest server whose span :data:`REPLICAS` - 1 other live honest servers, up for
    :data:`SETTLE` s, also cover (so at least two honest ones the gateway knows stay while its
    replacement loads: a liar's dispute always settles, every hop has a checker)."""
    spans = swarm.spans()
    for member in swarm.alive():
        if member.span is None and member.peer in spans:
            member.span = spans[member.peer]  # where placement put it
    honest = [m for m in swarm.alive("honest") if m.peer in spans]
    settled = [m for m in honest if time.monotonic() - m.started > SETTLE]
    rng.shuffle(honest)
    for member in honest:
        mine = spans[member.peer]
        others = [m for m in settled if m is not member and spans[m.peer] == mine]
        if len(others) >= REPLICAS - 1:
            return member
    return None


def drive(url: str, args: argparse.Namespace, until: float, tokenizer, outcomes: list[Outcome]) -> None:
    """``--streams`` threads, each sending seeded requests one after another until ``until``."""
    counter = iter(range(10**9))
    lock = threading.Lock()

    def worker() -> None:
        while time.monotonic() < until:
            with lock:
                index = next(counter)
            request = make_request(args.seed, index, tokenizer)
            outcome = send(url, request)
            with lock:
                outcomes.append(outcome)
            if outcome.status != "ok":
                time.sleep(1.0)  # a caller told 503 waits a moment before it asks again

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(1.0, until + GRACE - time.monotonic()))
    with lock:
        running = sum(thread.is_alive() for thread in threads)
        outcomes.extend(Outcome(None, "lost", "", 0.0, "still running after the grace period") for _ in range(running))


def summarise(
    outcomes: list[Outcome], model, tokenizer, swarm: Swarm, banned: list[str], events: dict, wan: dict | None
) -> dict:
    verdicts = [check(o, model, tokenizer) for o in outcomes]
    names = ("completed", "altered", "failed_clear", "lost")
    counts = {name: sum(v.verdict == name for v in verdicts) for name in names}
    per_token = sorted(v.ms_per_token for v in verdicts if v.ms_per_token is not None)
    liars = [m for m in swarm.members if m.kind in LIAR_KINDS]
    lied = [m for m in liars if any(e.positions is not None for e in FaultRecord.read(m.record))] if liars else []
    broken = [m for m in swarm.members if m.kind in BROKEN_KINDS]
    honest = {m.peer for m in swarm.members if m.kind == "honest"}
    initial = {m.name for m in swarm.members[: REPLICAS * len(SPANS)]}
    requests = len(outcomes)
    result = {
        "requests": requests,
        **counts,
        "completed_share": round(counts["completed"] / requests, 4) if requests else 0.0,
        "cancelled": sum(o.request is not None and o.request.cancel_after is not None for o in outcomes),
        "kills": events["kills"],
        "drains": events["drains"],
        "liars": len(liars),
        "liars_lied": len(lied),
        "liars_banned": sum(m.peer in banned for m in liars),
        "liars_lied_unbanned": [f"{m.name} ({m.peer[:10]})" for m in lied if m.peer not in banned],
        "broken": len(broken),
        "broken_banned": sum(m.peer in banned for m in broken),
        "honest_banned": sum(peer in honest for peer in banned),
        "p50_ms": round(statistics.median(per_token), 2) if per_token else None,
        "p99_ms": round(per_token[min(len(per_token) - 1, int(0.99 * len(per_token)))], 2) if per_token else None,
        "peak_rss_mb": swarm.peak_rss_mb,
        "peak_rss_mb_max": max(swarm.peak_rss_mb.values(), default=0.0),
        "servers_started": len(swarm.members),
        "placed": dict(Counter(str(m.span) for m in swarm.members if m.kind == "honest" and m.name not in initial)),
        "chaos_errors": events["chaos_errors"],
        "wan": wan,
        "examples": [v.detail for v in verdicts if v.verdict in ("altered", "lost")][:5],
        "failures": dict(Counter(v.detail[:160] for v in verdicts if v.verdict == "failed_clear").most_common(5)),
    }
    result["targets_met"] = {
        "altered==0": counts["altered"] == 0,
        "lost==0": counts["lost"] == 0,
        "honest_banned==0": result["honest_banned"] == 0,
        "every_liar_that_lied_banned": not result["liars_lied_unbanned"],
        "completed_share>=0.95": result["completed_share"] >= 0.95,
    }
    return result


def soak(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1)
    events = {"kills": 0, "drains": 0, "byzantine": 0, "chaos_errors": [], "starting": []}
    with tempfile.TemporaryDirectory(prefix="shoal-soak-") as tmp:
        work = Path(tmp)
        model_dir = work / "tinychat"
        model, tokenizer = build_model(model_dir, seed=args.model_seed)
        plan = WanPlan(args.rtt_ms, args.jitter_ms, args.loss, args.seed)
        wan = None if args.no_wan else SoakWan(plan)
        swarm = Swarm(model_dir, work, args.seed, wan)
        stop = threading.Event()
        wan_report = None
        try:
            first = swarm.start(span=SPANS[0])
            ticket = first.process.ticket
            rest = [*SPANS[1:], *SPANS * (REPLICAS - 1)]
            starters = [threading.Thread(target=swarm.start, args=("honest", s, ticket)) for s in rest]
            for thread in starters:
                thread.start()
            for thread in starters:
                thread.join()
            if len(swarm.alive("honest")) < REPLICAS * len(SPANS):
                raise RuntimeError("the initial servers did not all start")
            url = swarm.start_gateway(concurrency=args.streams + 2, audit_every=args.audit_every)
            until = time.monotonic() + args.minutes * 60
            chaos_thread = threading.Thread(target=chaos, args=(swarm, args, until, stop, events), daemon=True)
            chaos_thread.start()
            outcomes: list[Outcome] = []
            drive(url, args, until, tokenizer, outcomes)
            stop.set()
            chaos_thread.join(120.0)
            for thread in events["starting"]:
                thread.join(130.0)  # every server started is one swarm.close ends
            swarm.sample_rss()
            banned = swarm.banned(url)
        finally:
            stop.set()
            try:
                swarm.close(Path(args.logs) if args.logs else None)
            finally:
                if wan is not None:
                    wan_report = wan.report()
                    wan.close()
        return summarise(outcomes, model, tokenizer, swarm, banned, events, wan_report)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget of the traffic")
    parser.add_argument("--streams", type=int, default=6, help="API requests kept going at once")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between SIGKILLs")
    parser.add_argument("--drain-every", type=float, default=90.0, help="seconds between drains")
    parser.add_argument("--liar-every", type=float, default=40.0, help="seconds between byzantine servers")
    parser.add_argument("--liar-life", type=float, default=60.0, help="seconds a byzantine server stays")
    parser.add_argument("--audit-every", type=int, default=8, help="the gateway's --audit-every")
    parser.add_argument(
        "--rtt-ms",
        type=parse_rtt,
        default=(20.0, 80.0),
        metavar="LOW,HIGH",
        help="each link's round trip, drawn uniformly (seeded) from this range",
    )
    parser.add_argument("--jitter-ms", type=float, default=5.0, help="each datagram's delay varies +- this")
    parser.add_argument("--loss", type=float, default=0.01, help="each datagram's drop probability, each way")
    parser.add_argument("--no-wan", action="store_true", help="plain loopback: no WAN emulator")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-seed", type=int, default=11)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--logs", help="write every process's output to this directory at the end")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = soak(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
