"""Servers that failed recently, kept out of routes for a while (exponential backoff)."""

from __future__ import annotations

import time
from collections.abc import Callable


class BanList:
    """A failing server is banned for ``base`` seconds, doubling with each further failure up to
    ``ceiling``; a success resets its count. Bans are advice: a router ignores them when every
    server for some block is banned (see :func:`shoal.routing.costs.route_with_bans`)."""

    def __init__(self, base: float = 1.0, ceiling: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.base = base
        self.ceiling = ceiling
        self.clock = clock
        self._until: dict[str, float] = {}
        self._failures: dict[str, int] = {}

    def ban(self, peer: str, seconds: float | None = None) -> float:
        """Ban ``peer``; returns the ban's length."""
        count = self._failures.get(peer, 0)
        self._failures[peer] = count + 1
        length = seconds if seconds is not None else min(self.ceiling, self.base * 2**count)
        self._until[peer] = max(self._until.get(peer, 0.0), self.clock() + length)
        return length

    def lift(self, peer: str) -> None:
        """End ``peer``'s ban now (what it was banned for no longer holds); its failure count stays."""
        self._until.pop(peer, None)

    def succeeded(self, peer: str) -> None:
        self._failures.pop(peer, None)

    def banned(self, peer: str) -> bool:
        until = self._until.get(peer)
        if until is None:
            return False
        if self.clock() >= until:
            del self._until[peer]
            return False
        return True

    def failures(self, peer: str) -> int:
        return self._failures.get(peer, 0)
