"""A shoal peer on iroh: endpoint lifecycle, QUIC connections and streams as byte channels.

This module, :mod:`shoal.transport.binding` (workarounds for two defects of the binding) and
:mod:`shoal.transport.fastcall` (the lean calls every message goes through) are the only importers
of ``iroh``; every ``IrohError`` is translated into :mod:`shoal.errors` here (:func:`_translate`).
Framing, the pool, the handler error boundary and the meta protocol are shared with the in-process
transport (:mod:`shoal.transport.base`, :mod:`shoal.transport.stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any

import iroh
from iroh import iroh_ffi

from shoal.errors import (
    BindError,
    ClosedError,
    ConnectTimeout,
    ProtocolMismatch,
    RefusedError,
    ShoalError,
    TicketError,
    TransportError,
)
from shoal.transport import binding, fastcall
from shoal.transport.base import META, BaseNode, Handler, Protocol
from shoal.transport.config import NetworkProfile, TransportConfig
from shoal.transport.identity import generate_key
from shoal.transport.stream import MessageStream
from shoal.transport.ticket import Ticket

__all__ = ["META", "EndpointPlan", "Handler", "MessageStream", "Node", "Protocol", "endpoint_options", "endpoint_plan"]

log = logging.getLogger(__name__)

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


class _QuicChannel:
    """A QUIC bidirectional stream as a :class:`~shoal.transport.stream.ByteChannel`. Its I/O calls
    are the lean fastcall functions bound to the stream's halves: nothing of ours runs between
    :class:`MessageStream` and the FFI call."""

    errors = (iroh.IrohError,)
    translate = staticmethod(_translate)

    def __init__(self, bi: Any):
        binding.release_deferred()  # on the event loop: free what iroh's threads finalized
        self._send, self._recv = bi.send(), bi.recv()
        self.write_all = functools.partial(fastcall.write_all, self._send)
        self.read = functools.partial(fastcall.read, self._recv)
        self.read_exact = functools.partial(fastcall.read_exact, self._recv)

    async def finish(self) -> None:
        with contextlib.suppress(iroh.IrohError):
            await self._send.finish()

    async def reset(self, code: int) -> None:
        with contextlib.suppress(iroh.IrohError):
            await self._send.reset(code)

    async def stop(self, code: int) -> None:
        with contextlib.suppress(iroh.IrohError):
            await self._recv.stop(code)


class _QuicConnection:
    """A pooled iroh connection, as :class:`~shoal.transport.base.Connection`."""

    __slots__ = ("conn",)

    def __init__(self, conn: Any):
        self.conn = conn

    def is_closed(self) -> bool:
        return self.conn.close_reason() is not None

    def close(self, reason: str) -> None:
        with contextlib.suppress(iroh.IrohError):
            self.conn.close(0, reason.encode())

    def rtt_ms(self) -> float | None:
        rtt = self.conn.rtt()
        return None if rtt is None else float(rtt)  # iroh reports milliseconds

    async def open_channel(self) -> _QuicChannel:
        try:
            return _QuicChannel(await self.conn.open_bi())
        except iroh.IrohError as exc:
            raise _translate(exc, "open stream") from None


class Node(BaseNode):
    """A bound iroh endpoint serving some protocols and dialling others."""

    def __init__(self, endpoint: Any, config: TransportConfig, handlers: dict[Protocol, Handler]):
        super().__init__(config, handlers)
        self._ep = endpoint
        self._accept_task: asyncio.Task | None = None
        self.id: str = str(endpoint.id())

    @classmethod
    async def start(
        cls,
        config: TransportConfig = TransportConfig(),
        handlers: dict[Protocol, Handler] | None = None,
        secret_key: bytes | None = None,
    ) -> Node:
        binding.apply(asyncio.get_running_loop())
        iroh_ffi.uniffi_set_event_loop(asyncio.get_running_loop())
        handlers = dict(handlers or {})
        alpns = [p.alpn for p in handlers] + [META.alpn]
        options = endpoint_options(endpoint_plan(config, alpns), secret_key or generate_key())
        try:
            endpoint = await iroh.Endpoint.bind(options)
        except iroh.IrohError as exc:  # the UDP address is taken or not ours: say which one
            reason = (exc.message() or "").splitlines()[-1].strip().removeprefix("bind: ") or exc.kind().name
            raise BindError(config.bind_addr or "any address", f"UDP: {reason}") from None
        node = cls(endpoint, config, handlers)
        node._accept_task = asyncio.create_task(node._accept_loop())
        return node

    def ticket(self, swarm_id: str | None = None) -> Ticket:
        """How peers reach this node: its bound addresses, or those it was told to announce instead."""
        addr = self._ep.addr()
        addrs = self.config.announce_addrs or tuple(addr.direct_addresses())
        return Ticket(self.id, addrs, addr.relay_url(), swarm_id)

    # ---- serving ---------------------------------------------------------------------------
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
        if not self.guard.admit_connection(peer_id):
            limit = self.config.limits.max_connections_per_peer
            conn.close(2, f"over_limit: peer has {limit} connections open here (--max-connections-per-peer)".encode())
            return
        try:
            while True:
                try:
                    bi = await conn.accept_bi()
                except iroh.IrohError:
                    return  # the connection closed
                self._serve_stream(handler, self._stream(_QuicChannel(bi), peer_id))
        finally:
            self.guard.release_connection(peer_id)

    # ---- dialling --------------------------------------------------------------------------
    async def _dial(self, ticket: Ticket, protocol: Protocol, timeout: float | None) -> _QuicConnection:
        if self.closed:
            raise ClosedError("node is closed")
        timeout = self.config.deadlines.connect if timeout is None else timeout
        try:
            addr = iroh.EndpointAddr(iroh.EndpointId.from_string(ticket.peer_id), ticket.relay_url, list(ticket.addrs))
            return _QuicConnection(await asyncio.wait_for(self._ep.connect(addr, protocol.alpn), timeout))
        except TimeoutError:
            raise ConnectTimeout(f"peer {ticket.peer_id[:10]} did not answer within {timeout:.3g} s") from None
        except iroh.IrohError as exc:
            error = _translate(exc, f"connect to {ticket.peer_id[:10]} ({protocol})")
            if protocol != META and any(m in exc.message().lower() for m in _NO_ALPN_MARKERS):
                raise ProtocolMismatch(str(protocol), await self._remote_protocols(ticket, timeout)) from None
            raise error from None

    async def _release(self, linger: float) -> None:
        # close the endpoint first (its incoming connections with it): it ends the pending
        # accept_next; cancelling that call instead leaves iroh's close waiting for it
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._ep.close(), linger)
        if self._accept_task is not None:
            self._accept_task.cancel()
        binding.release_deferred()
