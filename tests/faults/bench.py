"""What the fault seam's tests share: a faulty server and an honest one of the same span on an
in-memory network (:func:`pair`), sessions on them, and the inputs they are sent."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.ids import BlockRange
from shoal.protocols import BLOCKS
from shoal.server.builder import load_block_server
from shoal.server.config import ServerConfig
from shoal.server.handler import BlockServer
from shoal.server.preflight import check_server
from shoal.transport import BaseNode, MemoryNetwork, MessageStream, Ticket
from shoal.verify.tokens import push_token
from shoal.wire import Message
from shoal.wire.schema import OpenReply, OpenRequest, PushHop, StepReply, StepRequest
from testkit.faults import FaultRecord
from testkit.faulty import LocalServer, make_faulty, serve_locally

HIDDEN = 64
SPAN = (0, 3)


def load(model_dir: Path, start: int, end: int, faults: list | None = None) -> Callable[[BaseNode], BlockServer]:
    """Builds a server of blocks ``start:end`` for a node (made faulty with ``faults``, if any)."""
    blocks = BlockRange(start, end)
    checked = check_server(ServerConfig(model=str(model_dir), blocks=blocks, cache_tokens=256))

    def build(node: BaseNode) -> BlockServer:
        server = load_block_server(checked, blocks, node)
        return make_faulty(server, faults) if faults is not None else server

    return build


def inputs(n: int, start: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, HIDDEN, generator=generator), torch.arange(start, start + n)[None]]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


class Session:
    """One session on one server, driven over the stream that opened it."""

    def __init__(self, stream: MessageStream, opened: OpenReply):
        self.stream, self.opened, self.position = stream, opened, 0
        self.last_id = 0  # the id of the latest step sent

    @classmethod
    async def open(cls, node: BaseNode, ticket: Ticket, max_length: int = 32) -> Session:
        stream = await node.open_stream(ticket, BLOCKS, timeout=5.0)
        reply = await stream.request(Message("open", 1, OpenRequest(max_length=max_length)), timeout=5.0)
        return cls(stream, reply.reply(OpenReply))

    def hop(self, ticket: Ticket, previous: str) -> Callable[[int, int, int], PushHop]:
        """Where the previous server (peer id ``previous``) pushes into this session (at ``ticket``):
        the hop for a step (its id, position and positions), with the token for that step."""

        def bound(step: int, position: int, n: int) -> PushHop:
            token = push_token(self.opened.token, previous, step=step, position=position, n=n, receipt=False)
            return PushHop(ticket=str(ticket), session=self.opened.session, token=token)

        return bound

    async def step(
        self, tensors: list[torch.Tensor], push: Sequence[Callable[[int, int, int], PushHop]] = (), timeout: float = 5.0
    ):
        self.last_id = self.stream.next_id()
        route = tuple(hop(self.last_id, self.position, tensors[0].shape[1]) for hop in push)
        meta = StepRequest(session=self.opened.session, position=self.position, push=route)
        reply = await self.stream.request(Message("step", self.last_id, meta, tensors), timeout)
        self.position += tensors[0].shape[1]
        assert reply.reply(StepReply).position == self.position
        return reply.tensors[0]


@dataclass
class Pair:
    """A faulty server and an honest replica of the same blocks, and a client of both."""

    honest: LocalServer
    faulty: LocalServer
    client: BaseNode
    network: MemoryNetwork

    @property
    def record(self) -> FaultRecord:
        return self.faulty.server.record

    async def sessions(self) -> tuple[Session, Session]:
        return await Session.open(self.client, self.honest.ticket), await Session.open(self.client, self.faulty.ticket)

    async def drive(self, sizes: Sequence[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Steps of ``sizes`` new positions, the same to both: (input, honest output, faulty output) each."""
        honest, faulty = await self.sessions()
        out = []
        for i, n in enumerate(sizes):
            tensors = inputs(n, honest.position, seed + i)
            out.append((tensors[0], await honest.step(tensors), await faulty.step(tensors)))
        return out


@contextlib.asynccontextmanager
async def pair(model_dir: Path, faults, span: tuple[int, int] = SPAN) -> AsyncIterator[Pair]:
    network = MemoryNetwork()
    servers = []
    try:
        servers.append(await serve_locally(load(model_dir, *span), network))
        servers.append(await serve_locally(load(model_dir, *span, faults), network))
        yield Pair(*servers, await network.start(), network)
    finally:
        for server in servers:
            await server.close()
