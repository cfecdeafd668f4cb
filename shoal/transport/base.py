"""What every shoal transport shares: protocols, the connection pool, the handler error boundary and
the meta protocol. :class:`shoal.transport.Node` (iroh) and :class:`shoal.transport.MemoryNode`
(in-process) differ only in how they dial, accept and carry bytes, so whatever a test learns on one
holds on the other.

Protocols are versioned ALPNs ``shoal/<name>/<version>``. Every node also speaks ``shoal/meta/1``,
which answers ``hello`` with the protocols the node serves, so a refused dial can say what each side
speaks. A node with a :attr:`~BaseNode.credential` (a private swarm's member certificate) presents it
in a ``hello`` before each connection of another protocol it dials; what peers presented is kept in
:attr:`~BaseNode.credentials` (opaque bytes here: their checks are the swarm's). A connection
carries one protocol (QUIC binds it to one ALPN), so the pool keeps one connection per (peer,
protocol), shared by all concurrent streams of that protocol. A peer hosted in this very process
(:meth:`BaseNode.add_local_peer`: the span a gateway serves itself) is reached over in-process pipes
(:mod:`shoal.transport.pipes`) instead: the same frames and handler boundary, no network hop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol as TypingProtocol
from typing import Self

from shoal.errors import ClosedError, ProtocolMismatch, RequestTimeout, ShoalError, WireError
from shoal.transport.config import TransportConfig
from shoal.transport.guard import PeerGuard
from shoal.transport.pipes import Link
from shoal.transport.stream import ByteChannel, MessageStream, ReceivedBytes
from shoal.transport.ticket import Ticket
from shoal.wire import CAPABILITIES, InvalidMessage, Message, error_message
from shoal.wire.schema import Hello, HelloReply

log = logging.getLogger(__name__)
MAX_CREDENTIALS = 4096  # peers whose presented credential a node keeps (least recently presented go first)


CLOSE_LINGER_S = 3.0  # seconds an endpoint may take to close gracefully


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
Handler = Callable[[MessageStream, str], Awaitable[None]]
#: How a node comes up: ``start(config, handlers=None, secret_key=None)``, e.g. :meth:`Node.start`
#: (iroh) or :meth:`MemoryNetwork.start` (a node of an in-process network).
StartNode = Callable[..., Awaitable["BaseNode"]]


class Connection(TypingProtocol):
    """A pooled connection to one peer for one protocol, as the pool sees it."""

    def is_closed(self) -> bool: ...

    def close(self, reason: str) -> None:
        """Close it and every stream on it (both peers see them end). Never raises."""

    def rtt_ms(self) -> float | None: ...

    async def open_channel(self) -> ByteChannel:
        """A new stream's channel; raises a :class:`ShoalError` if the connection is gone."""


class BaseNode:
    """A peer: serves some protocols (handlers), dials others. Subclasses supply ``id``,
    :meth:`ticket`, :meth:`_dial` and :meth:`_release`."""

    id: str

    def __init__(self, config: TransportConfig, handlers: dict[Protocol, Handler]):
        self.config = config
        self._handlers: dict[bytes, Handler] = {p.alpn: h for p, h in handlers.items()}
        self._handlers[META.alpn] = self._serve_meta
        self._conns: dict[tuple[str, bytes], Connection] = {}
        self._conn_addrs: dict[tuple[str, bytes], tuple[str, ...]] = {}  # what each was dialled at
        self._dial_locks: dict[tuple[str, bytes], asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self.closed = False
        self.rejected_frames: Counter[str] = Counter()  # malformed frames answered with a wire error, by reason
        self.received = ReceivedBytes()  # frame bytes read by every stream of this node, dialled or accepted
        self.guard = PeerGuard(config.limits)  # what each peer holds here: connections, streams, unfinished bytes
        self.credential: bytes | None = None  # what this node presents to the peers it dials (see hello)
        self.credentials: OrderedDict[str, bytes] = OrderedDict()  # what peers presented to us, by peer id
        self.links: set[Link] = set()  # open in-process connections, dialled or accepted
        self._local_peers: dict[str, BaseNode] = {}  # peers in this process, dialled over pipes

    @property
    def protocols(self) -> list[str]:
        return sorted(alpn.decode() for alpn in self._handlers)

    def ticket(self, swarm_id: str | None = None) -> Ticket:
        raise NotImplementedError

    async def _dial(self, ticket: Ticket, protocol: Protocol, timeout: float | None) -> Connection:
        raise NotImplementedError

    async def _release(self, linger: float) -> None:
        """Stop accepting and close what the pool does not hold (incoming connections), waiting at
        most ``linger`` seconds for the peers to take the close."""
        raise NotImplementedError

    # ---- serving ---------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _stream(self, channel: ByteChannel, peer_id: str) -> MessageStream:
        """A stream with ``peer_id`` over ``channel``, dialled or accepted: this node's limits,
        request deadline, byte counts and guard."""
        limits, timeout = self.config.limits, self.config.deadlines.request
        return MessageStream(channel, peer_id, limits, timeout, self.received, self.guard)

    def _serve_stream(self, handler: Handler, stream: MessageStream) -> asyncio.Task:
        """Serve a stream a peer opened, unless that peer already has its limit of streams open
        here: then it is answered with a wire error ``over_limit`` and ended."""
        if not self.guard.admit_stream(stream.peer_id):
            limit = self.config.limits.max_streams_per_peer
            text = f"peer has {limit} streams open here (--max-streams-per-peer): finish some first"
            return self._spawn(self._refuse_stream(stream, text))
        return self._spawn(self._run_handler(handler, stream))

    async def _refuse_stream(self, stream: MessageStream, text: str) -> None:
        self.rejected_frames["over_limit"] += 1
        await self._answer(stream, error_message(0, "wire", text, reason="over_limit"))
        await stream.finish()
        await stream.stop()

    async def _run_handler(self, handler: Handler, stream: MessageStream) -> None:
        """The error boundary of every handler: what it lets escape ends its stream, answered
        where the peer can still learn something from it. A handler that returned reads no more:
        its stream is stopped, so a peer still sending learns it at once instead of waiting."""
        try:
            await handler(stream, stream.peer_id)
        except (ClosedError, RequestTimeout):
            pass
        except WireError as exc:  # framing is lost: answer once, then drop the stream
            self.rejected_frames[exc.reason] += 1
            await self._answer(stream, error_message(0, "wire", str(exc), reason=exc.reason))
        except InvalidMessage as exc:  # the handler did not answer it: do so, then end the stream
            await self._answer(stream, error_message(exc.request_id, exc.code, exc.remote_message))
        except Exception:
            log.exception("handler failed for peer %s", stream.peer_id[:10])
        finally:
            self.guard.release_stream(stream.peer_id)
            await stream.finish()
            await stream.stop()

    @staticmethod
    async def _answer(stream: MessageStream, message: Message) -> None:
        try:
            await stream.send(message)
        except ShoalError:
            pass

    async def _serve_meta(self, stream: MessageStream, peer_id: str) -> None:
        """``hello``: the protocols and capabilities we have. ``ping``: echo (tensors too unless
        ``echo`` is false), for liveness, round-trip and throughput measurement. Serves until the
        stream ends; a request whose metadata does not validate is answered and the stream goes on."""
        while True:
            try:
                request = await stream.recv(self.config.deadlines.idle)
            except InvalidMessage as exc:
                await stream.send(error_message(exc.request_id, exc.code, exc.remote_message))
                continue
            if request.kind == "ping":
                reply = Message("result", request.id, tensors=request.tensors if request.meta.echo else [])
            elif request.kind == "hello":
                if request.meta.credential is not None:
                    self._keep_credential(peer_id, request.meta.credential)
                reply = Message("result", request.id, HelloReply(protocols=self.protocols, capabilities=CAPABILITIES))
            else:
                reply = error_message(request.id, "bad_request", f"meta protocol does not serve {request.kind!r}")
            await stream.send(reply)

    def _keep_credential(self, peer_id: str, credential: bytes) -> None:
        self.credentials[peer_id] = credential
        self.credentials.move_to_end(peer_id)
        while len(self.credentials) > MAX_CREDENTIALS:
            self.credentials.popitem(last=False)

    # ---- dialling --------------------------------------------------------------------------
    def add_local_peer(self, peer: BaseNode) -> None:
        """Reach ``peer``, a node of this process on this event loop, over in-process pipes from now
        on, whatever its ticket's addresses: its streams carry the same frames (encoded, limited and
        validated as over QUIC) without a network hop, and its round trip measures about zero."""
        if peer is self:
            raise ValueError("a node does not dial itself")
        self._local_peers[peer.id] = peer

    def is_local(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is reached in-process (:meth:`add_local_peer`)."""
        return peer_id in self._local_peers

    async def _dial_local(self, peer: BaseNode, protocol: Protocol) -> Link:
        if self.closed:
            raise ClosedError("node is closed")
        if peer.closed:
            raise ClosedError(f"peer {peer.id[:10]} (in this process) is closed")
        if protocol.alpn not in peer._handlers:
            raise ProtocolMismatch(str(protocol), peer.protocols)
        await asyncio.sleep(0)  # as a dial: let the loop run
        return Link(self, peer, protocol.alpn)

    async def connect(self, ticket: Ticket, protocol: Protocol, timeout: float | None = None) -> Connection:
        """A pooled connection to ``ticket``'s peer for ``protocol`` (dialled if needed)."""
        key = (ticket.peer_id, protocol.alpn)
        conn = self._usable(key, ticket)
        if conn is not None:
            return conn
        async with self._dial_locks.setdefault(key, asyncio.Lock()):
            conn = self._usable(key, ticket)
            if conn is not None:
                return conn
            if self.credential is not None and protocol != META:  # before anything it may be refused for
                await self.request(ticket, META, Message("hello", 1, Hello(credential=self.credential)), timeout)
            local = self._local_peers.get(ticket.peer_id)
            if local is not None:
                conn = await self._dial_local(local, protocol)
            else:
                conn = await self._dial(ticket, protocol, timeout)
            self._conns[key] = conn
            self._conn_addrs[key] = tuple(ticket.addrs)
            return conn

    def _usable(self, key: tuple[str, bytes], ticket: Ticket) -> Connection | None:
        """The pooled connection, unless it closed or the ticket shares no address with the one it
        was dialled at (the peer restarted elsewhere with the same identity: the old connection
        may not know yet that it is dead)."""
        conn = self._conns.get(key)
        if conn is None or conn.is_closed():
            return None
        if ticket.addrs and not set(ticket.addrs) & set(self._conn_addrs.get(key, ticket.addrs)):
            return None  # dial anew; streams still open on the old connection keep it until they end
        return conn

    async def _remote_protocols(self, ticket: Ticket, timeout: float) -> list[str] | None:
        """What the peer says it speaks (for a :class:`ProtocolMismatch`), None if it does not say."""
        try:
            reply = await self.request(ticket, META, Message("hello", 1), timeout=timeout)
            return [str(p) for p in reply.reply(HelloReply).protocols]
        except ShoalError:
            return None

    async def open_stream(self, ticket: Ticket, protocol: Protocol, timeout: float | None = None) -> MessageStream:
        for attempt in range(2):  # a pooled connection may have died since last use: redial once
            conn = await self.connect(ticket, protocol, timeout)
            try:
                channel = await conn.open_channel()
            except ShoalError:
                self._conns.pop((ticket.peer_id, protocol.alpn), None)
                if attempt:
                    raise
                continue
            return self._stream(channel, ticket.peer_id)
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
        return conn.rtt_ms() if conn is not None else None

    def drop_connection(self, peer_id: str) -> None:
        for key in [k for k in self._conns if k[0] == peer_id]:
            self._conns.pop(key).close("dropped")

    async def close(self, linger: float = CLOSE_LINGER_S) -> None:
        """Close every connection and stop. ``linger``: at most this long for the endpoint to close
        gracefully (after a dial that timed out, iroh's close waits this long for it: a node that
        only checked whether a peer answers may pass less)."""
        if self.closed:
            return
        self.closed = True
        for conn in self._conns.values():
            conn.close("bye")
        self._conns.clear()
        await self._release(linger)
        for link in list(self.links):
            link.close("peer closed")
        for task in list(self._tasks):
            task.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
