"""An in-process transport: shoal nodes in one event loop, connected by in-memory pipes.

:class:`MemoryNode` offers what :class:`shoal.transport.Node` offers (handlers per protocol, real
ed25519 peer ids, real tickets, pooled connections, streams, the meta protocol) and shares its
framing, pool and handler boundary (:mod:`shoal.transport.base`), so streams carry the very bytes
iroh would and limits, malformed frames and timeouts behave the same. What differs is below the
bytes: no QUIC, no encryption, no flow control beyond a bounded buffer per stream direction.

Failures look like iroh's: dialling a node that is closed or unknown waits out the connect
deadline (nobody answers: :class:`ConnectTimeout`); a protocol the peer does not serve is a
:class:`ProtocolMismatch` naming both sides; closing a node or dropping a connection ends its
streams (the peer's reads and writes raise :class:`ClosedError`).

    network = MemoryNetwork()
    server = await network.start(handlers={BLOCKS: handle})
    client = await network.start()
    reply = await client.request(server.ticket(), BLOCKS, Message("info", 1))
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections import deque

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.errors import ClosedError, ConnectTimeout, ProtocolMismatch, RefusedError, ShoalError
from shoal.transport.base import META, BaseNode, Handler, Protocol
from shoal.transport.config import TransportConfig
from shoal.transport.identity import generate_key
from shoal.transport.ticket import Ticket
from shoal.wire import MAX_FRAME_PAYLOAD

__all__ = ["MEMORY_HOST", "STREAM_WINDOW", "MemoryNetwork", "MemoryNode", "peer_id_of"]

MEMORY_HOST = "127.0.77.1"  # tickets name "127.0.77.1:<port>": a loopback address no real node binds here
STREAM_WINDOW = 2 * MAX_FRAME_PAYLOAD  # bytes a stream direction buffers before its writer waits


def peer_id_of(secret_key: bytes) -> str:
    """The peer id iroh derives from ``secret_key`` (the hex ed25519 public key): a memory node and
    an iroh node with the same key have the same id."""
    return Ed25519PrivateKey.from_private_bytes(secret_key).public_key().public_bytes_raw().hex()


def _wake(waiters: list[asyncio.Future]) -> None:
    for future in waiters:
        if not future.done():
            try:
                future.set_result(None)
            except RuntimeError:  # its loop closed (a stream dropped at shutdown): nobody waits any more
                pass
    waiters.clear()


async def _wait(waiters: list[asyncio.Future]) -> None:
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


class _Pipe:
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
            _wake(self._readers)
        while self._size > self.window and self._error is None:
            await _wait(self._writers)
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
            await _wait(self._readers)
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
            await _wait(self._readers)
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
            _wake(self._writers)
        if len(parts) == 1 and isinstance(parts[0], bytes):
            return parts[0]
        return b"".join(parts)

    def finish(self) -> None:
        self._finished = True
        _wake(self._readers)

    def fail(self, reason: str) -> None:
        if self._error is not None:
            return
        self._error = reason
        self._chunks.clear()
        self._size = 0
        _wake(self._readers)
        _wake(self._writers)


class _PipeChannel:
    """One end of an in-memory stream, as a :class:`~shoal.transport.stream.ByteChannel`."""

    errors = (ClosedError,)

    def __init__(self, outgoing: _Pipe, incoming: _Pipe):
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


class _Link:
    """A connection between two memory nodes for one protocol. Closing it (from either side, or
    either node closing) fails every stream on it, as closing a QUIC connection does."""

    __slots__ = ("_acceptor", "_alpn", "_dialler", "_pipes", "_reason", "_window")

    def __init__(self, dialler: MemoryNode, acceptor: MemoryNode, alpn: bytes):
        self._dialler, self._acceptor, self._alpn = dialler, acceptor, alpn
        self._reason: str | None = None
        self._pipes: weakref.WeakSet[_Pipe] = weakref.WeakSet()
        self._window = dialler.network.stream_window
        dialler._links.add(self)
        acceptor._links.add(self)

    def is_closed(self) -> bool:
        return self._reason is not None

    def close(self, reason: str) -> None:
        if self._reason is not None:
            return
        self._reason = reason
        for pipe in list(self._pipes):
            pipe.fail(f"connection closed: {reason}")
        self._dialler._links.discard(self)
        self._acceptor._links.discard(self)

    def rtt_ms(self) -> float | None:
        return None if self._reason is not None else 0.0

    async def open_channel(self) -> _PipeChannel:
        if self._reason is not None:
            raise ClosedError(f"open stream: connection closed: {self._reason}")
        up, down = _Pipe(self._window), _Pipe(self._window)  # dialler -> acceptor, acceptor -> dialler
        self._pipes.add(up)
        self._pipes.add(down)
        acceptor = self._acceptor
        stream = acceptor._stream(_PipeChannel(down, up), self._dialler.id)
        acceptor._serve_stream(acceptor._handlers[self._alpn], stream)
        return _PipeChannel(up, down)


class MemoryNetwork:
    """A hub of in-process nodes: which node answers at which address. Nodes of one network reach
    each other; a ticket from elsewhere reaches nobody (its dial times out)."""

    def __init__(self, stream_window: int = STREAM_WINDOW):
        self.stream_window = stream_window
        self._at: dict[str, MemoryNode] = {}  # address -> the live node bound there
        self._ports = itertools.cycle(range(1, 65536))

    async def start(
        self,
        config: TransportConfig = TransportConfig(),
        handlers: dict[Protocol, Handler] | None = None,
        secret_key: bytes | None = None,
    ) -> MemoryNode:
        return await MemoryNode.start(self, config, handlers, secret_key)

    def _bind(self, node: MemoryNode) -> str:
        if len(self._at) >= 65535:
            raise RefusedError("memory network is full (65535 live nodes)")
        while (address := f"{MEMORY_HOST}:{next(self._ports)}") in self._at:
            pass
        self._at[address] = node
        return address

    def _unbind(self, node: MemoryNode) -> None:
        if self._at.get(node.address) is node:
            del self._at[node.address]

    def _find(self, ticket: Ticket) -> MemoryNode | None:
        """The live node ``ticket`` reaches: at one of its addresses with its peer id; a ticket
        without addresses by peer id alone (as an address lookup would)."""
        if ticket.addrs:
            found = (self._at.get(address) for address in ticket.addrs)
            return next((n for n in found if n is not None and n.id == ticket.peer_id), None)
        return next((n for n in self._at.values() if n.id == ticket.peer_id), None)


class MemoryNode(BaseNode):
    """A shoal node in a :class:`MemoryNetwork`, with :class:`~shoal.transport.Node`'s interface."""

    def __init__(
        self, network: MemoryNetwork, config: TransportConfig, handlers: dict[Protocol, Handler], secret_key: bytes
    ):
        super().__init__(config, handlers)
        self.network = network
        self.id: str = peer_id_of(secret_key)
        self._links: set[_Link] = set()  # every open connection, dialled or accepted
        self.address = network._bind(self)

    @classmethod
    async def start(
        cls,
        network: MemoryNetwork,
        config: TransportConfig = TransportConfig(),
        handlers: dict[Protocol, Handler] | None = None,
        secret_key: bytes | None = None,
    ) -> MemoryNode:
        return cls(network, config, dict(handlers or {}), secret_key or generate_key())

    def ticket(self, swarm_id: str | None = None) -> Ticket:
        return Ticket(self.id, (self.address,), None, swarm_id)

    async def _dial(self, ticket: Ticket, protocol: Protocol, timeout: float | None) -> _Link:
        if self.closed:
            raise ClosedError("node is closed")
        timeout = self.config.deadlines.connect if timeout is None else timeout
        await asyncio.sleep(0)  # a dial is never instant: let the loop run, as a handshake would
        peer = self.network._find(ticket)
        if peer is None:  # nobody answers at those addresses
            await asyncio.sleep(timeout)
            raise ConnectTimeout(f"peer {ticket.peer_id[:10]} did not answer within {timeout:.3g} s")
        if protocol.alpn not in peer._handlers:
            if protocol == META:  # cannot happen: every node serves it
                raise RefusedError(f"connect to {ticket.peer_id[:10]} ({protocol}): no application protocol")
            raise ProtocolMismatch(str(protocol), await self._remote_protocols(ticket, timeout))
        if self.closed:
            raise ClosedError("node is closed")
        return _Link(self, peer, protocol.alpn)

    async def _release(self, linger: float) -> None:
        self.network._unbind(self)
        for link in list(self._links):
            link.close("peer closed")
