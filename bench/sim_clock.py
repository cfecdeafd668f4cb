"""The discrete-event clock both registry simulations (:mod:`bench.registry_sim`,
:mod:`bench.scale_sim`) run on: virtual time, an event queue in time order (ties in the order
scheduled), seeded randomness and one-way link delays."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable

from bench.registry_peer import EPOCH, SimConfig


class SimClock:
    """Virtual time from 0 (``EPOCH`` on the records' clock) and the events due at each moment."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self._queue: list = []
        self._seq = itertools.count()

    def clock(self) -> float:
        """Now, on the records' clock."""
        return EPOCH + self.now

    def latency(self) -> float:
        """One message's one-way delay, drawn from ``config.latency``."""
        return self.rng.uniform(*self.config.latency)

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run_until(self, t: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= t:
            self.now, _, fn, args = heapq.heappop(queue)
            fn(*args)
        self.now = max(self.now, t)

    def run_for(self, seconds: float) -> None:
        self.run_until(self.now + seconds)

    def run_while(self, busy: Callable[[], bool], limit: float, step: float = 0.5) -> None:
        """Run until ``busy()`` is false (checked every ``step`` s) or for ``limit`` s at most."""
        end = self.now + limit
        while busy() and self.now < end:
            self.run_until(min(end, self.now + step))


__all__ = ["SimClock"]
