"""Transport settings as small value objects: deadlines, network profile, limits."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shoal.ids import socket_address
from shoal.wire import Limits


@dataclass(frozen=True)
class Deadlines:
    """Separate deadlines, in seconds. A single call may override them."""

    connect: float = 5.0  # dial + QUIC handshake
    request: float = 60.0  # one request/response, or one inference step
    idle: float = 300.0  # a long-lived stream with no message is closed after this


class NetworkProfile(enum.StrEnum):
    """``local``: no relays, no address lookup (tests, private LANs). ``internet``: iroh's default
    relays and address lookup, so peers behind NATs find each other."""

    LOCAL = "local"
    INTERNET = "internet"


@dataclass(frozen=True)
class TransportConfig:
    profile: NetworkProfile = NetworkProfile.LOCAL
    bind_addr: str | None = None  # e.g. "127.0.0.1:0"; None lets iroh choose (all interfaces)
    deadlines: Deadlines = field(default_factory=Deadlines)
    limits: Limits = field(default_factory=Limits)
    # addresses the node's tickets and records carry instead of its bound ones (a public address
    # behind port forwarding, a proxy in front of it): ``IP:PORT``, normalised; () announces the bound ones
    announce_addrs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "announce_addrs", tuple(socket_address(a) for a in self.announce_addrs))
