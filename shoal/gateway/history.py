"""What the dashboard's chart draws: the last 10 minutes of 1-second samples of each server's load.

A sample holds, per server that answered ``info`` in time, its tokens/s (the positions its blocks
ran, sessions and stateless forwards together, since the previous sample, per second of the
server's replies) and its open sessions. The buffer is pure bookkeeping; the watcher
(:mod:`shoal.gateway.swarm`) takes the readings.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["LoadHistory", "Reading", "Sample", "ServerLoad"]

WINDOW_S = 600.0  # how far back the chart goes
INTERVAL_S = 1.0  # between samples


@dataclass(frozen=True)
class Reading:
    """One server's counters as its ``info`` reply gave them, and when (monotonic seconds)."""

    tokens_total: int  # positions run through its blocks since its span was loaded
    sessions_active: int
    at: float


@dataclass(frozen=True)
class ServerLoad:
    tokens_per_s: float | None  # None: no earlier reading to compare with (new, or its counters restarted)
    sessions_active: int

    def as_json(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "sessions_active": self.sessions_active}


@dataclass(frozen=True)
class Sample:
    t: float  # wall-clock time of the sample (seconds since the epoch)
    servers: dict[str, ServerLoad]  # peer id -> load

    def as_json(self) -> dict:
        return {"t": self.t, "servers": {peer: load.as_json() for peer, load in self.servers.items()}}


class LoadHistory:
    """A ring of samples, ``window_s / interval_s`` long."""

    def __init__(self, window_s: float = WINDOW_S, interval_s: float = INTERVAL_S):
        self.window_s = window_s
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=round(window_s / interval_s))
        self._previous: dict[str, Reading] = {}

    def add(self, t: float, readings: dict[str, Reading]) -> Sample:
        """Turn ``readings`` (peer id -> reading) into a sample at time ``t`` and keep it."""
        servers = {}
        for peer, reading in readings.items():
            before = self._previous.get(peer)
            rate = None
            if before is not None and reading.at > before.at and reading.tokens_total >= before.tokens_total:
                rate = round((reading.tokens_total - before.tokens_total) / (reading.at - before.at), 1)
            servers[peer] = ServerLoad(rate, reading.sessions_active)
        self._previous = dict(readings)  # a server missing from this sample starts afresh next time
        sample = Sample(round(t, 3), servers)
        self.samples.append(sample)
        return sample

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def since(self, t: float | None) -> list[Sample]:
        """The samples taken after ``t`` (all of them for None), oldest first."""
        return [s for s in self.samples if t is None or s.t > t]

    def as_json(self, since: float | None = None) -> dict:
        return {
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "samples": [s.as_json() for s in self.since(since)],
        }
