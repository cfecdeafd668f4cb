"""The server-to-server hand-off of a step's output to the next server of its chain (``push``).

A ``step`` may carry the rest of the chain (:class:`~shoal.wire.schema.PushHop`: tickets, session
ids, tokens). :class:`Pusher` sends the output on to the first of them on a server-to-server
stream kept per target (so pushes of one chain arrive in order), in the codec of the client's reply
(the next server decodes the very tensor the client does). It never pushes to a server this one
convicted of lying (:mod:`shoal.server.judge`): the client then drives that hop itself, as after
any failed push.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from shoal.errors import ShoalError
from shoal.ids import PeerId
from shoal.protocols import BLOCKS
from shoal.transport import BaseNode, MessageStream, Ticket
from shoal.wire import Message
from shoal.wire.schema import PushHop, PushRequest, ServerCounters

log = logging.getLogger(__name__)
MAX_PUSH_TARGETS = 256


class Pusher:
    """A server's pushes, leaving through ``node`` (the server's endpoint; None: a server that
    answers on none pushes nothing). ``refuses(peer)``: whether that peer is one never to push to."""

    def __init__(
        self,
        counters: ServerCounters,
        node: BaseNode | None,
        refuses: Callable[[PeerId], bool] = lambda peer: False,
    ):
        self.counters = counters
        self.node = node
        self.refuses = refuses
        self._streams: dict[str, MessageStream] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tickets: dict[str, Ticket] = {}

    async def push(self, reply: Message, message: Message, route: tuple[PushHop, ...]) -> bool:
        """Hand ``reply``'s output (to step ``message``) to the next server of ``route``; False if
        it could not be sent (the client then drives that hop itself)."""
        if self.node is None:
            return False
        ticket_text = route[0].ticket
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
            ticket = self._ticket(ticket_text)
            if self.refuses(ticket.peer_id):
                raise ShoalError(f"server {ticket.peer_id[:10]} was convicted of lying here: no pushes to it")
            # keyed by the whole ticket: a peer restarted at new addresses gets a new stream
            if len(self._streams) > MAX_PUSH_TARGETS:  # bounded: targets come from clients
                await self.close()
            lock = self._locks.setdefault(ticket_text, asyncio.Lock())
            async with lock:
                stream = self._streams.get(ticket_text)
                if stream is None or stream.broken:
                    stream = await self.node.open_stream(ticket, BLOCKS, timeout=2.0)
                    self._streams[ticket_text] = stream
                try:
                    # in the codec of the client's reply: the next server decodes what the client does
                    await stream.send(Message("push", stream.next_id(), meta, tensors, reply.codecs))
                except ShoalError:
                    self._streams.pop(ticket_text, None)
                    raise
        except (ShoalError, ValueError) as exc:
            self.counters.pushes_failed += 1
            log.info("push to the next server failed: %s", exc)
            return False
        self.counters.pushes_sent += 1
        return True

    async def close(self) -> None:
        """Finish every push stream (a drain, or too many targets)."""
        streams, self._streams, self._locks = self._streams, {}, {}
        for stream in streams.values():
            await stream.finish()

    def _ticket(self, text: str) -> Ticket:
        ticket = self._tickets.get(text)
        if ticket is None:
            if len(self._tickets) > 1024:
                self._tickets.clear()
            ticket = self._tickets[text] = Ticket.parse(text)
        return ticket


__all__ = ["MAX_PUSH_TARGETS", "Pusher"]
