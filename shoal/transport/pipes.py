"""In-process byte streams between two nodes of this process: what :class:`~shoal.transport.MemoryNode`
connections are made of, and what a node uses to reach a peer hosted in its own process
(:meth:`~shoal.transport.BaseNode.add_local_peer`: a gateway and the span it serves). A stream over
them carries the very frames iroh would (the same encoding, limits, validation and handler boundary);
only the bytes never leave the process.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import TYPE_CHECKING

from shoal.errors import ClosedError, ShoalError
from shoal.wire import MAX_FRAME_PAYLOAD

if TYPE_CHECKING:
    from shoal.transport.base import BaseNode

__all__ = ["STREAM_WINDOW", "Link", "Pipe", "PipeChannel"]

STREAM_WINDOW = 2 * MAX_FRAME_PAYLOAD  # bytes a stream direction buffers before its writer waits


def wake(waiters: list[asyncio.Future]) -> None:
    for future in waiters:
        if not future.done():
            try:
                future.set_result(None)
            except RuntimeError:  # its loop closed (a stream dropped at shutdown): nobody waits any more
                pass
    waiters.clear()


async def wait_for_wake(waiters: list[asyncio.Future]) -> None:
    """Until the next :func:`_wake` of ``waiters``; each waiter has its own future, so cancelling
    one (a recv deadline) leaves the others waiting."""
    future = asyncio.get_running_loop().create_future()
    waiters.append(future)
    try:
        await future
    except asyncio.CancelledError:
        if future in waiters:
            waiters.remove(future)
        raise


class Pipe:
    """One direction of a stream: ordered chunks, bounded by ``window``. The writer finishes it
    (the reader drains it, then sees the end); a reset, a stop or a closed connection fails it
    (both sides raise at once, buffered bytes are dropped)."""

    __slots__ = ("__weakref__", "_chunks", "_error", "_finished", "_readers", "_size", "_writers", "window")

    def __init__(self, window: int):
        self.window = window
        self._chunks: deque[bytes | memoryview] = deque()
        self._size = 0
        self._finished = False
        self._error: str | None = None  # why it failed: every later call raises ClosedError(this)
        self._readers: list[asyncio.Future] = []  # waiting for bytes
        self._writers: list[asyncio.Future] = []  # waiting for room

    async def write(self, data: bytes | memoryview) -> None:
        """Append all of ``data`` (a copy if it is a view: the sender may reuse its buffer), then
        wait while more than ``window`` bytes are unread. Writes never reorder."""
        if self._error is not None:
            raise ClosedError(self._error)
        if self._finished:
            raise ClosedError("write on a finished stream")
        if not isinstance(data, bytes):
            data = bytes(data)
        if data:
            self._chunks.append(data)
            self._size += len(data)
            wake(self._readers)
        while self._size > self.window and self._error is None:
            await wait_for_wake(self._writers)
        if self._error is not None:
            raise ClosedError(self._error)

    async def read(self, n: int) -> bytes:
        """What is buffered, up to ``n`` bytes, b"" once the writer finished and all was read. Whole
        writes where they fit: a large one behind is left for ``read_exact`` to take without a copy."""
        while not self._chunks:
            if self._error is not None:
                raise ClosedError(self._error)
            if self._finished:
                return b""
            await wait_for_wake(self._readers)
        if self._error is not None:
            raise ClosedError(self._error)
        size = 0
        for chunk in self._chunks:
            if size + len(chunk) > n:
                break
            size += len(chunk)
        return self._take(size or n)

    async def read_exact(self, n: int) -> bytes:
        while self._size < n:
            if self._error is not None:
                raise ClosedError(self._error)
            if self._finished:
                raise ClosedError(f"stream finished {n - self._size} bytes short of a read")
            await wait_for_wake(self._readers)
        if self._error is not None:
            raise ClosedError(self._error)
        return self._take(n)

    def _take(self, n: int) -> bytes:
        """The next ``n`` buffered bytes (a whole chunk as it is, without a copy, where it fits)."""
        chunks, parts, got = self._chunks, [], 0
        while got < n:
            chunk = chunks.popleft()
            if got + len(chunk) > n:
                cut = n - got
                chunks.appendleft(memoryview(chunk)[cut:])
                chunk = memoryview(chunk)[:cut]
            parts.append(chunk)
            got += len(chunk)
        self._size -= n
        if self._size <= self.window:
            wake(self._writers)
        if len(parts) == 1 and isinstance(parts[0], bytes):
            return parts[0]
        return b"".join(parts)

    def finish(self) -> None:
        self._finished = True
        wake(self._readers)

    def fail(self, reason: str) -> None:
        if self._error is not None:
            return
        self._error = reason
        self._chunks.clear()
        self._size = 0
        wake(self._readers)
        wake(self._writers)


class PipeChannel:
    """One end of an in-memory stream, as a :class:`~shoal.transport.stream.ByteChannel`."""

    errors = (ClosedError,)

    def __init__(self, outgoing: Pipe, incoming: Pipe):
        self._outgoing, self._incoming = outgoing, incoming
        self.write_all = outgoing.write
        self.read = incoming.read
        self.read_exact = incoming.read_exact

    @staticmethod
    def translate(exc: BaseException, what: str) -> ShoalError:
        return exc if isinstance(exc, ShoalError) else ClosedError(f"{what}: {exc}")

    async def finish(self) -> None:
        self._outgoing.finish()

    async def reset(self, code: int) -> None:
        self._outgoing.fail(f"stream reset by peer (code {code})")

    async def stop(self, code: int) -> None:
        self._incoming.fail(f"stream stopped by peer (code {code})")

    def __del__(self) -> None:
        """A dropped end behaves as a dropped QUIC stream: what was sent is finished, and the peer's
        further writes fail (so a peer writing to a stream nobody reads does not wait forever)."""
        try:
            self._outgoing.finish()
            self._incoming.fail("stream stopped by peer")
        except Exception:  # interpreter shutdown: the module may be half torn down
            pass


class Link:
    """A connection between two memory nodes for one protocol. Closing it (from either side, or
    either node closing) fails every stream on it, as closing a QUIC connection does."""

    __slots__ = ("_acceptor", "_alpn", "_dialler", "_pipes", "_reason", "_window")

    def __init__(self, dialler: BaseNode, acceptor: BaseNode, alpn: bytes, window: int = STREAM_WINDOW):
        self._dialler, self._acceptor, self._alpn = dialler, acceptor, alpn
        self._reason: str | None = None
        self._pipes: weakref.WeakSet[Pipe] = weakref.WeakSet()
        self._window = window
        dialler.links.add(self)
        acceptor.links.add(self)

    def is_closed(self) -> bool:
        return self._reason is not None

    def close(self, reason: str) -> None:
        if self._reason is not None:
            return
        self._reason = reason
        for pipe in list(self._pipes):
            pipe.fail(f"connection closed: {reason}")
        self._dialler.links.discard(self)
        self._acceptor.links.discard(self)

    def rtt_ms(self) -> float | None:
        return None if self._reason is not None else 0.0

    async def open_channel(self) -> PipeChannel:
        if self._reason is not None:
            raise ClosedError(f"open stream: connection closed: {self._reason}")
        up, down = Pipe(self._window), Pipe(self._window)  # dialler -> acceptor, acceptor -> dialler
        self._pipes.add(up)
        self._pipes.add(down)
        acceptor = self._acceptor
        stream = acceptor._stream(PipeChannel(down, up), self._dialler.id)
        acceptor._serve_stream(acceptor._handlers[self._alpn], stream)
        return PipeChannel(up, down)
