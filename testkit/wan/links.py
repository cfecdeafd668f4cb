"""One direction of an emulated link: its conditions (:class:`LinkConditions`), the state that
applies them to each datagram (:class:`Pipe`) and its counters (:class:`DirectionStats`)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkConditions:
    """What one direction of a link does to each datagram.

    ``rtt_ms`` is the round trip of the link: each direction delays by half. ``jitter_ms`` varies
    each datagram's one-way delay uniformly within +-jitter (never below zero, never overtaking the
    datagram ahead). ``loss`` is each datagram's drop probability. ``bandwidth_mbit`` (None:
    unlimited) serialises UDP payload bytes at that rate behind a drop-tail buffer of
    ``queue_bytes``, as a bottleneck router would."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    bandwidth_mbit: float | None = None
    queue_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0:
            raise ValueError("rtt_ms and jitter_ms must be >= 0")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError("loss must be within [0, 1]")
        if self.bandwidth_mbit is not None and self.bandwidth_mbit <= 0:
            raise ValueError("bandwidth_mbit must be > 0 (None: unlimited)")
        if self.queue_bytes < 0:
            raise ValueError("queue_bytes must be >= 0")


@dataclass
class DirectionStats:
    """Counters of one direction (UDP payload bytes). ``dropped`` counts loss and queue overflow
    (``overflow_datagrams`` of them by the full queue) and datagrams the kernel refused to send."""

    forwarded_datagrams: int = 0
    forwarded_bytes: int = 0
    dropped_datagrams: int = 0
    dropped_bytes: int = 0
    overflow_datagrams: int = 0

    @property
    def total_bytes(self) -> int:
        return self.forwarded_bytes + self.dropped_bytes

    def add(self, other: DirectionStats) -> None:
        self.forwarded_datagrams += other.forwarded_datagrams
        self.forwarded_bytes += other.forwarded_bytes
        self.dropped_datagrams += other.dropped_datagrams
        self.dropped_bytes += other.dropped_bytes
        self.overflow_datagrams += other.overflow_datagrams


@dataclass
class Lateness:
    """How late forwarded datagrams left against their due times (seconds): the emulator's own
    error, e.g. its thread waiting for the GIL in a busy process."""

    datagrams: int = 0
    total: float = 0.0
    worst: float = 0.0
    over_1ms: int = 0
    over_5ms: int = 0
    over_20ms: int = 0

    def note(self, late: float) -> None:
        self.datagrams += 1
        self.total += late
        self.worst = max(self.worst, late)
        self.over_1ms += late > 0.001
        self.over_5ms += late > 0.005
        self.over_20ms += late > 0.020

    def summary(self) -> dict[str, float]:
        """The figures in milliseconds and shares, rounded for a report."""
        n = max(self.datagrams, 1)
        return {
            "datagrams": self.datagrams,
            "mean_ms": round(1000 * self.total / n, 3),
            "max_ms": round(1000 * self.worst, 2),
            "over_1ms": round(self.over_1ms / n, 5),
            "over_5ms": round(self.over_5ms / n, 5),
            "over_20ms": round(self.over_20ms / n, 5),
        }


class Pipe:
    """One direction of a link: its conditions, its bottleneck and FIFO state, its counters."""

    __slots__ = ("conditions", "last_due", "rng", "stats", "tx_free_at")

    def __init__(self, conditions: LinkConditions, rng: random.Random):
        self.conditions = conditions
        self.rng = rng
        self.stats = DirectionStats()
        self.tx_free_at = 0.0  # when the bottleneck finishes serialising what it holds
        self.last_due = 0.0  # the delivery time of the datagram admitted last (FIFO)

    def admit(self, now: float, size: int) -> float | None:
        """When a datagram received at ``now`` is delivered, or None if it is dropped."""
        c = self.conditions
        if c.loss and (c.loss >= 1.0 or self.rng.random() < c.loss):
            self.drop(size)
            return None
        departs = now
        if c.bandwidth_mbit is not None:
            rate = c.bandwidth_mbit * 125_000.0  # bytes per second
            starts = max(now, self.tx_free_at)
            backlog = (starts - now) * rate  # bytes still ahead of this one in the buffer
            if backlog > 0 and backlog + size > c.queue_bytes:
                self.drop(size)
                self.stats.overflow_datagrams += 1
                return None
            departs = self.tx_free_at = starts + size / rate
        delay = c.rtt_ms / 2000.0
        if c.jitter_ms:
            delay = max(0.0, delay + self.rng.uniform(-c.jitter_ms, c.jitter_ms) / 1000.0)
        due = self.last_due = max(departs + delay, self.last_due)
        return due

    def drop(self, size: int) -> None:
        self.stats.dropped_datagrams += 1
        self.stats.dropped_bytes += size


__all__ = ["DirectionStats", "Lateness", "LinkConditions", "Pipe"]
