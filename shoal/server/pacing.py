"""The batcher's clocks (sans I/O: times are passed in): what batches cost, and when each
session's next step is due back at this server.

:class:`BatchCosts`: the seconds batched forwards took, by their size; the contended cap and the
merge wait are counted in lone steps of it.

A session in a chain is away between two of its steps here: on the next servers, at its client,
on the wire. Its steps come back about as long after the last one finished as they stayed away
before. :class:`Arrivals` keeps that time per session (its last: a steady chain's changes little,
and one that regrouped is better predicted by it than by an average) so the batcher can tell,
when the compute thread frees up, whether other sessions are about to come back: the steps of a
client's sessions arrive as a burst spread over a few milliseconds (its replies are handled one
after another), and a batch that starts on the first of them and leaves the rest for the next one
splits the sessions into groups that never merge again, each paying a forward of its own.

Keys are whatever identifies a session's steps (the batcher uses the session's cache); ``gone``
tells a key whose session ended (a closed cache), forgotten at once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

#: a session that has not come back for this long is forgotten (closed, or its user thinks)
FORGET_AFTER = 5.0


class BatchCosts:
    """Seconds a batched forward took, by its new positions (power-of-two buckets), as moving averages."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    @staticmethod
    def bucket(positions: int) -> int:
        return 1 << max(0, positions - 1).bit_length()

    def record(self, positions: int, seconds: float) -> None:
        bucket, old = self.bucket(positions), self._seconds.get(self.bucket(positions))
        self._seconds[bucket] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def alone(self) -> float | None:
        """Seconds a lone one-position step takes; until one ran, the cheapest batch measured (an
        upper bound); None before any."""
        if 1 in self._seconds:
            return self._seconds[1]
        return min(self._seconds.values(), default=None)

    def limit(self, factor: float, most: int) -> int:
        """The most new positions a batch may take to cost at most ``factor`` lone steps (a bucket
        not measured yet is allowed: trying it measures it)."""
        alone = self._seconds.get(1)
        if alone is None:
            return most
        allowed, bucket = 1, 2
        while bucket <= most:
            cost = self._seconds.get(bucket)
            if cost is not None and cost > factor * alone:
                break
            allowed, bucket = bucket, bucket * 2
        return allowed if bucket <= most else most


class Arrivals:
    """Sessions' away times, and which are due back soon."""

    def __init__(self, gone: Callable[[Hashable], bool] = lambda key: False) -> None:
        self._gone = gone
        self._away: dict[Hashable, float] = {}  # session -> seconds it was away last time
        self._left: dict[Hashable, float] = {}  # away session -> when its last step finished here
        self.last_arrival = float("-inf")

    def arrived(self, key: Hashable, now: float) -> None:
        """A step of ``key`` was queued."""
        left = self._left.pop(key, None)
        if left is not None:
            self._away[key] = now - left
        self.last_arrival = now

    def finished(self, key: Hashable, now: float) -> None:
        """``key``'s step is done here: it is away until its next."""
        self._left[key] = now

    def _active(self, now: float) -> dict[Hashable, float]:
        """The away sessions still expected (others forgotten)."""
        for key, left in list(self._left.items()):
            if now - left > FORGET_AFTER or self._gone(key):
                del self._left[key]
                self._away.pop(key, None)
        return self._left

    def bursting(self, now: float, gap: float) -> bool:
        """Whether steps are coming in a burst: one came less than ``gap`` ago while other sessions
        are away (and may be in it). Covers what :meth:`due` cannot predict: sessions that never
        came back yet (a client's first decode steps after its prefills), or whose last time away
        says nothing of this one (a pause)."""
        return now - self.last_arrival < gap and bool(self._active(now))

    def due(self, now: float, within: float) -> int:
        """How many away sessions are expected back within ``within`` seconds of ``now`` (one a
        little late counts: it is about to come; one later than ``within`` does not). A session
        not yet seen coming back is expected to stay away as long as the others do (the median)."""
        active = self._active(now)
        known = sorted(self._away.values())
        typical = known[len(known) // 2] if known else None
        count = 0
        for key, left in active.items():
            away = self._away.get(key, typical)
            if away is not None and abs(left + away - now) <= within:
                count += 1
        return count


__all__ = ["Arrivals", "BatchCosts"]
