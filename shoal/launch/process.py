"""``shoal serve`` child processes on this machine (demo, benchmarks, tests), always cleaned up.

A child prints ``ticket: <TICKET>`` when ready; SIGTERM stops it (a server leaves gracefully),
SIGKILL ends it on the spot.
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

from shoal.ids import BlockRange
from shoal.transport import Ticket

#: The interpreter arguments before ``serve``: a module run with ``-m`` (e.g. ``testkit.faulty_server``)
#: or the whole prefix (e.g. ``("-m", "bench.profile_step", "--serve")``).
Entry = str | Sequence[str]


class ChildProcess:
    """A child ``python ARGS...`` that is ready once it prints a line ``PREFIX VALUE``; every line of
    its output (stdout and stderr) is kept in ``output``, read by a thread from the start (a child
    whose pipe fills up would block).

    ``ready_timeout`` None: return at once and call :meth:`wait_ready` later (children load in
    parallel). ``env`` is added to this process's environment; ``stdin`` as for ``subprocess.Popen``
    (None: this process's)."""

    def __init__(
        self,
        args: Sequence[str],
        ready_prefix: str,
        ready_timeout: float | None = 180.0,
        env: dict[str, str] | None = None,
        stdin: int | None = subprocess.PIPE,
    ):
        self.args = list(args)
        self.ready_prefix = ready_prefix
        self.proc = subprocess.Popen(
            [sys.executable, *self.args],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.output: list[str] = []
        self.ready_value: str | None = None
        self._ready = threading.Event()
        self._terminated = False
        threading.Thread(target=self._read, daemon=True).start()
        if ready_timeout is not None:
            self.wait_ready(ready_timeout)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            if self.ready_value is None and line.startswith(self.ready_prefix):
                self.ready_value = line[len(self.ready_prefix) :].strip()
                self._ready.set()
        self._ready.set()  # it exited without becoming ready

    def wait_ready(self, timeout: float = 180.0) -> str:
        """The ready line's value; RuntimeError (the child killed, its output quoted) if it exits or
        ``timeout`` passes first."""
        self._ready.wait(timeout)
        if self.ready_value is None:
            self.kill()
            raise RuntimeError(f"process {self.args} did not become ready:\n{self.text()[-4000:]}")
        return self.ready_value

    def text(self) -> str:
        """Its output so far."""
        return "".join(self.output)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM, once, without waiting: a second one during shutdown would cut it short."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.terminate()

    def stop(self, timeout: float = 15.0) -> int | None:
        """:meth:`terminate`, wait up to ``timeout``, then SIGKILL; its exit code."""
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (no shutdown at all), and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


class ServerProcess(ChildProcess):
    """A ``shoal serve`` child (or one with the same output): ready once it prints ``ticket: ...``."""

    def __init__(
        self,
        args: Sequence[str],
        ready_timeout: float | None = 180.0,
        env: dict[str, str] | None = None,
        stdin: int | None = subprocess.PIPE,
    ):
        self._ticket: Ticket | None = None
        super().__init__(args, "ticket: ", ready_timeout, env, stdin)

    def wait_ready(self, timeout: float = 180.0) -> Ticket:
        if self._ticket is None:
            self._ticket = Ticket.parse(super().wait_ready(timeout))
        return self._ticket

    @property
    def ticket(self) -> Ticket:
        if self._ticket is None:
            raise RuntimeError(f"process {self.args} is not ready yet: call wait_ready()")
        return self._ticket


def stop_all(processes: Sequence[ChildProcess], timeout: float = 15.0) -> None:
    """SIGTERM every one at once, then wait for each (SIGKILL after ``timeout``): they shut down in
    parallel."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.stop(timeout)


def even_spans(num_blocks: int, parts: int) -> list[BlockRange]:
    """``parts`` contiguous spans covering ``[0, num_blocks)``, sizes differing by at most 1."""
    if not 0 < parts <= num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks into {parts} spans")
    bounds = [round(i * num_blocks / parts) for i in range(parts + 1)]
    return [BlockRange(start, end) for start, end in itertools.pairwise(bounds)]


def serve_args(
    model_dir: str | Path, span: BlockRange | tuple[int, int], *extra: str, entry: Entry = "shoal.cli.main"
) -> list[str]:
    """Arguments of ``python -m shoal.cli.main serve`` for ``span`` on loopback (``entry``: another
    entry point taking the same arguments, e.g. ``testkit.faulty_server``)."""
    prefix = ["-m", entry] if isinstance(entry, str) else list(entry)
    blocks = span if isinstance(span, BlockRange) else BlockRange(*span)
    return [*prefix, "serve", str(model_dir), "--blocks", str(blocks), "--host", "127.0.0.1", *extra]


def join_flags(join: Ticket | str | None) -> list[str]:
    """``shoal serve`` flags that create a swarm (``join`` None) or join one through ``join``."""
    return ["--new-swarm"] if join is None else ["--join", str(join)]


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


def wait_converged(model_dir: str | Path, servers: Sequence[ServerProcess], timeout: float = 30.0) -> None:
    """Until the table of each running one of ``servers`` (members of one swarm, serving the model
    at ``model_dir``) lists exactly the running ones, online: records of servers that left have
    expired or gone offline everywhere, so a client joining through any ticket sees them all."""
    import asyncio

    from shoal.checkpoints import model_name
    from shoal.client.remote.listing import swarm_spans
    from shoal.transport import Node, TransportConfig

    model = model_name(str(model_dir))

    async def views(node: Node, running: list[ServerProcess]) -> list[set[tuple[str, tuple[str, ...]]]]:
        async def one(ticket: Ticket) -> set[tuple[str, tuple[str, ...]]]:
            try:
                spans = await swarm_spans(node, [ticket], model, 2.0)
            except Exception:  # not answering yet, or the model's record not there yet
                return set()
            return {(s.peer_id, tuple(s.ticket.addrs)) for s in spans}

        return list(await asyncio.gather(*(one(s.ticket) for s in running)))

    async def poll() -> None:
        async with await Node.start(TransportConfig(bind_addr="127.0.0.1:0")) as node:
            deadline = time.monotonic() + timeout
            while True:
                running = [s for s in servers if s.alive]
                want = {(s.ticket.peer_id, tuple(s.ticket.addrs)) for s in running}
                if all(view == want for view in await views(node, running)):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the swarm's tables did not converge within {timeout} s")
                await asyncio.sleep(0.1)

    asyncio.run(poll())


class LocalSwarm:
    """``shoal serve`` processes of one model on loopback; a context manager that stops them all.

    ``extra_args`` and ``env`` apply to every server. ``swarm=True``: they form one swarm; a server
    started while none runs creates it (``--new-swarm``), every other joins through a running
    server's ticket (or the ``join`` given to :meth:`start`). ``share_counters``: the servers answer
    ``info`` with their counters (``--share-counters``)."""

    def __init__(
        self,
        model_dir: str | Path,
        spans: Sequence[BlockRange | tuple[int, int]] = (),
        extra_args: Sequence[str] = (),
        *,
        swarm: bool = False,
        env: dict[str, str] | None = None,
        entry: Entry = "shoal.cli.main",
        ready_timeout: float = 180.0,
        share_counters: bool = True,
    ):
        self.model_dir = Path(model_dir)
        # the harness runs every server: tests and benchmarks read their counters over info
        self.extra_args = (*extra_args, "--share-counters") if share_counters else tuple(extra_args)
        self.swarm = swarm
        self.env = env
        self.entry = entry
        self.ready_timeout = ready_timeout
        self.servers: list[ServerProcess] = []  # every server started, in start order
        if spans:
            try:
                self.start(spans)
            except BaseException:
                self.stop()
                raise

    def start(
        self,
        spans: Sequence[BlockRange | tuple[int, int]],
        extra: Sequence[Sequence[str]] = (),
        join: Ticket | None = None,
    ) -> list[ServerProcess]:
        """Servers for ``spans`` (``extra[i]``: more arguments for the i-th), loading in parallel;
        in the order of ``spans``. In a swarm that none runs yet, the first creates it and the others
        join once it is up. RuntimeError if any failed to start (those that did keep running)."""
        specs = [(span, tuple(extra[i]) if i < len(extra) else ()) for i, span in enumerate(spans)]
        started: list[ServerProcess] = []
        if self.swarm and join is None:
            running = self.running
            if running:
                join = running[0].ticket
            elif specs:
                started.append(self._launch(*specs.pop(0), None))
                self.servers += started
                join = started[0].ticket
        joined, errors = start_parallel([lambda spec=spec: self._launch(*spec, join) for spec in specs])
        self.servers += [s for s in joined if s is not None]
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(spans)} servers did not start:\n" + "\n".join(errors))
        return started + joined

    def _launch(self, span: BlockRange | tuple[int, int], extra: Sequence[str], join: Ticket | None) -> ServerProcess:
        swarm = join_flags(join) if self.swarm else []
        args = serve_args(self.model_dir, span, *self.extra_args, *extra, *swarm, entry=self.entry)
        return ServerProcess(args, self.ready_timeout, self.env)

    @property
    def running(self) -> list[ServerProcess]:
        return [s for s in self.servers if s.alive]

    @property
    def tickets(self) -> list[Ticket]:
        """The running servers' tickets, in start order."""
        return [s.ticket for s in self.running]

    def check_alive(self, expected_gone: Sequence[ServerProcess] = ()) -> None:
        """RuntimeError quoting the output of every server that exited (but those ``expected_gone``)."""
        dead = [s for s in self.servers if not s.alive and s not in expected_gone]
        if dead:
            raise RuntimeError(
                "servers exited:\n"
                + "\n".join(f"--- {s.args} (exit {s.proc.returncode}):\n{s.text()[-3000:]}" for s in dead)
            )

    def wait_converged(self, timeout: float = 30.0) -> None:
        """:func:`wait_converged` for this swarm's servers (``swarm=True`` only)."""
        wait_converged(self.model_dir, self.servers, timeout)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every server (:func:`stop_all`)."""
        stop_all(self.servers, timeout)

    def kill(self) -> None:
        """SIGKILL every server: an end without shutdown (where how servers leave is not the point,
        e.g. the teardown of a swarm whose members lost a peer, which takes them seconds to leave)."""
        for server in self.servers:
            server.kill()

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
