"""Generation benchmark: greedy decode through a 2-server swarm vs plain transformers, one machine.

    scripts/isolated python -m bench.generate [--models smollm2,llama270m] [--new-tokens 64]
                                               [--repeats 5] [--server-threads 1,2,2p]

For each model, two ``shoal serve`` processes on loopback each host half of the blocks (one pair per
server thread setting, all started up front so runs can alternate); the client is
``AutoDistributedModelForCausalLM`` in this process. The local reference is
``AutoModelForCausalLM.from_pretrained`` (fp32) in a child process of its own, with the OpenMP
environment this benchmark was started with (stock, unless you set one). Each repeat runs local and
every swarm setting once, in a rotating order (the machine is shared and noisy: medians of
alternated runs are what is compared).

Per run: ``ttft_ms`` = generate() call to the first token's logits (session open + prefill + first
token), ``decode_tok_s`` = (new_tokens - 1) / time from the first to the last token's logits (a
LogitsProcessor timestamps each step). ``ratio`` = swarm decode tok/s / local decode tok/s (medians);
``ratio_best`` compares the best run of each (on a machine shared with other work, the best run is
the closest to an idle machine). Row ``gateway_local_span``: the client serves the first half
itself (``from_pretrained(local_blocks=...)``, what ``shoal api --serve-blocks`` does), the first
setting's second server the rest; its ``ratio_to_swarm`` is its decode tok/s over that 2-server
swarm's (one network hop fewer per token: above 1 expected). Also per swarm setting: the
client-side split of one decode step into time inside the remote block calls (``blocks_ms``:
transport + servers) and the rest (``client_ms``: embedding, final norm, LM head, generate's own
loop), medians of per-run means.

Shared machines: each run records ``foreign_cpu``, the share of the machine's CPU that processes
other than this benchmark and its servers used meanwhile (from /proc, steal included). Before each
run the benchmark waits for a quiet second; a run is *clean* below ``--quiet-below`` (0.15) and is
stopped and discarded above ``--abort-above`` (0.4). Runs repeat until every contender has
``--repeats`` clean runs or ``--max-minutes`` pass; summaries use the clean runs (noisy ones only if
there is no clean one, which ``summary_of`` says).

Thread policy: the local reference and the swarm client use ``--client-threads`` (default: all
cores). shoal's own processes lower libgomp's spin count (:mod:`shoal.omp`: a worker that spins
after its stage is done takes a core from the next stage on the same machine); ``shoal serve``
does it itself, and this benchmark re-executes itself with it for the client, while the local
reference keeps the OpenMP environment the benchmark was started with. Each server setting ``N``
runs ``shoal serve --num-threads N`` with ``OMP_NUM_THREADS=N``; ``Np`` adds
``OMP_WAIT_POLICY=passive``; ``Nf`` runs the servers through ``bench.profile_step --serve`` (load
and compute forced onto one thread: what ``shoal serve`` now does by itself).

Prints JSON; ``targets_met``: ratio >= 0.9 for llama270m and >= 0.8 for smollm2 (best setting).
Models: ``smollm2`` (``shoal.checkpoints.fetch_model``) and ``llama270m`` (random Llama, hidden
1024, 16 layers, 16 heads, intermediate 2816, 32k vocab, untied: ~271M parameters; written once
under ``$SHOAL_HOME/bench/llama270m``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM

from bench.measure import BlockTimer, CpuMeter, Server, halves, run_once, summarize
from bench.models import model_dir, prompt_ids
from shoal.checkpoints import load_config
from shoal.heap import freeze_startup_heap
from shoal.omp import child_environment

TARGETS = {"llama270m": 0.9, "smollm2": 0.8}
OMP_ENV_MARK = "SHOAL_BENCH_STARTED_OMP_ENV"  # the OpenMP variables the benchmark was started with
LOCAL_SPAN = "gateway_local_span"  # the client serves the first half itself (from_pretrained(local_blocks=...))


# ---- servers ----------------------------------------------------------------------------------


class LocalWorker:
    """Plain transformers in a child process (``--local-worker``), answering one JSON line per
    request with ``run_once``'s timings and the generated ids. A process of its own keeps the
    reference's OpenMP environment apart from the swarm client's (see :mod:`shoal.omp`)."""

    def __init__(self, name: str, threads: int, env: dict[str, str]):
        cmd = [sys.executable, "-m", "bench.generate", "--local-worker", name, "--client-threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"the local reference for {name} did not start (exit {self.proc.wait()})")
        self.params = json.loads(hello)["params"]

    def run(self, new_tokens: int, meter: CpuMeter | None = None, abort_above: float = 1.0):
        """Like :func:`run_once` (the reference cannot be stopped mid-run: a noisy run is dropped after)."""
        start = meter.sample() if meter is not None else None
        self.proc.stdin.write(json.dumps({"new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        out = torch.tensor(reply.pop("out"))
        if meter is not None:
            reply["foreign_cpu"] = meter.foreign(start)
            if reply["foreign_cpu"] > abort_above:
                return None, out
        return reply, out

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def serve_local_worker(name: str) -> None:
    path = model_dir(name)
    config = load_config(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = prompt_ids(name, path, config.vocab_size)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    print(json.dumps({"params": sum(p.numel() for p in model.parameters())}), flush=True)
    for line in sys.stdin:
        run, out = run_once(model, ids, json.loads(line)["new_tokens"], pad)
        print(json.dumps({**run, "out": out.tolist()}), flush=True)


# ---- one model --------------------------------------------------------------------------------


def bench_model(name: str, args: argparse.Namespace) -> dict:
    from shoal import AutoDistributedModelForCausalLM
    from shoal.transport import TransportConfig

    path = model_dir(name)
    config = load_config(path)
    blocks = halves(config.num_hidden_layers)
    settings = {}
    for spec in args.server_threads:  # N, then p: OMP_WAIT_POLICY=passive, f: one torch thread (patched)
        env = {"OMP_WAIT_POLICY": "passive"} if "p" in spec else {}
        entry = ("-m", "shoal.cli.main")
        if "f" in spec:
            env["SHOAL_PROFILE_ONE_TORCH_THREAD"] = "1"
            entry = ("-m", "bench.profile_step", "--serve")
        threads = int(spec.rstrip("pf"))
        settings[spec] = [Server(path, b, threads, env, entry=entry) for b in blocks]
    reference = LocalWorker(name, args.client_threads, args.local_env)
    try:
        params = reference.params
        ids = prompt_ids(name, path, config.vocab_size)
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        swarms = {}
        for spec, servers in settings.items():
            tickets = [s.wait_ready() for s in servers]
            swarm = AutoDistributedModelForCausalLM.from_pretrained(
                str(path), tickets, transport=TransportConfig(bind_addr="127.0.0.1:0")
            )
            swarm.blocks = BlockTimer(swarm.blocks)
            swarms[f"server_threads_{spec}"] = swarm
        # the gateway as a peer: the client serves the first half itself (no hop to it), the first
        # setting's second server the rest
        first = next(iter(settings.values()))
        hosted = AutoDistributedModelForCausalLM.from_pretrained(
            str(path), [first[1].wait_ready()], transport=TransportConfig(bind_addr="127.0.0.1:0"),
            local_blocks=f"{blocks[0][0]}:{blocks[0][1]}",
        )  # fmt: skip
        hosted.blocks = BlockTimer(hosted.blocks)
        swarms[LOCAL_SPAN] = hosted
        freeze_startup_heap()  # as shoal's own long-lived processes do (see shoal.heap)

        def swarm_runner(model):
            return lambda meter=None: run_once(model, ids, args.new_tokens, pad, None, meter, args.abort_above)

        contenders = {"local": lambda meter=None: reference.run(args.new_tokens, meter, args.abort_above)}
        contenders.update((label, swarm_runner(model)) for label, model in swarms.items())

        outputs = {}
        for label, runner in contenders.items():  # warm-up (first-call allocations, connections)
            _, outputs[label] = runner()
        identical = {label: bool(torch.equal(outputs[label], outputs["local"])) for label in swarms}

        # Runs alternate (rotating order) until each contender has --repeats clean runs (others used
        # < --quiet-below of the CPU meanwhile) or the time budget is spent. Before each run, wait for
        # a quiet second; a run during which others take > --abort-above is stopped and not counted.
        meter = CpuMeter()
        deadline = time.monotonic() + args.max_minutes * 60
        labels = list(contenders)
        clean: dict[str, list[dict]] = {label: [] for label in labels}
        dirty: dict[str, list[dict]] = {label: [] for label in labels}
        aborted = dict.fromkeys(labels, 0)
        rep = 0
        while any(len(clean[label]) < args.repeats for label in labels) and time.monotonic() < deadline:
            order = labels[rep % len(labels) :] + labels[: rep % len(labels)]  # rotate who goes first
            rep += 1
            for label in order:
                if len(clean[label]) >= args.repeats or time.monotonic() >= deadline:
                    continue
                meter.wait_quiet(args.quiet_below, deadline)
                run, _ = contenders[label](meter)
                if run is None:
                    aborted[label] += 1
                else:
                    (clean if run["foreign_cpu"] < args.quiet_below else dirty)[label].append(run)

        def pick(label: str) -> dict:
            runs = clean[label] or dirty[label]
            if not runs:
                return {"summary_of": "no complete run: the machine was too busy", "aborted_runs": aborted[label]}
            summary = summarize(runs)
            summary.update(clean_runs=len(clean[label]), noisy_runs=len(dirty[label]), aborted_runs=aborted[label])
            summary["foreign_cpu_median"] = round(statistics.median(r["foreign_cpu"] for r in runs), 3)
            summary["summary_of"] = "clean runs" if clean[label] else "noisy runs (no clean run)"
            return summary

        result = {
            "params_m": round(params / 1e6, 1),
            "num_blocks": config.num_hidden_layers,
            "split": [list(b) for b in blocks],
            "prompt_tokens": int(ids.shape[1]),
            "local": pick("local"),
            "swarm": {},
            "tokens_identical_to_local": identical,
        }
        local = result["local"]
        for label in swarms:
            summary = pick(label)
            if "decode_tok_s_median" in local and "decode_tok_s_median" in summary:
                summary["ratio"] = round(summary["decode_tok_s_median"] / local["decode_tok_s_median"], 3)
                summary["ratio_best"] = round(summary["decode_tok_s_best"] / local["decode_tok_s_best"], 3)
                summary["ttft_ratio"] = round(summary["ttft_ms_median"] / local["ttft_ms_median"], 3)
            result["swarm"][label] = summary
        baseline = result["swarm"][f"server_threads_{next(iter(settings))}"]
        if "decode_tok_s_median" in baseline and "decode_tok_s_median" in result["swarm"][LOCAL_SPAN]:
            ratio = result["swarm"][LOCAL_SPAN]["decode_tok_s_median"] / baseline["decode_tok_s_median"]
            result["swarm"][LOCAL_SPAN]["ratio_to_swarm"] = round(ratio, 3)  # one hop fewer: above 1 expected
        rated = [k for k in result["swarm"] if "ratio" in result["swarm"][k] and k != LOCAL_SPAN]
        best = max(rated, key=lambda k: result["swarm"][k]["ratio"]) if rated else None
        result["best_setting"] = best
        result["ratio"] = result["swarm"][best]["ratio"] if best else None
        for swarm in swarms.values():
            swarm.blocks.inner.close()
        return result
    finally:
        reference.stop()
        for servers in settings.values():
            for server in servers:
                server.stop()


def uvloop_in_use() -> bool:
    try:
        from shoal.transport.loop import _uvloop
    except ImportError:
        return False
    return _uvloop() is not None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,llama270m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="clean runs wanted per contender")
    parser.add_argument("--max-minutes", type=float, default=15.0, help="time budget per model for the runs")
    parser.add_argument(
        "--quiet-below", type=float, default=0.15, help="a run is clean if others used less of the CPU meanwhile"
    )
    parser.add_argument("--abort-above", type=float, default=0.4, help="stop a run once others use more")
    parser.add_argument(
        "--server-threads",
        default="1,2",
        help="comma list, one server pair each: N threads; Np: OMP_WAIT_POLICY=passive; Nf: shoal serve patched "
        "to load and compute on one thread (bench.profile_step; a suggested fix, not shoal as it is)",
    )
    parser.add_argument("--client-threads", type=int, default=os.cpu_count(), help="torch threads here")
    parser.add_argument("--local-worker", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.local_worker:
        torch.set_num_threads(args.client_threads)
        serve_local_worker(args.local_worker)
        return
    if OMP_ENV_MARK not in os.environ:  # libgomp read its environment when torch loaded: set it, start again
        started = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))}
        env = child_environment({**os.environ, OMP_ENV_MARK: json.dumps(started)})  # shoal's spin count
        os.execve(
            sys.executable, [sys.executable, "-m", "bench.generate", *(sys.argv[1:] if argv is None else argv)], env
        )
    started_omp_env = json.loads(os.environ[OMP_ENV_MARK])
    args.local_env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_")) and k != OMP_ENV_MARK}
    args.local_env.update(started_omp_env)  # the reference runs as the benchmark was started
    args.server_threads = args.server_threads.split(",")
    if not all(t.rstrip("pf").isdigit() for t in args.server_threads):
        parser.error("--server-threads takes a comma list of N, Np, Nf or Npf (e.g. 1,2,2p,2f)")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2")
    torch.set_num_threads(args.client_threads)
    torch.manual_seed(0)
    load_at_start = os.getloadavg()

    models = {name: bench_model(name, args) for name in args.models.split(",")}
    result = {
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "run_filter": {
            "clean_if_foreign_cpu_below": args.quiet_below,
            "aborted_if_foreign_cpu_above": args.abort_above,
            "foreign_cpu": "share of the machine's CPU (all cores, steal included) used by processes other "
            "than this benchmark and its servers during the run",
        },
        "greedy": True,
        "thread_policy": {
            "local": f"transformers in a child process, torch.set_num_threads({args.client_threads}), "
            f"OpenMP environment as started: {started_omp_env}",
            "client": f"shoal client in the benchmark process, torch.set_num_threads({args.client_threads})",
            "servers": "2 processes per setting, each `shoal serve --num-threads N` (and OMP_NUM_THREADS=N) "
            f"for N in {args.server_threads} (Np: also OMP_WAIT_POLICY=passive; Nf: shoal serve patched by "
            "bench.profile_step to load and compute on one thread, the suggested libgomp fix)",
            "omp_env_of_benchmark_process": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
            "cpus": os.cpu_count(),
        },
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "loadavg_at_start": load_at_start,
            "loadavg_at_end": os.getloadavg(),
            "event_loop": "uvloop" if uvloop_in_use() else "asyncio",
        },
        "models": models,
    }
    result["targets_met"] = {
        f"{name} ratio>={TARGETS[name]}": (models[name]["ratio"] or 0) >= TARGETS[name]
        for name in models
        if name in TARGETS
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
