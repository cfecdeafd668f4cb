"""Peer transport on iroh: endpoints with persistent identities, tickets, pooled QUIC connections
and streams of shoal messages."""

from shoal.transport.config import Deadlines, NetworkProfile, TransportConfig
from shoal.transport.identity import load_or_create_identity
from shoal.transport.node import (
    META,
    EndpointPlan,
    Handler,
    MessageStream,
    Node,
    Protocol,
    endpoint_options,
    endpoint_plan,
)
from shoal.transport.ticket import Ticket

__all__ = [
    "META",
    "Deadlines",
    "EndpointPlan",
    "Handler",
    "MessageStream",
    "NetworkProfile",
    "Node",
    "Protocol",
    "Ticket",
    "TransportConfig",
    "endpoint_options",
    "endpoint_plan",
    "load_or_create_identity",
]
