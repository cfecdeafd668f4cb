"""Routing tests' pieces: a swarm of named ``shoal serve`` processes (:class:`KillableSwarm`, on
:class:`shoal.launch.LocalSwarm`), clients joining it through one ticket, and generation hooks
(:class:`TokenRecorder`, :class:`AtStep`) shared with the in-process tests.

A killed member is not restarted under its old identity: iroh endpoints that held a connection to
the old instance do not reach a new instance of the same peer id at new addresses (seen here: their
dials time out for as long as we watched)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LogitsProcessor
from transformers.generation.streamers import BaseStreamer

from shoal import AutoDistributedModelForCausalLM
from shoal.launch import LocalSwarm, ServerProcess
from shoal.transport import Ticket
from tests.helpers.registry import LOOPBACK, process_swarm

Span = tuple[int, int]


@dataclass
class KillableSwarm:
    """Named ``shoal serve`` processes in one swarm (short gossip periods, one thread each)."""

    model_dir: Path
    members: dict[str, ServerProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.processes: LocalSwarm = process_swarm(self.model_dir)

    def start(self, specs: Sequence[tuple[str, Span, tuple[str, ...]]]) -> None:
        """``(name, span, extra flags)`` each, loading in parallel (the first founds the swarm unless
        one runs); returns once every running member's table lists every running member."""
        started = self.processes.start([span for _, span, _ in specs], [extra for _, _, extra in specs])
        self.members.update((name, process) for (name, _, _), process in zip(specs, started, strict=True))
        self.processes.wait_converged()

    def ticket(self, name: str) -> Ticket:
        return self.members[name].ticket

    def peer(self, name: str) -> str:
        return self.members[name].ticket.peer_id

    def name_of(self, peer: str) -> str:
        return next(name for name, process in self.members.items() if process.ticket.peer_id == peer)

    def kill(self, name: str) -> None:
        """SIGKILL: no shutdown at all, its connections just stop answering."""
        self.members[name].kill()

    def terminate(self, name: str) -> None:
        """SIGTERM, without waiting (the server drains meanwhile)."""
        self.members[name].terminate()

    def close(self) -> None:
        """SIGKILL all: how they leave is not what these tests look at, and after a member was
        killed a clean leave takes each survivor seconds (its offline record goes to the dead peer too)."""
        self.processes.kill()


def connect(swarm: KillableSwarm, first: str | None = None, **kwargs):
    """A client joining through one ticket only (``first``'s, else a running member's), once every
    table lists exactly the running members (a killed one's record has expired everywhere)."""
    swarm.processes.wait_converged()
    ticket = swarm.ticket(first) if first else swarm.processes.tickets[0]
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
    the step's blocks have run by then, so the action hits the next step. ``stamps``: when each
    step's scores were asked for (the gap around ``step`` is the recovery's cost)."""

    def __init__(self, step: int, action):
        self.step = step
        self.action = action
        self.calls = 0
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(time.perf_counter())
        if self.calls == self.step:
            self.action()
        self.calls += 1
        return scores

    def gap(self) -> float:
        """Seconds from the action's step to the next (the step that had to recover)."""
        return self.stamps[self.step + 1] - self.stamps[self.step]


def counters(model, exclude: Collection[str] = ()) -> dict[str, dict]:
    """peer -> counters (``info`` over the wire), for every server the client's directory knows but
    ``exclude`` (dead ones: asking them costs the whole timeout)."""
    import msgspec

    from shoal.protocols import BLOCKS
    from shoal.wire import Message
    from shoal.wire.schema import InfoReply

    blocks = model.blocks

    async def gather() -> dict[str, dict]:
        out = {}
        for span in blocks.directory.spans:
            if span.peer_id in exclude:
                continue
            with contextlib.suppress(Exception):
                reply = await blocks.node.request(span.ticket, BLOCKS, Message("info", 1), timeout=2.0)
                out[span.peer_id] = msgspec.structs.asdict(reply.reply(InfoReply).counters)
        return out

    return blocks.runtime.run(gather())


def wait_draining(model, peer: str, timeout: float = 10.0) -> None:
    """Until the server ``peer`` answers ``info`` with ``draining`` (it got SIGTERM and began leaving)."""
    from shoal.protocols import BLOCKS
    from shoal.wire import Message
    from shoal.wire.schema import InfoReply

    blocks = model.blocks
    span = next(s for s in blocks.directory.spans if s.peer_id == peer)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = blocks.runtime.run(blocks.node.request(span.ticket, BLOCKS, Message("info", 1), timeout=2.0))
        except Exception:
            return  # already gone
        if reply.reply(InfoReply).draining:
            return
        time.sleep(0.01)
    raise TimeoutError(f"server {peer[:10]} did not start draining within {timeout} s")
