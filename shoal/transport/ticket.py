"""The one ticket format of shoal: a versioned string that lets another peer reach this one.

    shoal1<base32 of msgpack {"id": peer id hex, "a": [addresses], "r": relay url or None,
                              "s": swarm id or None}>

Lowercase base32 without padding, so a ticket survives shells, URLs and copy-paste.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import msgpack

from shoal.errors import TicketError

PREFIX = "shoal1"
MAX_TICKET_CHARS = 4096


@dataclass(frozen=True)
class Ticket:
    peer_id: str
    addrs: tuple[str, ...] = field(default_factory=tuple)
    relay_url: str | None = None
    swarm_id: str | None = None

    def __str__(self) -> str:
        packed = msgpack.packb({"id": self.peer_id, "a": list(self.addrs), "r": self.relay_url, "s": self.swarm_id})
        return PREFIX + base64.b32encode(packed).decode().rstrip("=").lower()

    @classmethod
    def parse(cls, text: str) -> Ticket:
        text = text.strip()
        if not text.startswith(PREFIX):
            raise TicketError(f"not a shoal ticket (expected it to start with {PREFIX!r}): {text[:24]!r}")
        if len(text) > MAX_TICKET_CHARS:
            raise TicketError(f"ticket longer than {MAX_TICKET_CHARS} characters")
        body = text[len(PREFIX) :].upper()
        try:
            raw = msgpack.unpackb(base64.b32decode(body + "=" * (-len(body) % 8)), raw=False)
            peer_id, addrs, relay, swarm = raw["id"], raw["a"], raw["r"], raw["s"]
        except Exception as exc:  # base32, msgpack and key errors alike mean a damaged ticket
            raise TicketError(f"damaged ticket ({type(exc).__name__}): {text[:24]!r}...") from None
        if not (isinstance(peer_id, str) and len(peer_id) == 64 and all(c in "0123456789abcdef" for c in peer_id)):
            raise TicketError("ticket peer id must be 64 hex characters")
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise TicketError("ticket addresses must be a list of strings")
        return cls(
            peer_id, tuple(addrs), relay if isinstance(relay, str) else None, swarm if isinstance(swarm, str) else None
        )
