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
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from shoal.checkpoints import load_config
from shoal.heap import freeze_startup_heap
from shoal.launch import ServerProcess, serve_args
from shoal.omp import child_environment
from shoal.transport import Ticket

TARGETS = {"llama270m": 0.9, "smollm2": 0.8}
OMP_ENV_MARK = "SHOAL_BENCH_STARTED_OMP_ENV"  # the OpenMP variables the benchmark was started with
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Once upon a time,"
PROMPT_TOKENS_RANDOM = 24
LOCAL_SPAN = "gateway_local_span"  # the client serves the first half itself (from_pretrained(local_blocks=...))


# ---- models -----------------------------------------------------------------------------------


def llama270m_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def ensure_random_model(name: str, make_config, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write a random-weight checkpoint once (sharded, one shard per block); return its directory."""
    from transformers import LlamaForCausalLM

    from shoal.checkpoints import save_sharded
    from shoal.checkpoints.fetch import shoal_home

    out = shoal_home() / "bench" / name
    marker = out / ".bench-complete"
    if marker.is_file():
        return out
    config = make_config()
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).eval()
    save_sharded(model, config, out, dtype=dtype)
    marker.write_text("ok\n")
    del model
    return out


def model_dir(name: str) -> Path:
    if name == "smollm2":
        from shoal.checkpoints import fetch_model

        return fetch_model("smollm2")
    if name == "llama270m":
        return ensure_random_model("llama270m", llama270m_config)
    raise SystemExit(f"unknown model {name!r}: choose smollm2, llama270m")


def prompt_ids(name: str, path: Path, vocab_size: int) -> torch.Tensor:
    if name == "smollm2":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))(PROMPT, return_tensors="pt").input_ids
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab_size, (1, PROMPT_TOKENS_RANDOM), generator=generator)


# ---- servers ----------------------------------------------------------------------------------


class Server(ServerProcess):
    """``python -m shoal.cli.main serve`` in a child process (:class:`shoal.launch.ServerProcess`),
    loading while the caller goes on: :meth:`wait_ready` returns its ticket.

    ``threads``: ``--num-threads`` and ``OMP_NUM_THREADS`` (None: torch's default); ``extra_args``
    go to ``shoal serve`` as they are (e.g. ``--device cuda --dtype bfloat16``); ``entry``: the
    interpreter arguments before ``serve``. The command line and environment are the benchmark's
    measured setup: this process's environment (with shoal's spin count, see :func:`main`) plus
    ``env``, standard input inherited."""

    def __init__(
        self,
        model: Path,
        blocks: tuple[int, int],
        threads: int | None = None,
        env: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        entry: Sequence[str] = ("-m", "shoal.cli.main"),
    ):
        self.blocks, self.threads = blocks, threads
        args = serve_args(model, blocks, "--request-timeout", "120", *extra_args, entry=entry)
        child_env = dict(env or {})
        if threads is not None:
            args += ["--num-threads", str(threads)]
            child_env["OMP_NUM_THREADS"] = str(threads)
        super().__init__(args, ready_timeout=None, env=child_env, stdin=None)

    def wait_ready(self, timeout: float = 300) -> Ticket:
        return super().wait_ready(timeout)


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


def halves(num_blocks: int) -> list[tuple[int, int]]:
    mid = num_blocks // 2
    return [(0, mid), (mid, num_blocks)]


# ---- contention -------------------------------------------------------------------------------


class CpuMeter:
    """CPU time used on this machine by processes other than this one and its children (the
    servers), from /proc: the benchmark shares its 2 cores with other work, and a run that other
    work slowed down measures that work, not shoal. Hypervisor steal counts as foreign too.

    Children are found through /proc/self/task/*/children, so this works inside a PID namespace
    whose /proc is the host's or its own (scripts/isolated remounts it)."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self) -> None:
        self.available = Path("/proc/stat").is_file()

    @staticmethod
    def _busy_ticks() -> int:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return user + nice + system + irq + softirq + steal

    @staticmethod
    def _proc_ticks(pid: str) -> int:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return 0
        fields = stat.rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (all threads)

    def _own_ticks(self) -> int:
        pids = {"self"}
        for children in Path("/proc/self/task").glob("*/children"):
            try:
                pids.update(children.read_text().split())
            except OSError:
                pass
        return sum(self._proc_ticks(pid) for pid in pids)

    def sample(self) -> tuple[float, int, int]:
        if not self.available:
            return time.monotonic(), 0, 0
        return time.monotonic(), self._busy_ticks(), self._own_ticks()

    def foreign(self, since: tuple[float, int, int]) -> float:
        """Fraction of the machine's CPU used by others since ``since`` (0: idle apart from us)."""
        if not self.available:
            return 0.0
        now = self.sample()
        seconds = now[0] - since[0]
        if seconds <= 0:
            return 0.0
        foreign_ticks = (now[1] - since[1]) - (now[2] - since[2])
        return max(0.0, foreign_ticks / self.TICK / seconds / (os.cpu_count() or 1))

    def wait_quiet(self, threshold: float, deadline: float, window: float = 1.0) -> float:
        """Sleep in ``window`` steps until others use less than ``threshold`` of the CPU (or the
        deadline passes); return the last foreign fraction seen."""
        while True:
            start = self.sample()
            time.sleep(window)
            foreign = self.foreign(start)
            if foreign < threshold or time.monotonic() >= deadline:
                return foreign


# ---- timing -----------------------------------------------------------------------------------


class StepClock(LogitsProcessor):
    """Timestamps every generation step (called once per new token, right after its forward).

    With a ``meter``, every 8 steps it checks the CPU other processes used since the run began;
    above ``abort_above`` the run is marked aborted and :class:`Abort` stops generation."""

    def __init__(self, sync=None, meter: CpuMeter | None = None, abort_above: float = 1.0) -> None:
        self.times: list[float] = []
        self.sync = sync  # e.g. torch.cuda.synchronize: stamp when the step's kernels are done
        self.meter, self.abort_above = meter, abort_above
        self.start = meter.sample() if meter is not None else None
        self.aborted = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.sync is not None:
            self.sync()
        self.times.append(time.perf_counter())
        if self.meter is not None and len(self.times) % 8 == 0 and len(self.times) > 8:
            self.aborted = self.meter.foreign(self.start) > self.abort_above
        return scores


class Abort(StoppingCriteria):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.clock.aborted, dtype=torch.bool, device=input_ids.device)


class BlockTimer:
    """Wraps a model's ``blocks`` (a BlockSequence): sums the time spent inside session steps."""

    def __init__(self, inner) -> None:
        self.inner, self.num_blocks = inner, inner.num_blocks
        self.step_times: list[float] = []

    def forward(self, *args):
        return self.inner.forward(*args)

    def open_session(self, batch_size: int, max_length: int):
        timer = self
        session = self.inner.open_session(batch_size, max_length)

        class Timed:
            def __getattr__(self, name):
                return getattr(session, name)

            def __setattr__(self, name, value):
                setattr(session, name, value)

            def step(self, *args):
                t = time.perf_counter()
                out = session.step(*args)
                timer.step_times.append(time.perf_counter() - t)
                return out

            def close(self):
                session.close()

        return Timed()


def run_once(
    model,
    input_ids: torch.Tensor,
    new_tokens: int,
    pad_token_id: int | None,
    sync=None,
    meter: CpuMeter | None = None,
    abort_above: float = 1.0,
) -> tuple[dict | None, torch.Tensor]:
    """One greedy ``generate`` of exactly ``new_tokens``; returns (timings, output ids). With a
    ``meter``: timings get ``foreign_cpu`` (share of the machine other processes used meanwhile),
    and are None when the run was aborted because that share exceeded ``abort_above``."""
    clock = StepClock(sync, meter, abort_above)
    timer = model.blocks if isinstance(getattr(model, "blocks", None), BlockTimer) else None
    if timer is not None:
        timer.step_times.clear()
    if sync is not None:
        sync()
    start = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([clock]),
        stopping_criteria=StoppingCriteriaList([Abort(clock)]),
        pad_token_id=pad_token_id,
    )
    if clock.aborted:
        return None, out
    times = clock.times
    assert len(times) == new_tokens, f"{len(times)} steps for {new_tokens} tokens"
    decode_s = times[-1] - times[0]
    result = {"ttft_ms": (times[0] - start) * 1e3, "decode_tok_s": (new_tokens - 1) / decode_s}
    if timer is not None and len(timer.step_times) == new_tokens:
        step_ms = decode_s / (new_tokens - 1) * 1e3
        blocks_ms = statistics.fmean(timer.step_times[1:]) * 1e3  # steps 2..N (step 1 is the prefill)
        result.update(blocks_ms=blocks_ms, client_ms=step_ms - blocks_ms)
    if meter is not None:
        result["foreign_cpu"] = meter.foreign(clock.start)
    return result, out


def summarize(runs: list[dict]) -> dict:
    keys = [k for k in ("decode_tok_s", "ttft_ms", "blocks_ms", "client_ms") if all(k in r for r in runs)]
    summary = {f"{k}_median": round(statistics.median(r[k] for r in runs), 3) for k in keys}
    summary["decode_tok_s_best"] = round(max(r["decode_tok_s"] for r in runs), 3)
    summary["decode_tok_s_runs"] = [round(r["decode_tok_s"], 2) for r in runs]
    return summary


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
