"""Start shoal server processes on this machine (demo, benchmarks, tests) and always clean up.

A child prints ``ticket: <TICKET>`` when ready; closing its stdin or SIGTERM stops it.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from shoal.transport import Ticket


class ServerProcess:
    """A child ``python ARGS...`` that prints ``ticket: ...`` when ready; its output is kept."""

    def __init__(self, args: Sequence[str], ready_timeout: float = 180.0, env: dict | None = None):
        self.args = list(args)
        self.proc = subprocess.Popen(
            [sys.executable, *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.output: list[str] = []
        self._terminated = False
        self.ticket = self._wait_ready(ready_timeout)
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout: float) -> Ticket:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            if line.startswith("ticket: "):
                return Ticket.parse(line.split(" ", 1)[1])
        self.kill()
        raise RuntimeError(f"process {self.args} did not become ready:\n{''.join(self.output)[-4000:]}")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 15.0) -> int:
        """Ask the child to exit (SIGTERM), then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            if not self._terminated:  # a second SIGTERM would cut the server's shutdown short
                self._terminated = True
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def even_spans(num_blocks: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous half-open spans covering ``[0, num_blocks)``, sizes differing by at most 1."""
    if not 0 < parts <= num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks into {parts} spans")
    bounds = [round(i * num_blocks / parts) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def serve_args(model_dir: str | Path, span: tuple[int, int], *extra: str) -> list[str]:
    return [
        "-m",
        "shoal.cli.main",
        "serve",
        str(model_dir),
        "--blocks",
        f"{span[0]}:{span[1]}",
        "--host",
        "127.0.0.1",
        *extra,
    ]


T = TypeVar("T")


def start_parallel(starters: Sequence[Callable[[], T]]) -> tuple[list[T | None], list[str]]:
    """Call every starter in its own thread (servers load in parallel) and wait for all; returns
    what each started (None where it failed) and the failures' messages."""
    started: list[T | None] = [None] * len(starters)
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            started[i] = starters[i]()
        except Exception as exc:  # reported to the caller once every thread ended
            errors.append(str(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(starters))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return started, errors


class LocalSwarm:
    """Servers for ``spans`` of one model on loopback; a context manager that stops them all."""

    def __init__(self, model_dir: str | Path, spans: Sequence[tuple[int, int]], extra_args: Sequence[str] = ()):
        starters = [lambda span=span: ServerProcess(serve_args(model_dir, span, *extra_args)) for span in spans]
        started, errors = start_parallel(starters)
        self.servers: list[ServerProcess] = [s for s in started if s is not None]  # in the order of spans
        if errors:
            self.stop()
            raise RuntimeError(f"only {len(self.servers)} of {len(spans)} servers started:\n" + "\n".join(errors))

    @property
    def tickets(self) -> list[Ticket]:
        return [s.ticket for s in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
