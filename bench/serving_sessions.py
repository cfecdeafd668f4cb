"""Driving sessions for :mod:`bench.serving`: a client over the servers, timed decode runs of many
sessions at once, one session's step times, and the load worker (another client process keeping
sessions decoding, ``python -m bench.serving --load-worker``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench.measure import CpuMeter

LOAD_WORKER_STEPS = 128  # positions a load session decodes before it rolls back to its prompt (and on)


def connect(path: Path, tickets, prefill_chunk: int | None = None):
    """The client model over one server pair (its own node: a peer of its own)."""
    from shoal import AutoDistributedModelForCausalLM
    from shoal.transport import TransportConfig

    extra = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
    return AutoDistributedModelForCausalLM.from_pretrained(
        str(path), list(tickets), transport=TransportConfig(bind_addr="127.0.0.1:0"), **extra
    )


def embedded_tokens(model, count: int, length: int, seed: int) -> torch.Tensor:
    """``[count, length, hidden]``: embeddings of random tokens (each session's prompt and decode inputs)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (count, length), generator=generator)
    with torch.inference_mode():
        return model.get_input_embeddings()(ids).contiguous()


def step_at(session, hidden: torch.Tensor, start: int) -> None:
    n = hidden.shape[1]
    session.step(hidden, torch.arange(start, start + n).unsqueeze(0), None)


def decode_run(model, count: int, prompt_tokens: int, new_tokens: int, seed: int, meter: CpuMeter) -> dict:
    """``count`` sessions prefill ``prompt_tokens`` each, then all decode ``new_tokens`` steps at once."""
    inputs = embedded_tokens(model, count, prompt_tokens + new_tokens, seed)
    sessions = [model.blocks.open_session(1, prompt_tokens + new_tokens) for _ in range(count)]
    go = threading.Barrier(count, action=lambda: marks.__setitem__("start", time.perf_counter()))
    marks: dict[str, float] = {}
    latencies: list[list[float]] = [[] for _ in range(count)]
    ends = [0.0] * count

    def drive(i: int) -> None:
        session, hidden = sessions[i], inputs[i : i + 1]
        step_at(session, hidden[:, :prompt_tokens], 0)
        go.wait(300)
        for t in range(prompt_tokens, prompt_tokens + new_tokens):
            started = time.perf_counter()
            step_at(session, hidden[:, t : t + 1], t)
            latencies[i].append((time.perf_counter() - started) * 1e3)
        ends[i] = time.perf_counter()

    threads = [threading.Thread(target=drive, args=(i,), name=f"session-{i}") for i in range(count)]
    try:
        cpu, client_cpu, started_at = meter.sample(), time.process_time(), time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        if any(thread.is_alive() for thread in threads) or any(len(lat) != new_tokens for lat in latencies):
            raise RuntimeError(f"a session of {count} did not finish its {new_tokens} steps")
        seconds = max(ends) - marks["start"]
        return {
            "sessions": count,
            "tokens_per_s": round(count * new_tokens / seconds, 2),
            "latencies_ms": [x for lat in latencies for x in lat],
            "foreign_cpu": round(meter.foreign(cpu), 3),
            "client_cpu_share": round((time.process_time() - client_cpu) / (time.perf_counter() - started_at), 3),
        }
    finally:
        for session in sessions:
            session.close()


def single_session_ms(model, steps: int, seed: int) -> list[float]:
    """Step latencies of one session decoding ``steps`` tokens after a 16-token prompt."""
    inputs = embedded_tokens(model, 1, 16 + steps, seed)
    session = model.blocks.open_session(1, 16 + steps)
    try:
        step_at(session, inputs[:, :16], 0)
        out = []
        for t in range(16, 16 + steps):
            started = time.perf_counter()
            step_at(session, inputs[:, t : t + 1], t)
            out.append((time.perf_counter() - started) * 1e3)
        return out
    finally:
        session.close()


class LoadWorker:
    """Another client (``--load-worker``: a process and node key of its own) keeping ``sessions``
    sessions decoding on the servers until :meth:`stop`."""

    def __init__(self, path: Path, tickets, sessions: int):
        spec = json.dumps({"model": str(path), "tickets": [str(t) for t in tickets], "sessions": sessions})
        cmd = [sys.executable, "-m", "bench.serving", "--load-worker", spec]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "decoding":
            raise RuntimeError(f"the load worker did not start (exit {self.proc.wait(60)}): {line!r}")

    def stop(self) -> dict:
        self.proc.stdin.close()
        stats = json.loads(self.proc.stdout.readline())
        self.proc.wait(60)
        return stats


def serve_load(spec: dict) -> None:
    """The load worker: open the sessions, decode with each in its own thread until stdin closes."""
    torch.set_num_threads(1)
    model = connect(Path(spec["model"]), spec["tickets"])
    count, prompt = spec["sessions"], 16
    inputs = embedded_tokens(model, count, prompt + 1, seed=99)
    sessions = [model.blocks.open_session(1, prompt + LOAD_WORKER_STEPS) for _ in range(count)]
    stop, steps = threading.Event(), [0] * count
    started = threading.Barrier(count + 1)

    def drive(i: int) -> None:
        session, position = sessions[i], prompt
        step_at(session, inputs[i : i + 1, :prompt], 0)
        started.wait(300)
        while not stop.is_set():
            if position == prompt + LOAD_WORKER_STEPS:
                session.position = position = prompt  # roll back: the same cost, never out of room
            step_at(session, inputs[i : i + 1, prompt:], position)
            position += 1
            steps[i] += 1

    threads = [threading.Thread(target=drive, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    started.wait(300)
    time.sleep(1.0)  # every session in its decode loop before the measurement begins
    print("decoding", flush=True)
    began, before = time.perf_counter(), sum(steps)
    sys.stdin.read()
    seconds, done = time.perf_counter() - began, sum(steps) - before
    stop.set()
    for thread in threads:
        thread.join(120)
    for session in sessions:
        session.close()
    print(json.dumps({"sessions": count, "steps": done, "tokens_per_s": round(done / seconds, 2)}), flush=True)
    model.close()
