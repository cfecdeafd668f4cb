"""A shoal peer on iroh: endpoint lifecycle, pooled connections, message streams.

This module, :mod:`shoal.transport.sendfix` and :mod:`shoal.transport.fastcall` (the lean calls
every message goes through) are the only importers of ``iroh``; every
``IrohError`` is translated into :mod:`shoal.errors` here (:func:`_translate`).

Protocols are versioned ALPNs ``shoal/<name>/<version>``. Every node also speaks ``shoal/meta/1``,
which answers ``hello`` with the list of protocols the node serves, so a refused dial can say what
each side speaks. QUIC binds a connection to one ALPN, so the pool keeps one connection per
(peer, protocol), shared by all concurrent streams of that protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import iroh
from iroh import iroh_ffi

from shoal.errors import (
    ClosedError,
    ConnectTimeout,
    ProtocolMismatch,
    RefusedError,
    RequestTimeout,
    ShoalError,
    TicketError,
    TransportError,
    WireError,
    remote_error,
)
from shoal.heap import freeze_startup_heap
from shoal.transport import fastcall, sendfix
from shoal.transport.config import NetworkProfile, TransportConfig
from shoal.transport.identity import generate_key
from shoal.transport.ticket import Ticket
from shoal.wire import FRAME_DATA, FRAME_PREFIX, Assembler, Limits, Message, error_message, parse_prefix, writes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Protocol:
    name: str
    version: int

    @property
    def alpn(self) -> bytes:
        return f"shoal/{self.name}/{self.version}".encode()

    def __str__(self) -> str:
        return self.alpn.decode()


META = Protocol("meta", 1)
Handler = Callable[["MessageStream", str], Awaitable[None]]

_READ_CHUNK = 64 * 1024
_NO_ALPN_MARKERS = ("no application protocol", "doesn't support any known protocol", "noapplicationprotocol")


def _translate(exc: BaseException, what: str) -> ShoalError:
    """The one place where iroh's errors become shoal's."""
    if isinstance(exc, ShoalError):
        return exc
    if isinstance(exc, iroh.IrohError):
        kind, message = exc.kind(), exc.message()
        text = f"{what}: {kind.name.lower()}: {message.splitlines()[-1].strip() if message else ''}"
        if kind is iroh.IrohErrorKind.KEY_PARSING:
            return TicketError(f"{what}: not a valid peer id")
        if any(m in message.lower() for m in _NO_ALPN_MARKERS):
            return RefusedError(text)
        if kind in (iroh.IrohErrorKind.CONNECT,):
            return RefusedError(text)
        return ClosedError(text)
    return TransportError(f"{what}: {type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class EndpointPlan:
    """What a network profile asks of iroh, as plain values (testable without binding)."""

    preset: str  # "minimal": offline, no address lookup; "n0": n0's relays + DNS/pkarr lookup
    relays: str  # "disabled" or "default"
    bind_addr: str | None
    alpns: tuple[bytes, ...]


def endpoint_plan(config: TransportConfig, alpns: list[bytes]) -> EndpointPlan:
    if config.profile is NetworkProfile.LOCAL:
        return EndpointPlan("minimal", "disabled", config.bind_addr, tuple(alpns))
    return EndpointPlan("n0", "default", config.bind_addr, tuple(alpns))


def endpoint_options(plan: EndpointPlan, secret_key: bytes) -> iroh.EndpointOptions:
    kwargs: dict[str, Any] = {"secret_key": secret_key, "alpns": list(plan.alpns)}
    kwargs["preset"] = iroh.preset_minimal() if plan.preset == "minimal" else iroh.preset_n0()
    if plan.relays == "disabled":
        kwargs["relay_mode"] = iroh.RelayMode.disabled()
    if plan.bind_addr:
        kwargs["bind_addr"] = plan.bind_addr
    return iroh.EndpointOptions(**kwargs)


class MessageStream:
    """One bidirectional QUIC stream carrying shoal messages. Sends are serialised by a lock."""

    def __init__(self, bi: Any, peer_id: str, limits: Limits, request_timeout: float):
        self._send, self._recv = bi.send(), bi.recv()
        self.peer_id = peer_id
        self.limits = limits
        self.request_timeout = request_timeout
        self._assembler = Assembler(limits)
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
        buffers = writes(message, self.limits, _READ_CHUNK)  # encoded before the lock: no I/O
        async with self._send_lock:
            try:
                for buffer in buffers:
                    await fastcall.write_all(self._send, buffer)
            except (iroh.IrohError, asyncio.CancelledError) as exc:
                self.broken = True
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise _translate(exc, "send") from None

    async def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (fuzz tests and diagnostics only)."""
        async with self._send_lock:
            try:
                await fastcall.write_all(self._send, data)
            except iroh.IrohError as exc:
                raise _translate(exc, "send") from None

    def _ended(self) -> ShoalError:
        """What a read that found the stream closed raises: mid-message, a truncated message."""
        self.broken = True
        if self._assembler.mid_message or self._buffer:
            return WireError("truncated", "stream ended inside a message")
        return ClosedError(f"stream closed by peer {self.peer_id[:10]}")

    async def _read_more(self) -> None:
        """Append whatever has arrived (at least one byte; one FFI call often covers several
        frames) to the buffer."""
        try:
            chunk = await fastcall.read(self._recv, _READ_CHUNK)
        except iroh.IrohError:
            raise self._ended() from None
        if not chunk:
            raise self._ended()
        self._buffer += chunk

    async def _read_exact(self, n: int) -> bytes:
        """``n`` bytes from the stream; the large remainder of a frame is asked of iroh exactly."""
        try:
            while len(self._buffer) < n:
                missing = n - len(self._buffer)
                if missing >= _READ_CHUNK:
                    data, self._buffer = self._buffer + await fastcall.read_exact(self._recv, missing), b""
                    return data
                await self._read_more()
        except iroh.IrohError:
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
                message = self._assembler.feed(frame_type, payload)
            elif frame_type == FRAME_DATA and size >= _READ_CHUNK:  # large: the rest straight from iroh
                self._buffer = self._buffer[prefix:]
                message = await self._recv_large_data(size)
            else:
                await self._read_more()
                continue
            if message is not None:
                return message

    async def _recv_large_data(self, size: int) -> Message | None:
        """A large DATA frame goes to the assembler in two pieces (what is buffered, then the
        rest straight from iroh) instead of being joined first: one copy of 4 MiB less."""
        head, self._buffer = self._buffer[:size], self._buffer[size:]
        message = self._assembler.feed(FRAME_DATA, head) if head else None
        if size > len(head):
            message = self._assembler.feed(FRAME_DATA, await self._read_exact(size - len(head)))
        return message

    async def recv(self, timeout: float | None = None) -> Message:
        """Next message. Raises :class:`RequestTimeout` (the stream is then unusable),
        :class:`ClosedError` at end of stream, :class:`WireError` on a malformed frame.

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
        self._cancel_deadline()
        with contextlib.suppress(iroh.IrohError):
            await self._send.finish()

    async def abort(self, code: int = 1) -> None:
        self._cancel_deadline()
        self.broken = True
        with contextlib.suppress(iroh.IrohError):
            await self._send.reset(code)
        with contextlib.suppress(iroh.IrohError):
            await self._recv.stop(code)


def _check_deadline(ref: weakref.ref[MessageStream]) -> None:
    """A stream's deadline timer fired (a weak reference: a pending timer must not keep a finished
    stream, and with it its QUIC stream, alive)."""
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


class Node:
    """A bound iroh endpoint serving some protocols and dialling others."""

    def __init__(self, endpoint: Any, config: TransportConfig, handlers: dict[Protocol, Handler]):
        self._ep = endpoint
        self.config = config
        self._handlers = {p.alpn: h for p, h in handlers.items()}
        self._handlers[META.alpn] = self._serve_meta
        self._conns: dict[tuple[str, bytes], Any] = {}
        self._conn_addrs: dict[tuple[str, bytes], tuple[str, ...]] = {}  # what each was dialled at
        self._dial_locks: dict[tuple[str, bytes], asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self._accept_task: asyncio.Task | None = None
        self.id: str = str(endpoint.id())
        self.closed = False
        self.rejected_frames: Counter[str] = Counter()  # malformed frames answered with a wire error, by reason

    @classmethod
    async def start(
        cls,
        config: TransportConfig = TransportConfig(),
        handlers: dict[Protocol, Handler] | None = None,
        secret_key: bytes | None = None,
    ) -> Node:
        sendfix.apply()
        freeze_startup_heap()  # the first node of a process starts after its heavy imports
        iroh_ffi.uniffi_set_event_loop(asyncio.get_running_loop())
        handlers = dict(handlers or {})
        alpns = [p.alpn for p in handlers] + [META.alpn]
        options = endpoint_options(endpoint_plan(config, alpns), secret_key or generate_key())
        try:
            endpoint = await iroh.Endpoint.bind(options)
        except iroh.IrohError as exc:
            raise _translate(exc, "bind") from None
        node = cls(endpoint, config, handlers)
        node._accept_task = asyncio.create_task(node._accept_loop())
        return node

    @property
    def protocols(self) -> list[str]:
        return sorted(alpn.decode() for alpn in self._handlers)

    def ticket(self, swarm_id: str | None = None) -> Ticket:
        addr = self._ep.addr()
        return Ticket(self.id, tuple(addr.direct_addresses()), addr.relay_url(), swarm_id)

    # ---- serving ---------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept_loop(self) -> None:
        while True:
            try:
                incoming = await self._ep.accept_next()
            except iroh.IrohError as exc:
                log.debug("accept_next failed: %s", _translate(exc, "accept"))
                continue
            if incoming is None:
                return
            self._spawn(self._serve_connection(incoming))

    async def _serve_connection(self, incoming: Any) -> None:
        try:
            accepting = await incoming.accept()
            conn = await asyncio.wait_for(accepting.connect(), self.config.deadlines.connect)
        except (iroh.IrohError, TimeoutError) as exc:
            log.debug("incoming handshake failed: %s", exc)  # e.g. an unknown ALPN
            return
        handler = self._handlers.get(conn.alpn())
        peer_id = str(conn.remote_id())
        if handler is None:  # cannot happen: iroh only accepts our registered ALPNs
            conn.close(1, b"unknown protocol")
            return
        while True:
            try:
                bi = await conn.accept_bi()
            except iroh.IrohError:
                return  # the connection closed
            stream = MessageStream(bi, peer_id, self.config.limits, self.config.deadlines.request)
            self._spawn(self._run_handler(handler, stream))

    async def _run_handler(self, handler: Handler, stream: MessageStream) -> None:
        try:
            await handler(stream, stream.peer_id)
        except (ClosedError, RequestTimeout):
            pass
        except WireError as exc:  # framing is lost: answer once, then drop the stream
            self.rejected_frames[exc.reason] += 1
            with contextlib.suppress(ShoalError):
                await stream.send(error_message(0, "wire", str(exc), reason=exc.reason))
        except Exception:
            log.exception("handler failed for peer %s", stream.peer_id[:10])
        finally:
            await stream.finish()

    async def _serve_meta(self, stream: MessageStream, peer_id: str) -> None:
        """``hello``: the protocols we speak. ``ping``: echo (tensors too unless meta echo=False),
        for liveness, round-trip and throughput measurement. Serves until the stream ends."""
        while True:
            request = await stream.recv(self.config.deadlines.idle)
            if request.kind == "hello":
                reply = Message("result", request.id, {"protocols": self.protocols})
            elif request.kind == "ping":
                echoed = request.tensors if request.meta.get("echo", True) else []
                reply = Message("result", request.id, {}, echoed)
            else:
                reply = error_message(request.id, "bad_request", f"meta protocol does not serve {request.kind!r}")
            await stream.send(reply)

    # ---- dialling --------------------------------------------------------------------------
    async def connect(self, ticket: Ticket, protocol: Protocol, timeout: float | None = None) -> Any:
        """A pooled connection to ``ticket``'s peer for ``protocol`` (dialled if needed)."""
        key = (ticket.peer_id, protocol.alpn)
        conn = self._usable(key, ticket)
        if conn is not None:
            return conn
        async with self._dial_locks.setdefault(key, asyncio.Lock()):
            conn = self._usable(key, ticket)
            if conn is not None:
                return conn
            conn = await self._dial(ticket, protocol, timeout)
            self._conns[key] = conn
            self._conn_addrs[key] = tuple(ticket.addrs)
            return conn

    def _usable(self, key: tuple[str, bytes], ticket: Ticket) -> Any:
        """The pooled connection, unless it closed or the ticket shares no address with the one it
        was dialled at (the peer restarted elsewhere with the same identity: the old connection
        may not know yet that it is dead)."""
        conn = self._conns.get(key)
        if conn is None or conn.close_reason() is not None:
            return None
        if ticket.addrs and not set(ticket.addrs) & set(self._conn_addrs.get(key, ticket.addrs)):
            return None  # dial anew; streams still open on the old connection keep it until they end
        return conn

    async def _dial(self, ticket: Ticket, protocol: Protocol, timeout: float | None) -> Any:
        if self.closed:
            raise ClosedError("node is closed")
        timeout = self.config.deadlines.connect if timeout is None else timeout
        try:
            addr = iroh.EndpointAddr(iroh.EndpointId.from_string(ticket.peer_id), ticket.relay_url, list(ticket.addrs))
            return await asyncio.wait_for(self._ep.connect(addr, protocol.alpn), timeout)
        except TimeoutError:
            raise ConnectTimeout(f"peer {ticket.peer_id[:10]} did not answer within {timeout:.3g} s") from None
        except iroh.IrohError as exc:
            error = _translate(exc, f"connect to {ticket.peer_id[:10]} ({protocol})")
            if protocol != META and any(m in exc.message().lower() for m in _NO_ALPN_MARKERS):
                raise ProtocolMismatch(str(protocol), await self._remote_protocols(ticket, timeout)) from None
            raise error from None

    async def _remote_protocols(self, ticket: Ticket, timeout: float) -> list[str] | None:
        try:
            reply = await self.request(ticket, META, Message("hello", 1), timeout=timeout)
            return [str(p) for p in reply.meta.get("protocols", [])]
        except ShoalError:
            return None

    async def open_stream(self, ticket: Ticket, protocol: Protocol, timeout: float | None = None) -> MessageStream:
        for attempt in range(2):  # a pooled connection may have died since last use: redial once
            conn = await self.connect(ticket, protocol, timeout)
            try:
                bi = await conn.open_bi()
            except iroh.IrohError as exc:
                self._conns.pop((ticket.peer_id, protocol.alpn), None)
                if attempt:
                    raise _translate(exc, "open stream") from None
                continue
            return MessageStream(bi, ticket.peer_id, self.config.limits, self.config.deadlines.request)
        raise AssertionError("unreachable")

    async def request(
        self, ticket: Ticket, protocol: Protocol, message: Message, timeout: float | None = None
    ) -> Message:
        """One request/response on a fresh stream of the pooled connection."""
        stream = await self.open_stream(ticket, protocol, timeout)
        try:
            return await stream.request(message, timeout)
        finally:
            await stream.finish()

    def rtt_ms(self, ticket: Ticket, protocol: Protocol) -> float | None:
        conn = self._conns.get((ticket.peer_id, protocol.alpn))
        rtt = conn.rtt() if conn is not None else None
        return None if rtt is None else rtt / 1000.0

    def drop_connection(self, peer_id: str) -> None:
        for key in [k for k in self._conns if k[0] == peer_id]:
            with contextlib.suppress(iroh.IrohError):
                self._conns.pop(key).close(0, b"dropped")

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in self._conns.values():
            with contextlib.suppress(iroh.IrohError):
                conn.close(0, b"bye")
        self._conns.clear()
        # close the endpoint first: it ends the pending accept_next; cancelling that call
        # instead leaves iroh's close waiting for it
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._ep.close(), 3.0)
        for task in list(self._tasks) + ([self._accept_task] if self._accept_task else []):
            task.cancel()

    async def __aenter__(self) -> Node:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
