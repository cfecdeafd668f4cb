"""A swarm of ``shoal serve`` processes whose members can be killed and restarted, and clients that
join it through one ticket.

A restarted member gets a new identity: iroh endpoints that held a connection to the old instance
do not reach a new instance of the same peer id at new addresses (seen here: their dials time out
for as long as we watched), so the test swarm does not depend on that."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LogitsProcessor
from transformers.generation.streamers import BaseStreamer

from shoal import AutoDistributedModelForCausalLM
from shoal.launch import ServerProcess, start_parallel
from shoal.transport import Ticket
from tests.helpers.registry import LOOPBACK, swarm_server_args

Span = tuple[int, int]


@dataclass
class Member:
    name: str
    span: Span
    extra: tuple[str, ...]
    process: ServerProcess | None = None

    @property
    def ticket(self) -> Ticket:
        return self.process.ticket

    @property
    def peer(self) -> str:
        return self.process.ticket.peer_id

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.proc.poll() is None


@dataclass
class KillableSwarm:
    """Named servers in one swarm; :meth:`restart` brings one back (under a new peer id)."""

    model_dir: Path
    members: dict[str, Member] = field(default_factory=dict)

    def _args(self, member: Member, join: Ticket | None) -> list[str]:
        return swarm_server_args(self.model_dir, member.span, join, *member.extra)

    def start(self, specs: Sequence[tuple[str, Span, tuple[str, ...]]]) -> None:
        """The first spec founds the swarm (unless one is running); the rest join in parallel."""
        new = [Member(name, span, extra) for name, span, extra in specs]
        for member in new:
            self.members[member.name] = member
        if not any(m.alive for m in self.members.values()):
            first = new.pop(0)
            first.process = ServerProcess(self._args(first, None), env={"OMP_NUM_THREADS": "1"})
        self._start_parallel(new)
        self.wait_converged()

    def _start_parallel(self, members: Sequence[Member]) -> None:
        join = self.any_ticket()
        started, errors = start_parallel(
            [lambda m=m: ServerProcess(self._args(m, join), env={"OMP_NUM_THREADS": "1"}) for m in members]
        )
        for member, process in zip(members, started, strict=True):
            if process is not None:
                member.process = process
        if errors:
            raise RuntimeError("servers did not start:\n" + "\n".join(errors))

    def any_ticket(self, exclude: Sequence[str] = ()) -> Ticket:
        for member in self.members.values():
            if member.alive and member.name not in exclude:
                return member.ticket
        raise RuntimeError("no server of the swarm is running")

    def wait_converged(self, timeout: float = 30.0) -> None:
        """Until every running server's table lists exactly the running servers, online (records
        of killed ones have expired everywhere)."""
        import asyncio

        from shoal.checkpoints import model_name
        from shoal.client.directory import swarm_spans
        from shoal.transport import Node

        async def poll() -> None:
            async with await Node.start(LOOPBACK) as node:
                deadline = time.monotonic() + timeout
                while True:
                    running = [m for m in self.members.values() if m.alive]
                    want = {(m.peer, tuple(m.ticket.addrs)) for m in running}
                    seen = []
                    for member in running:
                        try:
                            spans = await swarm_spans(node, [member.ticket], model_name(str(self.model_dir)), 2.0)
                        except Exception:
                            spans = []
                        seen.append({(s.peer_id, tuple(s.ticket.addrs)) for s in spans})
                    if all(want == view for view in seen):
                        return
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"swarm tables did not converge within {timeout} s")
                    await asyncio.sleep(0.2)

        asyncio.run(poll())

    def by_peer(self, peer: str) -> Member:
        return next(m for m in self.members.values() if m.process is not None and m.peer == peer)

    def name_of(self, peer: str) -> str:
        return next((m.name for m in self.members.values() if m.process is not None and m.peer == peer), peer[:8])

    def kill(self, name: str) -> None:
        member = self.members[name]
        os.kill(member.process.pid, signal.SIGKILL)
        member.process.proc.wait(10)

    def terminate(self, name: str) -> None:
        """SIGTERM, without waiting (the server drains meanwhile)."""
        self.members[name].process.proc.terminate()

    def restart(self, names: Sequence[str]) -> None:
        for name in names:
            member = self.members[name]
            if member.alive:
                member.process.stop()
        self._start_parallel([self.members[n] for n in names])
        self.wait_converged()

    def close(self) -> None:
        for member in self.members.values():
            if member.alive:
                member.process.proc.terminate()
        for member in self.members.values():
            if member.process is not None:
                with contextlib.suppress(Exception):
                    member.process.stop(10)


def connect(swarm: KillableSwarm, first: str | None = None, **kwargs):
    """A client joining through ``first``'s ticket (its table holds its own newest record)."""
    ticket = swarm.members[first].ticket if first else swarm.any_ticket()
    return AutoDistributedModelForCausalLM.from_pretrained(
        str(swarm.model_dir), initial_peers=[ticket], transport=LOOPBACK, refresh_period=0, **kwargs
    )


class TokenRecorder(BaseStreamer):
    """Every token id ``generate`` streams (the prompt's first put is skipped)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.tokens.extend(int(t) for t in value.reshape(-1))

    def end(self) -> None:
        pass


class AtStep(LogitsProcessor):
    """Calls ``action`` once, when generate asks for the ``step``-th new token's scores (0-based);
    the step's blocks have run by then, so the action hits the next step."""

    def __init__(self, step: int, action):
        self.step = step
        self.action = action
        self.calls = 0
        self.fired_at: float | None = None
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(time.perf_counter())
        if self.calls == self.step:
            self.action()
            self.fired_at = time.perf_counter()
        self.calls += 1
        return scores


def counters(model) -> dict[str, dict]:
    """peer -> counters, for every server the client's directory knows that answers."""
    from shoal.protocols import BLOCKS
    from shoal.wire import Message

    blocks = model.blocks

    async def gather() -> dict[str, dict]:
        out = {}
        for span in blocks.directory.spans:
            with contextlib.suppress(Exception):
                reply = await blocks.node.request(span.ticket, BLOCKS, Message("info", 1), timeout=2.0)
                out[span.peer_id] = reply.meta["counters"]
        return out

    return blocks.runtime.run(gather())


def wait_draining(model, peer: str, timeout: float = 10.0) -> None:
    """Until the server ``peer`` answers ``info`` with ``draining`` (it got SIGTERM and began leaving)."""
    from shoal.protocols import BLOCKS
    from shoal.wire import Message

    blocks = model.blocks
    span = next(s for s in blocks.directory.spans if s.peer_id == peer)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = blocks.runtime.run(blocks.node.request(span.ticket, BLOCKS, Message("info", 1), timeout=2.0))
        except Exception:
            return  # already gone
        if reply.meta.get("draining"):
            return
        time.sleep(0.01)
    raise TimeoutError(f"server {peer[:10]} did not start draining within {timeout} s")
