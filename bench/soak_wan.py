"""The soak's wide-area network: every process of :mod:`bench.soak` behind :mod:`testkit.wan`.

Each server is started announcing its own proxy (``shoal serve --announce-addr``, the proxy reserved
first), so every ticket it prints and every swarm record it gossips is the proxy's; its process is
attached (found and sealed by pid) while it starts. The gateway and the driver's own short-lived
nodes (who serves what) are registered likewise; nobody is ever dialled at a real socket. Each link
(a pair of nodes) gets a round trip drawn from ``rtt_ms`` (seeded by the pair's names, the same both
ways), ``jitter_ms`` of jitter and ``loss`` per datagram each way.

The emulator runs in a process of its own (:class:`~testkit.wan.RemoteEmulator`): in the driver's,
its thread waited for the GIL behind the driver's threads (HTTP streams, server starts, the chaos
schedule), and a 1-minute run measured deliveries 7.9 ms late on average, 9% of them over 20 ms.
Sealing stays in the driver, the servers' parent. :meth:`SoakWan.report` says how late deliveries
left.
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass

from testkit.wan import LinkConditions, RemoteEmulator
from testkit.wan.emulator import WanNode


@dataclass(frozen=True)
class WanPlan:
    """The links of the soak: round trips drawn uniformly from ``rtt_ms`` (low, high), +- ``jitter_ms``,
    ``loss`` per datagram; ``seed`` draws the round trips and seeds the emulator's loss and jitter."""

    rtt_ms: tuple[float, float] = (20.0, 80.0)
    jitter_ms: float = 5.0
    loss: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        low, high = self.rtt_ms
        if not 0 <= low <= high:
            raise ValueError(f"--rtt-ms is LOW,HIGH with 0 <= LOW <= HIGH, got {self.rtt_ms}")
        LinkConditions(rtt_ms=high, jitter_ms=self.jitter_ms, loss=self.loss)  # the rest checked there

    def conditions(self, a: str, b: str) -> LinkConditions:
        """The link between ``a`` and ``b`` (either way round)."""
        pair = "/".join(sorted((a, b)))
        rtt = random.Random(f"{self.seed}/{pair}").uniform(*self.rtt_ms)
        return LinkConditions(rtt_ms=round(rtt, 1), jitter_ms=self.jitter_ms, loss=self.loss)


def parse_rtt(text: str) -> tuple[float, float]:
    """``--rtt-ms``: ``LOW,HIGH`` (or one value for both)."""
    values = [float(v) for v in text.split(",")]
    if len(values) == 1:
        values *= 2
    if len(values) != 2:
        raise ValueError(text)
    return values[0], values[1]


parse_rtt.__name__ = "LOW,HIGH milliseconds"


class SoakWan:
    """The emulator of one soak and the names of the nodes behind it."""

    def __init__(self, plan: WanPlan):
        self.plan = plan
        self.emulator = RemoteEmulator(seed=plan.seed, conditions=plan.conditions)
        self._probes = itertools.count()

    def reserve(self, name: str) -> str:
        """``name``'s proxy, as ``IP:PORT`` for ``--announce-addr``."""
        host, port = self.emulator.reserve(name)
        return f"{host}:{port}"

    def attach(self, name: str, pid: int, timeout: float) -> WanNode:
        """The node of child process ``pid``, found and sealed as it binds (see :meth:`RemoteEmulator.attach`)."""
        return self.emulator.attach(name, pid, timeout=timeout)

    def remove(self, name: str) -> None:
        """``name``'s process has ended: its proxy closes (nothing of a dead node is forwarded)."""
        self.emulator.remove(name)

    def register_here(self, ticket) -> str:
        """A node of this process (its own ticket): registered and sealed; the name to remove."""
        name = f"driver-{next(self._probes)}"
        self.emulator.add_node(ticket, name, pid=os.getpid())
        return name

    def report(self) -> dict:
        """What the links did: datagrams forwarded and dropped, strays, and how late deliveries left."""
        totals = self.emulator.totals()
        return {
            "rtt_ms": list(self.plan.rtt_ms),
            "jitter_ms": self.plan.jitter_ms,
            "loss": self.plan.loss,
            "forwarded_datagrams": totals.forwarded_datagrams,
            "dropped_datagrams": totals.dropped_datagrams,
            "stray_datagrams": self.emulator.stray_datagrams,
            "lateness": self.emulator.lateness().summary(),
        }

    def close(self) -> None:
        self.emulator.close()


__all__ = ["SoakWan", "WanPlan", "parse_rtt"]
