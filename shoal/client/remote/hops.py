"""One server's part of a remote session: its stream, the session it opened, and its replies."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from torch import Tensor

from shoal.errors import ShoalError
from shoal.ids import PeerId
from shoal.protocols import BLOCKS
from shoal.routing import ServerSpan
from shoal.transport import BaseNode, MessageStream
from shoal.verify.tokens import migrate_token, push_token
from shoal.wire import Message
from shoal.wire.schema import OpenReply, OpenRequest, PushHop

CLOSE_TIMEOUT = 5.0


class Hop:
    """The session on one server of the chain (compared by identity: two hops are never equal).

    ``draining``: the server's last step reply said it is leaving; only the step driver, which
    reads those replies, sets it. ``replace_after``: while nobody could take over from it, the
    monotonic time before which its replacement is not looked for again."""

    __slots__ = ("__weakref__", "_pending", "_secret", "_ticket", "draining", "replace_after", "session", "span",
                 "stream")  # fmt: skip

    def __init__(self, span: ServerSpan, stream: MessageStream, reply: OpenReply):
        self.span = span
        self.stream = stream
        self.session = reply.session
        self._secret = reply.token  # the session's push secret: never sent on (see push_hop)
        self._ticket = str(span.ticket)
        self.draining = False
        self.replace_after = 0.0
        self._pending: asyncio.Task[Message] | None = None  # a recv still waiting (a late reply given more time)

    @classmethod
    async def open(
        cls,
        node: BaseNode,
        span: ServerSpan,
        request: OpenRequest,
        timeout: float | None = None,
        tensors: Sequence[Tensor] = (),
    ) -> Hop:
        """Open a session on ``span``'s server; ``timeout`` bounds the dial and the reply each
        (recovery must not wait a whole request deadline on a dead replacement). ``tensors``: the
        open's (the span's deep prompts, when ``request.prompts``)."""
        stream = await node.open_stream(span.ticket, BLOCKS, timeout)
        try:
            reply = (await stream.request(Message("open", 1, request, list(tensors)), timeout)).reply(OpenReply)
        except BaseException:
            await stream.abort()
            raise
        return cls(span, stream, reply)

    def push_hop(self, previous: PeerId, *, step: int, position: int, n: int, receipt: bool) -> PushHop:
        """Where the server ``previous`` (a peer id: the hop before this one) pushes step ``step`` of
        this session (``n`` positions at ``position``, ``receipt`` asked or not), with a token that
        lets only that peer push only that step (:mod:`shoal.verify.tokens`)."""
        token = push_token(self._secret, previous, step=step, position=position, n=n, receipt=receipt)
        return PushHop(ticket=self._ticket, session=self.session, token=token)

    def migrate_hop(self, source: PeerId, *, step: int, position: int) -> PushHop:
        """Where the server ``source`` (a draining hop's) sends its pages of ``[0, position)`` in
        migration ``step``, with a token that lets only that peer do so (:mod:`shoal.server.migrate`)."""
        token = migrate_token(self._secret, source, step=step, position=position)
        return PushHop(ticket=self._ticket, session=self.session, token=token)

    @property
    def key(self) -> tuple[str, int, int]:
        """``(peer, start, end)``: what routing calls a span that holds this session."""
        span = self.span
        return (span.peer_id, span.start, span.end)

    async def receive(self, timeout: float) -> Message | None:
        """The next message on the stream, or None if none came within ``timeout``: the read stays
        pending, so a later call still gets a reply that was only late."""
        pending = self._pending
        if pending is None:
            pending = self._pending = asyncio.get_running_loop().create_task(self.stream.recv())
        done, _ = await asyncio.wait((pending,), timeout=timeout)
        if not done:
            return None
        self._pending = None
        return pending.result()  # raises ClosedError, WireError ...

    def _cancel_pending(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    async def abort(self) -> None:
        """Give up on this server: the stream is reset (the server frees the session)."""
        self._cancel_pending()
        await self.stream.abort()

    async def close(self) -> None:
        """Close the session politely (best effort), then the stream."""
        self._cancel_pending()
        try:
            if not self.stream.broken:
                with contextlib.suppress(ShoalError):
                    await self.stream.request(Message("close", self.stream.next_id()), timeout=CLOSE_TIMEOUT)
        finally:
            await self.stream.finish()

    def __repr__(self) -> str:
        return f"Hop({self.span.peer_id[:10]} [{self.span.start}:{self.span.end}) session {self.session})"


async def close_all(hops: list[Hop]) -> None:
    await asyncio.gather(*(hop.close() for hop in hops))


__all__ = ["Hop", "close_all"]
