"""Which sessions a server admits, and what of its KV budget each may keep.

A peer may hold at most ``max_sessions_per_peer`` sessions, and sessions of at most
``max_unstepped_rows_per_peer`` rows it never stepped; a session commits the pages of its
``max_length`` at ``open`` (:class:`~shoal.server.budget.CacheBudget`). The part of a commitment past
a session's positions is a reservation that gives way: when an ``open`` or a step finds the budget
spent, unused reservations are taken back one at a time until it fits: first those of other peers'
sessions that never stepped (oldest first), then those of sessions idle for ``reclaim_idle_after``
(least recently active first). So sessions opened for all the free cache and never used hold nothing
another peer needs, while sessions that step keep the promise of their ``max_length``, and a burst
of one peer's opens (a gateway's) is admitted up to the budget and told "busy" past it, before any
of them has stepped.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping

from shoal.errors import BusyError
from shoal.ids import PeerId, SessionId
from shoal.limits import Limits, count_down, flag_of
from shoal.server.budget import CacheBudget
from shoal.server.session import ServedSession
from shoal.wire.schema import ServerCounters


class Admission:
    """The per-peer counts and the budget's commitments of the sessions in ``sessions`` (the
    handler's own table, read here, never changed)."""

    def __init__(
        self, budget: CacheBudget, limits: Limits, counters: ServerCounters, sessions: Mapping[SessionId, ServedSession]
    ):
        self.budget, self.limits, self.counters, self._sessions = budget, limits, counters, sessions
        self._open: Counter[PeerId] = Counter()  # open sessions, per peer
        self._unstepped_rows: Counter[PeerId] = Counter()  # rows of open sessions that never stepped

    def admit(self, peer: PeerId, batch_size: int, max_length: int) -> int:
        """Count a new session of ``peer`` and commit its pages (returned), or raise :class:`BusyError`
        naming the limit it hit. Undo with :meth:`cancel` if the open then fails."""
        try:
            opened, most = self._open[peer], self.limits.max_sessions_per_peer
            if opened >= most:
                raise BusyError(f"peer already has {opened} open sessions (limit {most})")
            unstepped, most = self._unstepped_rows[peer], self.limits.max_unstepped_rows_per_peer
            if unstepped + batch_size > most:
                raise BusyError(
                    f"peer has sessions of {unstepped} rows it never stepped here; {batch_size} more would pass the "
                    f"limit of {most} ({flag_of('max_unstepped_rows_per_peer')}): step or close them first"
                )
            self.budget.check_fits(batch_size, max_length)
            pages = self.committed(lambda: self.budget.reserve(batch_size, max_length), peer)
        except BusyError:
            self.counters.sessions_rejected_busy += 1
            raise
        self._open[peer] += 1  # counted before the open's awaits: concurrent opens see it
        self._unstepped_rows[peer] += batch_size
        return pages

    def cancel(self, peer: PeerId, batch_size: int, pages: int) -> None:
        """An admitted open that failed before its session existed."""
        self.budget.release(pages)
        count_down(self._open, peer, 1)
        count_down(self._unstepped_rows, peer, batch_size)

    def step(self, session: ServedSession, end: int) -> None:
        """``session`` steps to ``end`` positions: its pages, committed again if its reservation was
        taken back (or :class:`BusyError`); it no longer counts as never stepped."""
        grow = lambda: self.budget.grow(session.pages, session.batch_size, end)  # noqa: E731
        session.pages = self.committed(grow, session.peer_id, session)
        if not session.stepped:
            session.stepped = True
            count_down(self._unstepped_rows, session.peer_id, session.batch_size)

    def release(self, session: ServedSession) -> None:
        """``session`` ended: its count and its commitment go back."""
        if not session.stepped:
            count_down(self._unstepped_rows, session.peer_id, session.batch_size)
        count_down(self._open, session.peer_id, 1)
        self.budget.release(session.pages)

    def committed(self, commit: Callable[[], int], peer: PeerId, needy: ServedSession | None = None) -> int:
        """``commit()`` (a budget call for ``peer``, raising :class:`BusyError` when the pages are not
        free); while they are not, other sessions' unused reservations are taken back, one at a time."""
        while True:
            try:
                return commit()
            except BusyError:
                session = self._unused_reservation(peer, needy)
                if session is None:
                    raise
                session.pages = self.budget.shrink(session.pages, session.batch_size, session.cache.length)
                self.counters.reservations_taken_back += 1

    def _unused_reservation(self, peer: PeerId, needy: ServedSession | None) -> ServedSession | None:
        now, idle = asyncio.get_running_loop().time(), self.limits.reclaim_idle_after
        candidates = [
            s for s in self._sessions.values()
            if s is not needy and s.cache is not None and not s.lock.locked()
            and s.pages > self.budget.pages_for(s.batch_size, s.cache.length)
            and ((not s.stepped and s.peer_id != peer) or now - s.last_active >= idle)
        ]  # fmt: skip
        return min(candidates, key=lambda s: (s.stepped or s.peer_id == peer, s.last_active), default=None)


__all__ = ["Admission"]
