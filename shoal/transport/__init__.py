"""Peer transport: nodes with persistent identities, tickets, pooled connections and streams of
shoal messages; on iroh QUIC (:class:`Node`) or in one process (:class:`MemoryNode`), both built
on the same framing and pool (:mod:`shoal.transport.base`, :mod:`shoal.transport.stream`)."""

from shoal.transport.base import META, BaseNode, Handler, Protocol, StartNode
from shoal.transport.config import Deadlines, NetworkProfile, TransportConfig
from shoal.transport.identity import load_or_create_identity
from shoal.transport.memory import MemoryNetwork, MemoryNode
from shoal.transport.node import EndpointPlan, Node, endpoint_options, endpoint_plan
from shoal.transport.stream import ByteChannel, MessageStream, ReceivedBytes
from shoal.transport.ticket import Ticket

__all__ = [
    "META",
    "BaseNode",
    "ByteChannel",
    "Deadlines",
    "EndpointPlan",
    "Handler",
    "MemoryNetwork",
    "MemoryNode",
    "MessageStream",
    "NetworkProfile",
    "Node",
    "Protocol",
    "ReceivedBytes",
    "StartNode",
    "Ticket",
    "TransportConfig",
    "endpoint_options",
    "endpoint_plan",
    "load_or_create_identity",
]
