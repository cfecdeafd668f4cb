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

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.errors import ClosedError, ConnectTimeout, ProtocolMismatch, RefusedError
from shoal.transport.base import META, BaseNode, Handler, Protocol
from shoal.transport.config import TransportConfig
from shoal.transport.identity import generate_key
from shoal.transport.pipes import STREAM_WINDOW, Link
from shoal.transport.ticket import Ticket

__all__ = ["MEMORY_HOST", "STREAM_WINDOW", "MemoryNetwork", "MemoryNode", "peer_id_of"]

MEMORY_HOST = "127.0.77.1"  # tickets name "127.0.77.1:<port>": a loopback address no real node binds here


def peer_id_of(secret_key: bytes) -> str:
    """The peer id iroh derives from ``secret_key`` (the hex ed25519 public key): a memory node and
    an iroh node with the same key have the same id."""
    return Ed25519PrivateKey.from_private_bytes(secret_key).public_key().public_bytes_raw().hex()


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

    async def _dial(self, ticket: Ticket, protocol: Protocol, timeout: float | None) -> Link:
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
        return Link(self, peer, protocol.alpn, self.network.stream_window)

    async def _release(self, linger: float) -> None:
        self.network._unbind(self)  # its links close with it (BaseNode.close)
