"""What the benchmarks measure with: ``shoal serve`` processes (:class:`Server`), the CPU other
processes take meanwhile (:class:`CpuMeter`), and one timed greedy generation (:func:`run_once`:
TTFT, decode tokens/s, the time inside remote block calls)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from shoal.launch import ServerProcess, serve_args
from shoal.transport import Ticket


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


def halves(num_blocks: int) -> list[tuple[int, int]]:
    mid = num_blocks // 2
    return [(0, mid), (mid, num_blocks)]


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
