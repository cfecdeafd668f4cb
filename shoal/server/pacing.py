"""The batcher's clocks and groups (sans I/O: times are passed in): what batches cost, when each
session's next step is due back at this server, and which group of sessions it runs in.

:class:`BatchCosts`: the seconds batched forwards took, by their size; the contended cap and the
merge wait are counted in lone steps of it, and :func:`choose_groups` weighs groupings with it.

A session in a chain is away between two of its steps here: on the next servers, at its client,
on the wire. Its steps come back about as long after the last one finished as they stayed away
before. :class:`Arrivals` keeps that time per session (its last: a steady chain's changes little,
and one that regrouped is better predicted by it than by an average) so the batcher can tell,
when the compute thread frees up, whether other sessions are about to come back: the steps of a
client's sessions arrive as a burst spread over a few milliseconds (its replies are handled one
after another), and a batch that starts on the first of them and leaves the rest for the next one
splits the sessions into fragments that never merge again, each paying a forward of its own.

Groups: a chain is a pipeline, and one batch of all its sessions keeps only one of its servers
busy at a time: while their steps run on the next server, this one idles. So sessions run in
groups, a batch each, as a pipelined model runs micro-batches (vLLM's virtual engines, one per
pipeline stage). How many: a session's cycle (its time here and away) over its time here is how
deep its chain is in this server's steps (:meth:`Arrivals.depth`): about 2 in a chain of two like
servers, 1 and a bit for a lone server's sessions (back as soon as their client answers), and
down towards 1 for the chain's bottleneck (its queue keeps steps waiting: here as long as away).
:func:`choose_groups` takes the fewest groups for the quickest round, from what batches cost here
(:meth:`BatchCosts.predict`). On this project's 2-core machine a batch of 8 rows of the 270M llama's
half (8 blocks) costs 55 ms and one of 16 71 ms; 16 sessions of a 2-server chain go round in about
140 ms in two groups, 170 ms in one. Groups are not lists: a batch takes at most a group's share
of the rows, and the sessions that ran together (a cohort, :meth:`Arrivals.cohort_of`) come back
and are waited for together.

Keys are whatever identifies a session's steps (the batcher uses the session's cache); ``gone``
tells a key whose session ended (a closed cache), forgotten at once.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable
from dataclasses import dataclass

#: a session that has not come back for this long is forgotten (closed, or its user thinks)
FORGET_AFTER = 5.0
#: a grouping stays unless another is expected to take this much less time a round
REGROUP_GAIN = 0.9


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

    def predict(self, positions: int) -> float | None:
        """Seconds a batch of ``positions`` new positions should take: linear between the measured
        buckets; optimistic outside them (a smaller batch cheaper by as many fewer positions, a
        larger one no dearer), so a grouping that needs them is tried, and trying it measures
        them (as :meth:`limit` tries an unmeasured bucket). None before any batch ran."""
        known = sorted(self._seconds.items())
        if not known:
            return None
        (smallest, cheapest), (largest, dearest) = known[0], known[-1]
        if positions <= smallest:
            return cheapest * positions / smallest
        if positions >= largest:
            return dearest
        (b0, s0), (b1, s1) = next(
            (known[i], known[i + 1]) for i in range(len(known) - 1) if known[i + 1][0] >= positions
        )
        return s0 + (s1 - s0) * (positions - b0) / (b1 - b0)

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


@dataclass
class _Session:
    rows: int = 1
    width: int = 1  # new positions per row of its last step
    steady: bool = False  # its step here is as wide as the one before
    came: float | None = None  # its step here was queued then (None: away)
    left: float | None = None  # its last step here finished then
    away: float | None = None  # seconds it was away last time
    cohort: int | None = None  # the batch its last step ran in here
    depth: float | None = None  # its last cycle over its time here (Arrivals.depth)
    led: bool = True  # its steps come from its client (not pushed on by the previous server)


class Arrivals:
    """Sessions' times here and away, which are due back soon, and which ran together last."""

    def __init__(self, gone: Callable[[Hashable], bool] = lambda key: False) -> None:
        self._gone = gone
        self._sessions: dict[Hashable, _Session] = {}
        self.last_arrival = float("-inf")

    def arrived(self, key: Hashable, now: float, rows: int = 1, width: int = 1, led: bool = True) -> None:
        """A step of ``key`` (``rows`` rows of ``width`` new positions) was queued; ``led``: from
        the session's client, not pushed on by the previous server of its chain (only those sessions
        are grouped here: :meth:`depth`, :meth:`rows`). Its cycle counts for :meth:`depth` only if
        the step before was as wide: a prefill and the decode step after it cost too differently
        (and a client may pause between them)."""
        session = self._sessions.setdefault(key, _Session())
        if session.left is not None:
            session.away = now - session.left
        session.steady = width == session.width and session.left is not None
        session.rows, session.width, session.came, session.led = rows, width, now, led
        self.last_arrival = now

    def finished(self, key: Hashable, now: float, batch: int | None = None) -> None:
        """``key``'s step is done here (it ran in ``batch``): it is away until its next."""
        session = self._sessions.setdefault(key, _Session())
        if session.came is not None and session.steady and now > session.came:
            session.depth = (now - session.left) / (now - session.came)
        session.came, session.left, session.cohort = None, now, batch

    def _active(self, now: float) -> dict[Hashable, _Session]:
        """The sessions here or still expected back (the others forgotten)."""
        for key, session in list(self._sessions.items()):
            stale = session.came is None and session.left is not None and now - session.left > FORGET_AFTER
            if stale or self._gone(key):
                del self._sessions[key]
        return self._sessions

    def _away(self, now: float, cohort: int | None) -> list[_Session]:
        return [s for s in self._active(now).values() if s.came is None and cohort in (None, s.cohort)]

    def rows(self, now: float) -> int:
        """Rows of the sessions this server leads now (their steps come from their clients): here,
        or away and expected back."""
        return sum(s.rows for s in self._active(now).values() if s.led)

    def cohort_of(self, key: Hashable) -> int | None:
        """The batch ``key``'s last step ran in here (None: none yet)."""
        session = self._sessions.get(key)
        return None if session is None else session.cohort

    def cohorts(self, now: float) -> int:
        """How many batches the sessions' last steps here ran in (the groups they run in now; a
        session yet to finish a step here is in none)."""
        return len({s.cohort for s in self._active(now).values() if s.cohort is not None})

    def depth(self, now: float) -> float | None:
        """How deep the chains of the sessions this server leads are, in its steps (the module
        docstring): the median over them of their last cycle (from one step's end here to the
        next's, of like steps) over that next step's time here (queued to done); None until one
        has one."""
        depths = [s.depth for s in self._active(now).values() if s.depth is not None and s.led]
        return statistics.median(depths) if depths else None

    def bursting(self, now: float, gap: float, cohort: int | None = None) -> bool:
        """Whether steps are coming in a burst: one came less than ``gap`` ago while other sessions
        (of ``cohort``) are away (and may be in it). Covers what :meth:`due` cannot predict:
        sessions that never came back yet (a client's first decode steps after its prefills), or
        whose last time away says nothing of this one (a pause)."""
        return now - self.last_arrival < gap and bool(self._away(now, cohort))

    def due(self, now: float, within: float, cohort: int | None = None) -> int:
        """How many away sessions (of ``cohort``) are expected back within ``within`` seconds of
        ``now`` (one a little late counts: it is about to come; one later than ``within`` does
        not). A session not yet seen coming back is expected to stay away as long as the others do
        (the median)."""
        known = sorted(s.away for s in self._active(now).values() if s.away is not None)
        typical = known[len(known) // 2] if known else None
        count = 0
        for session in self._away(now, cohort):
            away = session.away if session.away is not None else typical
            if away is not None and session.left is not None and abs(session.left + away - now) <= within:
                count += 1
        return count


def choose_groups(depth: float, rows: int, cost: Callable[[int], float], current: int = 1) -> int:
    """How many groups to split ``rows`` rows into, in chains ``depth`` of this server's steps deep
    (:meth:`Arrivals.depth`), where a batch of ``n`` rows costs ``cost(n)`` seconds: the fewest
    groups for the quickest round. A round of ``g`` groups of ``n`` rows takes ``g * cost(n)`` here
    (this server the bottleneck) or ``depth * cost(n)`` along the chain, whichever is longer: more
    groups than the depth only add batches. ``current`` stays unless another is
    :data:`REGROUP_GAIN` quicker (sessions regroup at every change, and a depth measured in one
    grouping only estimates another's)."""

    def round_time(groups: int) -> float:
        return max(groups, depth) * cost(-(-rows // groups))

    candidates = range(1, max(1, min(rows, math.ceil(depth))) + 1)
    best = min(candidates, key=round_time)
    if current in candidates and round_time(best) > REGROUP_GAIN * round_time(current):
        return current
    return best


__all__ = ["Arrivals", "BatchCosts", "choose_groups"]
