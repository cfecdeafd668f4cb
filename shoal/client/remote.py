"""The block stack as a chain of remote servers: a :class:`~shoal.client.blocks.BlockSequence`
over the ``shoal/blocks/1`` protocol.

The synchronous methods (called from transformers' generate) hand coroutines to the process's
client event loop (:mod:`shoal.client.runtime`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from torch import Tensor

from shoal.client.runtime import LoopThread, shared_loop
from shoal.errors import BadRequest, NotFound, ShoalError
from shoal.protocols import BLOCKS
from shoal.routing import ServerSpan, plan_chain
from shoal.swarm.records import State
from shoal.swarm.service import decode_table, fetch_table
from shoal.swarm.table import RecordTable
from shoal.transport import MessageStream, Node, Ticket, TransportConfig
from shoal.wire import Message

log = logging.getLogger(__name__)


def _inputs(hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> list[Tensor]:
    return [hidden, position_ids] if mask is None else [hidden, position_ids, mask]


async def fetch_infos(node: Node, tickets: Sequence[Ticket], timeout: float) -> list[ServerSpan]:
    """Ask every given peer what it hosts; peers that fail to answer are skipped (and logged)."""

    async def one(ticket: Ticket) -> ServerSpan | None:
        try:
            reply = await node.request(ticket, BLOCKS, Message("info", 1), timeout=timeout)
        except ShoalError as exc:
            log.warning("peer %s did not answer info: %s", ticket.peer_id[:10], exc)
            return None
        meta = reply.meta
        return ServerSpan(ticket.peer_id, int(meta["start"]), int(meta["end"]), ticket, meta)

    return [span for span in await asyncio.gather(*(one(t) for t in tickets)) if span is not None]


async def swarm_spans(node: Node, tickets: Sequence[Ticket], model: str | None, timeout: float) -> list[ServerSpan]:
    """Pull the swarm's table through the first ticket that answers; the servers of ``model``."""
    swarm = next(t.swarm_id for t in tickets if t.swarm_id)
    table = RecordTable(swarm)
    for ticket in tickets:
        try:
            table.merge_many(decode_table(await fetch_table(node, ticket, timeout)))
            break
        except ShoalError as exc:
            log.warning("could not pull the swarm table from %s: %s", ticket.peer_id[:10], exc)
    else:
        raise ShoalError(f"no peer of swarm {swarm} answered; tried {len(tickets)} tickets")
    names = sorted(m.name for m in table.models())
    if model is None or table.model(model) is None:
        raise ShoalError(f"swarm {swarm} has no model {model!r}; it serves: {', '.join(names) or 'nothing yet'}")
    spans = []
    for record in table.servers(model):
        if record.state is State.ONLINE:
            ticket = Ticket(record.peer, record.addrs, record.relay, swarm)
            info = {"num_blocks": table.model(model).num_blocks, "hidden_size": None, "record": record}
            spans.append(ServerSpan(record.peer, record.start, record.end, ticket, info))
    return spans


def check_consistent(spans: Sequence[ServerSpan], num_blocks: int, hidden_size: int) -> None:
    """Servers must agree with the client's config and with each other on every block's weights."""
    seen: dict[int, tuple[str, str]] = {}
    for span in spans:
        info = span.info
        if info.get("num_blocks") != num_blocks or info.get("hidden_size") not in (hidden_size, None):
            raise ShoalError(
                f"server {span.peer_id[:10]} serves a model with {info.get('num_blocks')} blocks of size "
                f"{info.get('hidden_size')}, the client's config has {num_blocks} of size {hidden_size}"
            )
        for block, fingerprint in zip(range(span.start, span.end), info.get("fingerprints", []), strict=False):
            other = seen.setdefault(block, (fingerprint, span.peer_id))
            if other[0] != fingerprint:
                raise ShoalError(
                    f"servers {other[1][:10]} and {span.peer_id[:10]} hold different weights for block {block}"
                )


class RemoteSequence:
    """Blocks ``[0, num_blocks)`` served by a chain of peers."""

    def __init__(self, node: Node, runtime: LoopThread, chain: list[ServerSpan], num_blocks: int):
        self.node = node
        self.runtime = runtime
        self.chain = chain
        self.num_blocks = num_blocks

    @classmethod
    def connect(
        cls,
        initial_peers: Sequence[str | Ticket],
        num_blocks: int,
        hidden_size: int,
        transport: TransportConfig | None = None,
        runtime: LoopThread | None = None,
        model: str | None = None,
    ) -> RemoteSequence:
        """Tickets with a swarm id: join the swarm through any of them and route over its table
        (servers of ``model`` whose fingerprints match the swarm's model record). Plain tickets:
        ask each peer what it hosts."""
        runtime = runtime or shared_loop()
        tickets = [t if isinstance(t, Ticket) else Ticket.parse(t) for t in initial_peers]
        if not tickets:
            raise ValueError("initial_peers is empty: give at least one server ticket")
        transport = transport or TransportConfig()
        timeout = transport.deadlines.connect + transport.deadlines.request

        async def setup() -> tuple[Node, list[ServerSpan]]:
            node = await Node.start(transport)
            try:
                if any(t.swarm_id for t in tickets):
                    spans = await swarm_spans(node, tickets, model, timeout)
                else:
                    spans = await fetch_infos(node, tickets, timeout)
                check_consistent(spans, num_blocks, hidden_size)
                return node, plan_chain(spans, num_blocks)
            except BaseException:
                await node.close()
                raise

        node, chain = runtime.run(setup())
        log.info("route: %s", " -> ".join(f"{s.peer_id[:8]}[{s.start}:{s.end})" for s in chain))
        return cls(node, runtime, chain, num_blocks)

    def describe_route(self) -> list[dict]:
        return [{"peer": s.peer_id, "start": s.start, "end": s.end} for s in self.chain]

    def forward(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        return self.runtime.run(self._forward(hidden, position_ids, attention_mask))

    async def _forward(self, hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> Tensor:
        for span in self.chain:
            reply = await self.node.request(
                span.ticket, BLOCKS, Message("forward", 1, {}, _inputs(hidden, position_ids, mask))
            )
            hidden = reply.tensors[0]
        return hidden

    def open_session(self, batch_size: int, max_length: int) -> RemoteSession:
        session = RemoteSession(self, batch_size, max_length)
        self.runtime.run(session.open())
        return session

    def server_infos(self) -> list[dict]:
        """Fresh ``info`` of every server on the route (counters included)."""

        async def gather() -> list[dict]:
            replies = [await self.node.request(s.ticket, BLOCKS, Message("info", 1)) for s in self.chain]
            return [r.meta for r in replies]

        return self.runtime.run(gather())

    def close(self) -> None:
        self.runtime.run(self.node.close())


class RemoteSession:
    """An inference session open on every server of the chain, one stream each."""

    def __init__(self, sequence: RemoteSequence, batch_size: int, max_length: int):
        self.sequence = sequence
        self.batch_size = batch_size
        self.max_length = max_length
        self._position = 0
        self._streams: list[tuple[MessageStream, str]] = []
        self.closed = False

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if not 0 <= value <= self._position:
            raise ValueError(f"can only roll back: position {value} not in [0, {self._position}]")
        self._position = value

    async def open(self) -> None:
        node = self.sequence.node
        try:
            for span in self.sequence.chain:
                stream = await node.open_stream(span.ticket, BLOCKS)
                self._streams.append((stream, ""))
                reply = await stream.request(
                    Message("open", 1, {"max_length": self.max_length, "batch_size": self.batch_size})
                )
                self._streams[-1] = (stream, reply.meta["session"])
        except BaseException:
            await self._close()
            raise

    def step(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if self.closed:
            raise NotFound("session is closed")
        batch, n = hidden.shape[:2]
        if batch != self.batch_size:
            raise BadRequest(f"batch size {batch} != session batch size {self.batch_size}")
        if self._position + n > self.max_length:
            raise BadRequest(f"step of {n} at position {self._position} exceeds max_length {self.max_length}")
        out = self.sequence.runtime.run(self._step(hidden, position_ids, attention_mask))
        self._position += n
        return out

    async def _step(self, hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> Tensor:
        for stream, session_id in self._streams:
            meta = {"session": session_id, "position": self._position}
            reply = await stream.request(Message("step", stream.next_id(), meta, _inputs(hidden, position_ids, mask)))
            hidden = reply.tensors[0]
        return hidden

    async def _close(self) -> None:
        for stream, session_id in self._streams:
            try:
                if session_id and not stream.broken:
                    await stream.request(Message("close", stream.next_id()), timeout=5)
            except ShoalError:
                pass
            finally:
                await stream.finish()
        self._streams = []

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sequence.runtime.run(self._close())
