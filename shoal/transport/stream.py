"""Message streams over any ordered byte channel: framing, deadlines, request/reply, finish/abort.

One implementation for every transport: an iroh QUIC stream (:mod:`shoal.transport.node`) and an
in-memory pipe (:mod:`shoal.transport.memory`) both hand :class:`MessageStream` a
:class:`ByteChannel`, so limits, malformed frames, truncation and timeouts behave the same on both.
A channel's I/O calls are plain attributes (no method of ours in between) so the iroh path calls its
lean :mod:`~shoal.transport.fastcall` functions with no extra Python frame per message.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Protocol

from shoal.errors import ClosedError, RequestTimeout, ShoalError, WireError, remote_error
from shoal.limits import MiB, flag_of
from shoal.transport.guard import PeerGuard
from shoal.wire import FRAME_DATA, FRAME_PREFIX, Assembler, Limits, Message, parse_prefix, writes

READ_CHUNK = 64 * 1024  # bytes asked per read; a frame's remainder at least this large is read exactly


class ByteChannel(Protocol):
    """One bidirectional, ordered byte stream. Its calls raise one of ``errors`` once the stream is
    gone (reset, stopped, connection closed); :meth:`translate` turns such an error into shoal's."""

    errors: tuple[type[BaseException], ...]
    write_all: Callable[[bytes | memoryview], Awaitable[None]]  # all of it, in order
    read: Callable[[int], Awaitable[bytes]]  # what has arrived, 1..n bytes; b"" at the end
    read_exact: Callable[[int], Awaitable[bytes]]  # n bytes, or one of ``errors``

    async def finish(self) -> None:
        """End our sending side (the peer reads to the end, then sees it close). Never raises."""

    async def reset(self, code: int) -> None:
        """Abandon our sending side now (unsent bytes are dropped, the peer's reads fail). Never raises."""

    async def stop(self, code: int) -> None:
        """Stop reading (unread bytes are dropped, the peer's further writes fail). Never raises."""

    def translate(self, exc: BaseException, what: str) -> ShoalError: ...


class ReceivedBytes:
    """Bytes of the frames streams received: ``total`` (prefixes and headers included) and
    ``data`` (tensor bytes: DATA frames' payloads, as the codecs encoded them). A node's streams
    share one (:attr:`shoal.transport.BaseNode.received`)."""

    __slots__ = ("data", "total")

    def __init__(self) -> None:
        self.total = 0
        self.data = 0


class MessageStream:
    """Shoal messages over one byte channel. Sends are serialised by a lock. ``received`` counts
    the bytes of every frame read (a node passes its own, shared by its streams); ``guard`` (the
    node's) counts the bytes of the peer's unfinished message against its limits.

    Once a frame or message has begun, the peer must keep sending: each read inside it waits at
    most ``limits.data_timeout`` seconds (and a large frame's remainder at least 1 MiB per
    ``data_timeout``), else :class:`WireError` ``data_timeout``. A peer that sends a header and
    stalls holds the stream no longer than that, not until the idle deadline."""

    def __init__(
        self,
        channel: ByteChannel,
        peer_id: str,
        limits: Limits,
        request_timeout: float,
        received: ReceivedBytes | None = None,
        guard: PeerGuard | None = None,
    ):
        self._channel = channel
        self._errors = channel.errors
        self._write_all, self._read, self._read_exactly = channel.write_all, channel.read, channel.read_exact
        self.peer_id = peer_id
        self.limits = limits
        self.request_timeout = request_timeout
        self.received = received if received is not None else ReceivedBytes()
        self._assembler = Assembler(limits)
        self._guard = guard
        self._held = 0  # bytes of the unfinished message counted in the guard
        self._buffer = b""  # bytes read from the stream but not consumed yet
        self._send_lock = asyncio.Lock()
        self._next_id = 1
        self.broken = False
        # recv's deadline: one lazily re-armed timer per stream instead of a timeout context per
        # message (see recv)
        self._deadline = 0.0
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._receiver: asyncio.Task | None = None
        self._timed_out = False

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def send(self, message: Message) -> None:
        buffers = writes(message, self.limits, READ_CHUNK)  # encoded before the lock: no I/O
        async with self._send_lock:
            try:
                for buffer in buffers:
                    await self._write_all(buffer)
            except (*self._errors, asyncio.CancelledError) as exc:
                self.broken = True
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise self._channel.translate(exc, "send") from None

    async def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (fuzz tests and diagnostics only)."""
        async with self._send_lock:
            try:
                await self._write_all(data)
            except self._errors as exc:
                raise self._channel.translate(exc, "send") from None

    async def _in_time(self, read: Awaitable[bytes], seconds: float) -> bytes:
        try:
            async with asyncio.timeout(seconds):
                return await read
        except TimeoutError:
            self.broken = True
            self._release_held()
            raise WireError(
                "data_timeout",
                f"a message began and its next bytes did not come within {seconds:.3g} s ({flag_of('data_timeout')})",
            ) from None

    def _hold(self, size: int) -> None:
        """Count a DATA frame of ``size`` bytes that leaves the message unfinished (the frame that
        finishes it is handed on at once, so it is never counted)."""
        if self._guard is not None and size < self._assembler.missing:
            self._guard.take_bytes(self.peer_id, size)
            self._held += size

    def _release_held(self) -> None:
        if self._held:
            self._guard.give_bytes(self.peer_id, self._held)
            self._held = 0

    def _ended(self) -> ShoalError:
        """What a read that found the stream closed raises: mid-message, a truncated message."""
        self.broken = True
        self._release_held()
        if self._assembler.mid_message or self._buffer:
            return WireError("truncated", "stream ended inside a message")
        return ClosedError(f"stream closed by peer {self.peer_id[:10]}")

    async def _read_more(self) -> None:
        """Append whatever has arrived (at least one byte; one read often covers several frames)
        to the buffer."""
        try:
            if self._buffer or self._assembler.mid_message:  # inside a frame or message: the peer must go on
                chunk = await self._in_time(self._read(READ_CHUNK), self.limits.data_timeout)
            else:
                chunk = await self._read(READ_CHUNK)
        except self._errors:
            raise self._ended() from None
        if not chunk:
            raise self._ended()
        self._buffer += chunk

    async def _read_exact(self, n: int) -> bytes:
        """``n`` bytes from the stream; the large remainder of a frame is asked of the channel exactly."""
        try:
            while len(self._buffer) < n:
                missing = n - len(self._buffer)
                if missing >= READ_CHUNK:
                    allowed = self.limits.data_timeout * max(1.0, missing / MiB)
                    data = self._buffer + await self._in_time(self._read_exactly(missing), allowed)
                    self._buffer = b""
                    return data
                await self._read_more()
        except self._errors:
            raise self._ended() from None
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    async def _recv_message(self) -> Message:
        prefix = FRAME_PREFIX.size
        while True:
            if len(self._buffer) < prefix:
                await self._read_more()
                continue
            frame_type, size = parse_prefix(self._buffer[:prefix], self.limits)
            end = prefix + size
            if len(self._buffer) >= end:  # a whole frame is already read: no await (the common path)
                payload, self._buffer = self._buffer[prefix:end], self._buffer[end:]
                self.received.total += end
                if frame_type == FRAME_DATA:
                    self.received.data += size
                    self._hold(size)
                message = self._assembler.feed(frame_type, payload)
            elif frame_type == FRAME_DATA and size >= READ_CHUNK:  # large: the rest read exactly
                self._buffer = self._buffer[prefix:]
                self.received.total += end
                self.received.data += size
                self._hold(size)
                message = await self._recv_large_data(size)
            else:
                await self._read_more()
                continue
            if message is not None:
                self._release_held()
                return message

    async def _recv_large_data(self, size: int) -> Message | None:
        """A large DATA frame goes to the assembler in two pieces (what is buffered, then the
        rest read exactly) instead of being joined first: one copy of 4 MiB less."""
        head, self._buffer = self._buffer[:size], self._buffer[size:]
        message = self._assembler.feed(FRAME_DATA, head) if head else None
        if size > len(head):
            message = self._assembler.feed(FRAME_DATA, await self._read_exact(size - len(head)))
        return message

    async def recv(self, timeout: float | None = None) -> Message:
        """Next message. Raises :class:`RequestTimeout` (the stream is then unusable),
        :class:`ClosedError` at end of stream, :class:`WireError` on a malformed frame (the stream
        is then unusable too), :class:`shoal.wire.InvalidMessage` for a well-framed message whose
        metadata does not validate (the stream stays usable: answer that request and go on).

        Every message of a stream goes through here, so the deadline costs a clock read, not a
        timer per call: one timer per stream fires at the earliest deadline it was armed for and,
        if a later recv moved the deadline on, re-arms itself for that one."""
        task = None
        if timeout is not None:
            loop = asyncio.get_running_loop()
            self._deadline = deadline = loop.time() + timeout
            timer = self._deadline_timer
            if timer is None or timer.when() > deadline:
                if timer is not None:
                    timer.cancel()
                self._deadline_timer = loop.call_at(deadline, _check_deadline, weakref.ref(self))
            self._receiver = task = asyncio.current_task()
        try:
            return await self._recv_message()
        except asyncio.CancelledError:
            if task is not None and self._timed_out:
                self._timed_out = False
                if task.uncancel() == 0:  # our cancel alone: a timeout, not the caller's cancellation
                    self.broken = True
                    raise RequestTimeout(f"no message from {self.peer_id[:10]} within {timeout:.3g} s") from None
            raise
        except WireError:
            self.broken = True
            self._release_held()
            raise
        finally:
            self._receiver = None

    def _cancel_deadline(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None

    async def request(self, message: Message, timeout: float | None = None) -> Message:
        """Send ``message`` and wait for its reply; an ``error`` reply is raised as RemoteError."""
        await self.send(message)
        reply = await self.recv(self.request_timeout if timeout is None else timeout)
        if reply.kind == "error":
            raise remote_error(*reply.error_info())
        return reply

    async def finish(self) -> None:
        """No more messages from us; the peer's messages can still be read."""
        self._cancel_deadline()
        self._release_held()
        await self._channel.finish()

    async def stop(self, code: int = 0) -> None:
        """Read no more: the peer's further sends fail instead of waiting for a reader that is gone."""
        self._cancel_deadline()
        self._release_held()
        await self._channel.stop(code)

    async def abort(self, code: int = 1) -> None:
        """Abandon the stream both ways now."""
        self._cancel_deadline()
        self._release_held()
        self.broken = True
        await self._channel.reset(code)
        await self._channel.stop(code)


def _check_deadline(ref: weakref.ref[MessageStream]) -> None:
    """A stream's deadline timer fired (a weak reference: a pending timer must not keep a finished
    stream, and with it its channel, alive)."""
    stream = ref()
    if stream is None:
        return
    stream._deadline_timer = None
    task = stream._receiver
    if task is None:
        return  # no recv waiting; the next one arms the timer again
    loop = task.get_loop()
    if loop.time() < stream._deadline:
        stream._deadline_timer = loop.call_at(stream._deadline, _check_deadline, ref)
        return
    stream._timed_out = True
    task.cancel()
