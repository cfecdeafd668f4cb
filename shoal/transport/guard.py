"""What peers hold of a node, counted per peer and in total, against :class:`shoal.limits.Limits`.

Every node (server, client, gateway) accepts connections and streams from any peer and reads what
they send. :class:`PeerGuard` keeps one peer from holding more than its share: connections and
streams it opened to us, and bytes of messages it started but has not finished (a message's buffer
grows as its bytes arrive, so the bytes held are the bytes received). A peer over a limit is refused
(its new connection closed, its new stream answered with an error, its message dropped with a wire
error); honest peers beside it are untouched. Pure bookkeeping: no I/O here.
"""

from __future__ import annotations

from collections import Counter

from shoal.errors import WireError
from shoal.limits import Limits, count_down, flag_of


class OverLimit(WireError):
    """A peer went over one of the node's limits (``reason`` names the limit's flag's subject)."""


class PeerGuard:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.connections: Counter[str] = Counter()
        self.streams: Counter[str] = Counter()
        self.inflight: Counter[str] = Counter()
        self.inflight_total = 0
        self.refused: Counter[str] = Counter()  # refusals, by limit name

    # ---- connections and streams ------------------------------------------------------------
    def admit_connection(self, peer: str) -> bool:
        return self._admit(self.connections, peer, "max_connections_per_peer")

    def release_connection(self, peer: str) -> None:
        count_down(self.connections, peer, 1)

    def admit_stream(self, peer: str) -> bool:
        return self._admit(self.streams, peer, "max_streams_per_peer")

    def release_stream(self, peer: str) -> None:
        count_down(self.streams, peer, 1)

    def _admit(self, held: Counter[str], peer: str, limit: str) -> bool:
        """One more for ``peer`` in ``held``, unless it holds the limit ``limit`` names already."""
        if held[peer] >= getattr(self.limits, limit):
            self.refused[limit] += 1
            return False
        held[peer] += 1
        return True

    # ---- bytes of unfinished messages --------------------------------------------------------
    def take_bytes(self, peer: str, n: int) -> None:
        """Count ``n`` more bytes held for ``peer``'s unfinished message, or raise :class:`OverLimit`."""
        limits = self.limits
        if self.inflight[peer] + n > limits.max_inflight_bytes_per_peer:
            self.refused["max_inflight_bytes_per_peer"] += 1
            raise OverLimit(
                "over_limit",
                f"peer holds more than {limits.max_inflight_bytes_per_peer} bytes of unfinished messages here "
                f"({flag_of('max_inflight_bytes_per_peer')})",
            )
        if self.inflight_total + n > limits.max_inflight_bytes:
            self.refused["max_inflight_bytes"] += 1
            raise OverLimit(
                "over_limit",
                f"node holds {limits.max_inflight_bytes} bytes of unfinished messages from its peers "
                f"({flag_of('max_inflight_bytes')}): try again shortly",
            )
        self.inflight[peer] += n
        self.inflight_total += n

    def give_bytes(self, peer: str, n: int) -> None:
        if n:
            count_down(self.inflight, peer, n)
            self.inflight_total = max(0, self.inflight_total - n)


__all__ = ["OverLimit", "PeerGuard"]
