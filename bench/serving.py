"""Serving benchmark: one server shared by many sessions (issue 17), on one machine.

    scripts/isolated python -m bench.serving [--model llama270m|smollm2] [--concurrency 1,4,16,32]
                                              [--new-tokens 64] [--repeats 2] [--only aggregate,fairness,kv,ttft]

Two ``shoal serve`` processes (one torch thread each, standing in for two machines) each host half
of the model's blocks, with ``--packed-weights`` (oneDNN's layout for batched decode steps,
:mod:`shoal.models.packed`; ``--plain-weights`` leaves it off). The batched pair runs with
``--max-batch 32``; the unbatched pair is the same servers with ``--max-batch 1`` (both pairs
start up front, so runs alternate without restarts). Every session is driven by this one client
process: each session's steps are the client library's synchronous ``RemoteSession.step`` called
from a thread of its own, all of them sharing the client's one event loop
(:mod:`shoal.client.runtime`).

Measured (prints ONE JSON object):

* ``aggregate_tps_{C}_{batched,unbatched}``: C sessions (prompt ``--prompt-tokens``) decode
  ``--new-tokens`` one-token steps each at once; decode steps of all sessions / wall time from the
  moment they all start decoding to the last one's end. 64 steps by default: a decode's steady
  state. The first and last rounds of a run are the chain's pipeline filling and draining (the
  second server waits for the first's first batch; at the end the first waits while the second
  runs the last group), about a batch of each server's time that a run of 16 steps (~2 s at 16
  sessions) feels and a long answer does not (``--new-tokens 16`` measures it). Batched and
  unbatched runs alternate, ``--repeats`` each (medians). A decode step's input is the embedding
  of a pre-drawn random token: the servers' work is exactly a greedy decode's, but the client
  computes no LM head (on 2 shared cores it would measure the client, not the servers).
  ``aggregate_ratio_16`` = batched / unbatched. Each run also records ``client_cpu_share``: CPU
  seconds of this client process (every thread) per wall second (1.0: the client alone keeps a
  core busy). ``server_counters``: each server's scheduler counters after the runs (``batches``,
  ``batched_steps``, ``batch_rows_max``, ``batch_groups``...).
* ``step_ms_p50_16`` / ``step_ms_p99_16``: per-session step latency (client side, request to
  reply through both servers) over every decode step of the batched runs at 16 sessions.
* ``fairness_ratio``: the median step latency of one session of this client while another client
  (its own process and node key: another peer) drives 24 sessions on the same batched servers,
  divided by its median alone (runs alternate).
* ``kv_bytes_ratio_100``: a session opened with ``max_length`` 2048 runs a 100-token prompt; the
  pages it holds (growth of the servers' ``kv_pages_in_use`` in ``info``) x page bytes, over the
  bytes 100 positions need. Page bytes: ``page_size`` x blocks x 2 (K, V) x kv heads x head dim x 4
  (fp32 servers).
* ``ttft_ms_1024_{pipelined,unpipelined}``: ``generate`` of a 1,024-token prompt to its first
  token (session open + prefill + LM head), with the client's pipelined prefill
  (``model.blocks.prefill_chunk``, :mod:`shoal.client.remote.pipeline`) and without (0);
  ``ttft_ratio_pipelined_1024`` = unpipelined / pipelined (after one untimed run of each: the
  servers' first long prefills).

Every run records ``foreign_cpu``: the share of the machine other processes used meanwhile (see
:class:`bench.measure.CpuMeter`); numbers from a busy machine say so. A server flag or client
option the measurements need that this checkout lacks stops the benchmark with a message naming
it (``--only`` runs the measurements that can run).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.measure import CpuMeter, Server, halves, run_once
from bench.models import model_dir
from bench.serving_sessions import (
    LoadWorker,
    connect,
    decode_run,
    embedded_tokens,
    serve_load,
    single_session_ms,
    step_at,
)
from shoal.checkpoints import load_config
from shoal.omp import child_environment

MEASURES = ("aggregate", "fairness", "kv", "ttft")
TARGETS = {"aggregate_ratio_16": (">=", 4.0), "kv_bytes_ratio_100": ("<=", 1.2),
           "ttft_ratio_pipelined_1024": (">=", 1.3), "fairness_ratio": ("<=", 2.0)}  # fmt: skip
OMP_MARK = "SHOAL_BENCH_SERVING_OMP"  # set once this process re-executed itself with shoal's spin count
FAIRNESS_LOAD_SESSIONS = 24
KV_MAX_LENGTH, KV_PROMPT = 2048, 100
TTFT_PROMPT = 1024


# ---- what this checkout has ---------------------------------------------------------------------


def missing_pieces(measures: Sequence[str], server_flags: Sequence[str]) -> list[str]:
    """What the chosen measurements need that this checkout lacks (server flags, counters, client option)."""
    from shoal import AutoDistributedModelForCausalLM
    from shoal.wire.schema import ServerCounters

    helptext = subprocess.run(
        [sys.executable, "-m", "shoal.cli.main", "serve", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    missing = [f"`shoal serve {flag}`" for flag in server_flags if flag not in helptext]
    if "kv" in measures:
        fields = {"kv_pages_in_use", "kv_pages_total"} - set(ServerCounters.__struct_fields__)
        missing += [f"server counter `{name}` (info)" for name in sorted(fields)]
    if (
        "ttft" in measures
        and "prefill_chunk" not in inspect.signature(AutoDistributedModelForCausalLM.from_pretrained).parameters
    ):
        missing.append("client option `prefill_chunk` (pipelined prefill)")
    return missing


# ---- the measurements ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def measure_aggregate(models: dict, args, meter: CpuMeter) -> dict:
    runs: dict[str, list[dict]] = {f"{c}_{kind}": [] for c in args.concurrency for kind in models}
    for rep in range(args.repeats):
        for c in args.concurrency:
            kinds = list(models) if (rep + c) % 2 == 0 else list(models)[::-1]  # alternate who goes first
            for kind in kinds:
                runs[f"{c}_{kind}"].append(decode_run(models[kind], c, args.prompt_tokens, args.new_tokens, rep, meter))
    result: dict = {}
    for key, rs in runs.items():
        result[f"aggregate_tps_{key}"] = round(statistics.median(r["tokens_per_s"] for r in rs), 2)
    if 16 in args.concurrency:
        result["aggregate_ratio_16"] = round(
            result["aggregate_tps_16_batched"] / result["aggregate_tps_16_unbatched"], 3
        )
        steps = [x for r in runs["16_batched"] for x in r["latencies_ms"]]
        result["step_ms_p50_16"] = round(percentile(steps, 50), 2)
        result["step_ms_p99_16"] = round(percentile(steps, 99), 2)
        unbatched = [x for r in runs["16_unbatched"] for x in r["latencies_ms"]]
        result["step_ms_p50_16_unbatched"] = round(percentile(unbatched, 50), 2)
    result["aggregate_runs"] = {key: [{k: v for k, v in r.items() if k != "latencies_ms"} for r in rs]
                                for key, rs in runs.items()}  # fmt: skip
    return result


def measure_fairness(model, path: Path, tickets, args, meter: CpuMeter) -> dict:
    alone, loaded, load_stats, foreign = [], [], [], []
    for rep in range(args.repeats):
        alone += single_session_ms(model, args.fairness_steps, seed=200 + rep)
        cpu = meter.sample()
        worker = LoadWorker(path, tickets, FAIRNESS_LOAD_SESSIONS)
        try:
            loaded += single_session_ms(model, args.fairness_steps, seed=300 + rep)
        finally:
            load_stats.append(worker.stop())
        foreign.append(round(meter.foreign(cpu), 3))
    return {
        "fairness_ratio": round(statistics.median(loaded) / statistics.median(alone), 3),
        "fairness_step_ms_alone_p50": round(statistics.median(alone), 2),
        "fairness_step_ms_loaded_p50": round(statistics.median(loaded), 2),
        "fairness_step_ms_loaded_p99": round(percentile(loaded, 99), 2),
        "fairness_other_peer": load_stats,
        "fairness_foreign_cpu": foreign,
    }


def measure_kv(model, config, args) -> dict:
    def pages() -> dict[str, tuple[int, int]]:
        spans = [(info.span.blocks, info.counters.kv_pages_in_use) for info in model.blocks.server_infos()]
        return {f"{b.start}:{b.end}": (used, b.end - b.start) for b, used in spans}

    heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position_block = 2 * heads * head_dim * 4  # K and V, fp32
    inputs = embedded_tokens(model, 1, KV_PROMPT, seed=400)
    session = model.blocks.open_session(1, KV_MAX_LENGTH)
    try:
        before = pages()
        step_at(session, inputs, 0)
        after = pages()
    finally:
        session.close()
    held = sum((after[k][0] - before[k][0]) * args.page_size * after[k][1] * per_position_block for k in after)
    needed = sum(KV_PROMPT * blocks * per_position_block for _, blocks in after.values())
    return {"kv_bytes_held_100": held, "kv_bytes_needed_100": needed, "kv_bytes_ratio_100": round(held / needed, 3),
            "kv_pages_held_100": {k: after[k][0] - before[k][0] for k in after}}  # fmt: skip


def measure_ttft(model, config, args, meter: CpuMeter) -> dict:
    generator = torch.Generator().manual_seed(500)
    runs: dict[str, list[float]] = {"pipelined": [], "unpipelined": []}
    foreign = []
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    for chunk in (args.client_prefill_chunk, 0):  # warm-up, not timed: the servers' first long prefills
        model.blocks.prefill_chunk = chunk
        run_once(model, torch.randint(3, config.vocab_size, (1, TTFT_PROMPT), generator=generator), 2, pad)
    for rep in range(args.repeats):
        for label in ("pipelined", "unpipelined") if rep % 2 == 0 else ("unpipelined", "pipelined"):
            model.blocks.prefill_chunk = args.client_prefill_chunk if label == "pipelined" else 0
            ids = torch.randint(3, config.vocab_size, (1, TTFT_PROMPT), generator=generator)
            cpu = meter.sample()
            timing, _ = run_once(model, ids, 2, pad)
            foreign.append(round(meter.foreign(cpu), 3))
            runs[label].append(timing["ttft_ms"])
    model.blocks.prefill_chunk = args.client_prefill_chunk
    piped, unpiped = statistics.median(runs["pipelined"]), statistics.median(runs["unpipelined"])
    return {
        "ttft_ms_1024_pipelined": round(piped, 1),
        "ttft_ms_1024_unpipelined": round(unpiped, 1),
        "ttft_ratio_pipelined_1024": round(unpiped / piped, 3),
        "ttft_runs_ms": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "ttft_foreign_cpu": foreign,
    }


# ---- the benchmark ------------------------------------------------------------------------------


SCHEDULER_COUNTERS = (
    "batches",
    "batched_steps",
    "batch_rows_max",
    "steps_deferred",
    "prefill_chunks",
    "merge_waits",
    "batch_groups",
    "regroupings",
    "steps",
)


def scheduler_counters(model) -> dict[str, dict[str, int]]:
    """What each server's scheduler did so far (did the batched servers batch?), from ``info``."""
    return {
        f"{i.span.blocks.start}:{i.span.blocks.end}": {
            k: getattr(i.counters, k) for k in SCHEDULER_COUNTERS if hasattr(i.counters, k)
        }
        for i in model.blocks.server_infos()
    }


def server_args(args, max_batch: int) -> list[str]:
    flags = ["--max-batch", str(max_batch), "--cache-tokens", str(args.cache_tokens),
             "--max-sessions-per-peer", "64", "--prefill-chunk", str(args.server_prefill_chunk),
             "--share-counters"]  # fmt: skip
    if "kv" in args.only:
        flags += ["--page-size", str(args.page_size)]
    if args.merge_wait is not None:
        flags += ["--merge-wait", str(args.merge_wait)]
    if args.contended_cost is not None:
        flags += ["--contended-cost", str(args.contended_cost)]
    if not args.plain_weights:
        flags += ["--packed-weights"]
    return flags


def bench(args) -> dict:
    path = model_dir(args.model)
    config = load_config(path)
    blocks = halves(config.num_hidden_layers)
    kinds = {"batched": args.max_batch, **({"unbatched": 1} if "aggregate" in args.only else {})}
    missing = missing_pieces(args.only, [f for f in server_args(args, 1) if f.startswith("--")])
    if missing:
        raise SystemExit("bench.serving: this checkout lacks " + ", ".join(missing) + " (--only runs the rest)")
    pairs = {kind: [Server(path, b, 1, extra_args=server_args(args, mb)) for b in blocks] for kind, mb in kinds.items()}
    meter = CpuMeter()
    try:
        tickets = {kind: [s.wait_ready() for s in servers] for kind, servers in pairs.items()}
        models = {kind: connect(path, tickets[kind], args.client_prefill_chunk) for kind in pairs}
        for model in models.values():  # warm-up: first-call allocations, connections
            decode_run(model, 2, args.prompt_tokens, 4, seed=1000, meter=meter)
        result: dict = {}
        if "aggregate" in args.only:
            result |= measure_aggregate(models, args, meter)
            result["server_counters"] = {kind: scheduler_counters(model) for kind, model in models.items()}
        if "fairness" in args.only:
            result |= measure_fairness(models["batched"], path, tickets["batched"], args, meter)
        if "kv" in args.only:
            result |= measure_kv(models["batched"], config, args)
        if "ttft" in args.only:
            result |= measure_ttft(models["batched"], config, args, meter)
        for model in models.values():
            model.close()
        return result
    finally:
        for servers in pairs.values():
            for server in servers:
                server.stop()


def targets_met(result: dict) -> dict[str, bool]:
    met = {}
    for key, (op, bound) in TARGETS.items():
        if key in result:
            met[f"{key}{op}{bound}"] = result[key] >= bound if op == ">=" else result[key] <= bound
    return met


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama270m", choices=("llama270m", "smollm2"))
    parser.add_argument("--only", default=",".join(MEASURES), help=f"comma list of {', '.join(MEASURES)}")
    parser.add_argument("--concurrency", default="1,4,16,32", help="sessions decoding at once, comma list")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="each decoding session's prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps per session and run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting (alternating)")
    parser.add_argument("--fairness-steps", type=int, default=24, help="steps the single session times per run")
    parser.add_argument("--max-batch", type=int, default=32, help="the batched servers' --max-batch")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--merge-wait", type=float, default=None, help="the servers' --merge-wait (default: theirs)")
    parser.add_argument("--contended-cost", type=float, default=None, help="the servers' --contended-cost")
    parser.add_argument("--plain-weights", action="store_true", help="servers without --packed-weights")
    parser.add_argument("--cache-tokens", type=int, default=8192, help="servers' --cache-tokens (per block)")
    parser.add_argument("--server-prefill-chunk", type=int, default=128, help="servers' --prefill-chunk")
    parser.add_argument("--client-prefill-chunk", type=int, default=128, help="the pipelined prefill's chunk")
    parser.add_argument("--load-worker", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if OMP_MARK not in os.environ:  # libgomp reads its environment when torch loads: set it, start again
        env = child_environment({**os.environ, OMP_MARK: "1"})
        os.execve(
            sys.executable, [sys.executable, "-m", "bench.serving", *(sys.argv[1:] if argv is None else argv)], env
        )
    if args.load_worker:
        serve_load(json.loads(args.load_worker))
        return
    args.only = [m for m in args.only.split(",") if m]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if unknown := set(args.only) - set(MEASURES):
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {MEASURES}")
    torch.set_num_threads(1)  # the client embeds and (for ttft) runs the LM head: the cores are the servers'
    torch.manual_seed(0)
    load_at_start = os.getloadavg()
    started = time.monotonic()
    result = bench(args)
    settings = {
        "model": args.model, "servers": 2, "server_torch_threads": 1, "split": [list(b) for b in halves(
            load_config(model_dir(args.model)).num_hidden_layers)], "max_batch_batched": args.max_batch,
        "max_batch_unbatched": 1, "page_size": args.page_size, "cache_tokens": args.cache_tokens,
        "server_prefill_chunk": args.server_prefill_chunk, "client_prefill_chunk": args.client_prefill_chunk,
        "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "fairness_other_peer_sessions": FAIRNESS_LOAD_SESSIONS,
        "kv_session": {"max_length": KV_MAX_LENGTH, "positions": KV_PROMPT}, "ttft_prompt_tokens": TTFT_PROMPT,
        "measured": args.only, "decode_input": "embeddings of random tokens; no LM head on the client",
        "server_flags": server_args(args, args.max_batch),
    }  # fmt: skip
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
               "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg(),
               "wall_s": round(time.monotonic() - started, 1)}  # fmt: skip
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps({**result, "targets_met": targets_met(result), "settings": settings, "machine": machine}))


if __name__ == "__main__":
    main()
