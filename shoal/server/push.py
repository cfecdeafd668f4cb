"""The server-to-server hand-off of a step's output to the next server of its chain (``push``).

A ``step`` may carry the rest of the chain (:class:`~shoal.wire.schema.PushHop`: tickets, session
ids, tokens, each token bound to the hop before it: :mod:`shoal.verify.tokens`). :class:`Pusher`
sends the output on to the first of them on a server-to-server stream kept per target (so pushes of
one chain arrive in order), in the codec of the client's reply (the next server decodes the very
tensor the client does), and passes the rest of the route on (its tokens are of no use to this
server, nor to the next: only to the hop each is bound to).

Whom a server pushes to (a client names the route; a server does not dial whatever it names):

* in a swarm, only a peer whose record in the server's table says it is an **online member
  serving the next blocks** (same model, its span starting where this one ends) that this server
  has reached (admitted, :mod:`shoal.swarm.liveness`), and at the addresses that record announces,
  whatever addresses the client's ticket holds. A non-member, a member of other blocks, one still
  joining, gone offline, not yet reached or found unreachable, is never dialled;
* standalone (no swarm, so no table to ask), only a peer the client named that **answers ``info``
  with the next blocks** of the same model, asked first on every new push stream; a peer that
  answered otherwise is not dialled again for :data:`REFUSED_SECONDS`;
* never a server this one convicted of lying (:mod:`shoal.server.judge`).

A refused push is a failed one (``pushed: false``, counted in ``pushes_failed``): the client then
drives that hop itself, with the same tokens (it answers the same), as after any failed push.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from shoal.errors import RefusedError, RemoteError, ShoalError
from shoal.ids import BlockRange, PeerId
from shoal.protocols import BLOCKS
from shoal.swarm.liveness import Reach
from shoal.swarm.records import ServerRecord, State
from shoal.swarm.table import RecordTable
from shoal.transport import BaseNode, MessageStream, Ticket
from shoal.wire import Message
from shoal.wire.schema import InfoReply, PushHop, PushRequest, ServerCounters, SpanInfo

log = logging.getLogger(__name__)
MAX_PUSH_TARGETS = 256
MAX_TICKETS = 1024  # parsed tickets and refusals remembered (bounded: tickets come from clients)
REFUSED_SECONDS = 10.0  # a standalone server's peer that answered with other blocks is not asked again meanwhile
PUSH_DIAL_TIMEOUT = 2.0  # dialling the next server, and (standalone) its answer to ``info``


class PushRefused(ShoalError):
    """The next hop a route names is not one this server pushes to (see the module docstring)."""


class Pusher:
    """A server's pushes, leaving through ``node`` (the server's endpoint; None: a server that
    answers on none pushes nothing), for the span ``span`` (its next blocks start at its end).
    ``table``: the server's swarm table (None: a standalone server). ``refuses(peer)``: whether
    that peer is one never to push to."""

    def __init__(
        self,
        counters: ServerCounters,
        node: BaseNode | None,
        span: SpanInfo,
        table: RecordTable | None = None,
        refuses: Callable[[PeerId], bool] = lambda peer: False,
    ):
        self.counters = counters
        self.node = node
        self.span = span
        self.table = table
        self.refuses = refuses
        self._streams: dict[Ticket, MessageStream] = {}
        self._locks: dict[Ticket, asyncio.Lock] = {}
        self._tickets: dict[str, Ticket] = {}
        self._refused: dict[Ticket, float] = {}  # standalone: peers that answered with other blocks, until when

    def via(self, node: BaseNode | None) -> Pusher:
        """The same pushes (span, table, refusals, counters) leaving through ``node`` instead."""
        return Pusher(self.counters, node, self.span, self.table, self.refuses)

    async def push(self, reply: Message, message: Message, route: tuple[PushHop, ...]) -> bool:
        """Hand ``reply``'s output (to step ``message``) to the next server of ``route``; False if
        it was refused or could not be sent (the client then drives that hop itself)."""
        if self.node is None:
            return False
        meta = PushRequest(
            session=route[0].session,
            token=route[0].token,
            position=message.meta.position,
            step=message.id,
            push=route[1:],
            receipt=message.meta.receipt,
        )
        tensors = [reply.tensors[0], *message.tensors[1:]]  # our output, the same positions and mask
        try:
            target = self._target(route[0].ticket)
            if len(self._streams) > MAX_PUSH_TARGETS:  # bounded: targets come from clients
                await self.close()
            # keyed by the whole ticket: a peer restarted at new addresses gets a new stream
            lock = self._locks.setdefault(target, asyncio.Lock())
            async with lock:
                stream = self._streams.get(target)
                if stream is None or stream.broken:
                    stream = await self._open(target)
                    self._streams[target] = stream
                try:
                    # in the codec of the client's reply: the next server decodes what the client does
                    await stream.send(Message("push", stream.next_id(), meta, tensors, reply.codecs))
                except ShoalError:
                    self._streams.pop(target, None)
                    raise
        except (ShoalError, ValueError) as exc:
            self.counters.pushes_failed += 1
            log.info("push to the next server failed: %s", exc)
            return False
        self.counters.pushes_sent += 1
        return True

    def _target(self, text: str) -> Ticket:
        """Where to push for the route's next hop ``text`` (a ticket): a member's announced
        addresses in a swarm, the ticket itself standalone. Raises :class:`PushRefused`."""
        ticket = self._ticket(text)
        peer = ticket.peer_id
        if self.refuses(peer):
            raise PushRefused(f"server {peer[:10]} was convicted of lying here: no pushes to it")
        if self.table is None:
            until = self._refused.get(ticket)
            if until is not None and time.monotonic() < until:
                raise PushRefused(f"peer {peer[:10]} does not serve blocks from {self.span.blocks.end} on")
            return ticket
        return self._member(PeerId(peer))

    def _member(self, peer: PeerId) -> Ticket:
        """``peer``'s ticket from its record in the swarm table, if it is an online member serving
        the blocks after this server's. Raises :class:`PushRefused`."""
        signed = self.table.get(f"s:{peer}") if self.table is not None else None
        record = signed.record if signed is not None else None
        if not isinstance(record, ServerRecord) or record.state is not State.ONLINE or record.expires <= time.time():
            raise PushRefused(f"peer {peer[:10]} is not an online member of the swarm")
        if self.table.reach(record) is not Reach.REACHABLE:  # not admitted here: never reached, or lost
            raise PushRefused(f"member {peer[:10]} has not been reached from here at the addresses it announces")
        if record.model != self.span.model or record.start != self.span.blocks.end:
            raise self._not_next(f"member {peer[:10]}", record.model, record.blocks)
        return Ticket(record.peer, record.addrs, record.relay, record.swarm)

    async def _open(self, target: Ticket) -> MessageStream:
        """A new push stream to ``target``; standalone, only once it answered ``info`` with the next
        blocks of the same model (else it is refused for a while)."""
        if self.table is not None:  # a member: its record said what it serves
            return await self.node.open_stream(target, BLOCKS, timeout=PUSH_DIAL_TIMEOUT)
        stream = None
        try:
            stream = await self.node.open_stream(target, BLOCKS, timeout=PUSH_DIAL_TIMEOUT)
            reply = (await stream.request(Message("info", stream.next_id()), PUSH_DIAL_TIMEOUT)).reply(InfoReply)
            if not self._serves_next(reply.span):
                raise self._not_next(f"peer {target.peer_id[:10]}", reply.span.model, reply.span.blocks)
        except BaseException as exc:
            if stream is not None:
                await stream.abort()
            # what it answered (a refusal too; not silence): ask no more for a while
            if isinstance(exc, PushRefused | RemoteError | RefusedError):
                if len(self._refused) >= MAX_TICKETS:
                    self._refused.clear()
                self._refused[target] = time.monotonic() + REFUSED_SECONDS
            raise
        return stream

    def _not_next(self, who: str, model: str, blocks: BlockRange) -> PushRefused:
        mine = self.span
        return PushRefused(f"{who} serves blocks {blocks.start}:{blocks.end} of {model}, not those from "
                           f"{mine.blocks.end} on of {mine.model}")  # fmt: skip

    def _serves_next(self, span: SpanInfo) -> bool:
        mine = self.span
        return span.model == mine.model and span.num_blocks == mine.num_blocks and span.blocks.start == mine.blocks.end

    async def close(self) -> None:
        """Finish every push stream (a drain, or too many targets)."""
        streams, self._streams, self._locks = self._streams, {}, {}
        for stream in streams.values():
            await stream.finish()

    def _ticket(self, text: str) -> Ticket:
        ticket = self._tickets.get(text)
        if ticket is None:
            if len(self._tickets) >= MAX_TICKETS:
                self._tickets.clear()
            ticket = self._tickets[text] = Ticket.parse(text)
        return ticket


__all__ = ["MAX_PUSH_TARGETS", "REFUSED_SECONDS", "PushRefused", "Pusher"]
