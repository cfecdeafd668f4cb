"""Routing benchmark: server-to-server push vs client-driven hops, and recovery from a SIGKILL.

    scripts/isolated python -m bench.routing [--model smollm2] [--repeats 5] [--kills 5]

1. **Push vs hops.** Three ``shoal serve`` processes host thirds of the model's blocks; two clients
   over the same three tickets, one with ``push=True`` (each server hands its output to the next)
   and one with ``push=False`` (the client sends every hop itself). Runs alternate (push, hops,
   hops, push, ...), each a greedy generation of ``--new-tokens``; medians of decode tok/s and
   their ratio (push / hops). Both must generate the same tokens.
2. **Recovery.** A swarm (``--new-swarm``/``--join``) of five servers: the same thirds plus a
   spare for the second and the third. A client generates; at a random step (seeded) one server of
   its route is SIGKILLed (the first hop that has a spare, alternating middle and last); the time
   from the kill to the next token's logits is the recovery latency, next to the median token
   interval of that run. The killed server is restarted (a new identity: see tests/routing/helpers.py)
   before the next kill.

Prints JSON. ``targets``: push not slower than hops beyond noise (ratio >= 0.95), recovery < 2 s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor

from bench.measure import CpuMeter, Server, run_once
from bench.models import model_dir, prompt_ids
from shoal import AutoDistributedModelForCausalLM
from shoal.checkpoints import load_config
from shoal.heap import freeze_startup_heap
from shoal.launch import even_spans, join_flags, stop_all, wait_converged
from shoal.transport import Ticket, TransportConfig

LOOPBACK = TransportConfig(bind_addr="127.0.0.1:0")
SWARM_FLAGS = ["--gossip-period", "0.5", "--refresh-period", "1", "--expiry", "3"]


class KillAt(LogitsProcessor):
    """Timestamps every step; at step ``step`` runs ``kill`` (between two steps)."""

    def __init__(self, step: int, kill) -> None:
        self.step, self.kill = step, kill
        self.times: list[float] = []
        self.killed_at: float | None = None

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if len(self.times) == self.step + 1:
            self.kill()
            self.killed_at = time.perf_counter()
        return scores


def push_vs_hops(path: Path, ids: torch.Tensor, args: argparse.Namespace) -> dict:
    spans = even_spans(load_config(path).num_hidden_layers, 3)
    servers = [Server(path, span, threads=args.server_threads, extra_args=["--share-counters"]) for span in spans]
    try:
        tickets = [s.wait_ready() for s in servers]
        clients = {
            mode: AutoDistributedModelForCausalLM.from_pretrained(
                str(path), tickets, transport=LOOPBACK, push=(mode == "push"), refresh_period=0
            )
            for mode in ("push", "hops")
        }
        for client in clients.values():  # warm-up
            run_once(client, ids, args.new_tokens, 0)
        runs: dict[str, list[dict]] = {"push": [], "hops": []}
        outputs = {}
        meter = CpuMeter()
        for i in range(args.repeats):
            for mode in ("push", "hops") if i % 2 == 0 else ("hops", "push"):
                meter.wait_quiet(0.15, time.monotonic() + 60)
                result, out = run_once(clients[mode], ids, args.new_tokens, 0, meter=meter, abort_above=1.0)
                runs[mode].append(result)
                outputs.setdefault(mode, out)
        counters = [info.counters for info in clients["push"].blocks.server_infos()]
        for client in clients.values():
            client.close()
        median = {m: statistics.median(r["decode_tok_s"] for r in runs[m]) for m in runs}
        return {
            "servers": [[s.start, s.end] for s in spans],
            "server_threads": args.server_threads,
            "push_decode_tok_s_median": round(median["push"], 2),
            "hops_decode_tok_s_median": round(median["hops"], 2),
            "push_decode_tok_s_runs": [round(r["decode_tok_s"], 2) for r in runs["push"]],
            "hops_decode_tok_s_runs": [round(r["decode_tok_s"], 2) for r in runs["hops"]],
            "push_ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in runs["push"]), 1),
            "hops_ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in runs["hops"]), 1),
            "ratio_push_over_hops": round(median["push"] / median["hops"], 3),
            "same_tokens": bool(torch.equal(outputs["push"], outputs["hops"])),
            "pushes_sent_per_server": [c.pushes_sent for c in counters],
            "foreign_cpu_median": round(statistics.median(r["foreign_cpu"] for m in runs for r in runs[m]), 3),
        }
    finally:
        stop_all(servers)


def recovery(path: Path, ids: torch.Tensor, args: argparse.Namespace) -> dict:
    spans = even_spans(load_config(path).num_hidden_layers, 3)
    layout = {"c0": spans[0], "c1": spans[1], "c2": spans[2], "s1": spans[1], "s2": spans[2]}
    threads = args.server_threads

    def start(name: str, join: Ticket | None) -> Server:
        extra = ["--throughput", "10", *SWARM_FLAGS, *join_flags(join)]
        return Server(path, layout[name], threads=threads, extra_args=extra)

    servers = {"c0": start("c0", None)}
    founder = servers["c0"].wait_ready()
    servers.update({n: start(n, founder) for n in layout if n != "c0"})
    rng = random.Random(args.seed)
    trials = []
    try:
        for server in servers.values():
            server.wait_ready()
        wait_converged(path, list(servers.values()))  # every table lists every server
        for trial in range(args.kills):
            client = AutoDistributedModelForCausalLM.from_pretrained(
                str(path), [servers["c0"].ticket], transport=LOOPBACK, refresh_period=0
            )
            peers = {s.ticket.peer_id: n for n, s in servers.items()}
            with client.inference_session(max_length=ids.shape[1] + args.new_tokens) as cache:
                route = [peers[span.peer_id] for span in cache.session.chain]
                candidates = [n for n in route if layout[n] != spans[0]]  # spans with a spare
                victim = candidates[trial % len(candidates)]
                step = rng.randint(8, args.new_tokens - 8)

                clock = KillAt(step, servers[victim].kill)  # SIGKILL
                client.generate(
                    ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                    logits_processor=[clock], pad_token_id=0,
                )  # fmt: skip
                session = cache.session
                gaps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
                trials.append(
                    {
                        "victim": victim,
                        "victim_blocks": [layout[victim].start, layout[victim].end],
                        "step": step,
                        "recovery_s": round(clock.times[step + 1] - clock.killed_at, 3),
                        "median_token_s": round(statistics.median(gaps), 4),
                        "client_recovery_s": session.recoveries[0].seconds if session.recoveries else None,
                        "replayed": {peers[p]: n for p, n in session.recoveries[0].replayed.items()}
                        if session.recoveries
                        else {},
                    }
                )
            client.close()
            servers[victim] = start(victim, servers["c0"].ticket if victim != "c0" else servers["s1"].ticket)
            servers[victim].wait_ready()
            wait_converged(path, list(servers.values()))  # the victim's record expired, the new one spread
    finally:
        stop_all(list(servers.values()))
    latencies = [t["recovery_s"] for t in trials]
    return {
        "servers": {n: [s.start, s.end] for n, s in layout.items()},
        "trials": trials,
        "recovery_s_median": round(statistics.median(latencies), 3),
        "recovery_s_max": round(max(latencies), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 or llama270m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="runs per mode (push, hops)")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", choices=["push", "recovery"], action="append", default=[])
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    freeze_startup_heap()  # as shoal's own long-lived processes do (see shoal.heap)
    path = model_dir(args.model)
    ids = prompt_ids(args.model, path, load_config(path).vocab_size)
    result: dict = {"model": args.model, "new_tokens": args.new_tokens, "prompt_tokens": ids.shape[1]}
    if "push" not in args.skip:
        result["push_vs_hops"] = push_vs_hops(path, ids, args)
    if "recovery" not in args.skip:
        result["recovery"] = recovery(path, ids, args)
    result["targets"] = {
        "push_not_slower": result.get("push_vs_hops", {}).get("ratio_push_over_hops", 1.0) >= 0.95,
        "recovery_under_2s": result.get("recovery", {}).get("recovery_s_max", 0.0) < 2.0,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
