"""Which servers of a swarm answer: admission before trust, and dead servers found within a period.

A server record is signed by its own key and says nothing about whether anyone can reach it. So a
peer checks for itself (sans I/O here; :class:`~shoal.swarm.service.SwarmService` sends the probes,
a ``ping`` on the swarm protocol):

* **admission**: a server record counts (routable, an auditor, a judge, a voter) only once this
  peer has reached its server at the addresses the record gives; until then it is ``unprobed``;
* **watching**: every peer probes, each round, the ``watchers`` servers after it in the ring of
  server peer ids, so every server has that many watchers whatever the swarm's size, at O(1)
  probes per peer per round;
* **reports**: a peer whose probe fails marks the server unreachable and tells its gossip peers
  (op ``suspect``; a client that finds a listed server silent does too). A report from a server this
  peer has itself reached marks the accused unreachable at once, until this peer's own probe, sent
  straight away, says otherwise; anyone else's report only makes this peer probe. Either way a live
  server answers the probe and keeps its place: no report evicts it, and a reporter once found
  wrong is only ever a reason to look again.

A failed probe holds for the record version it was made against: a server that comes back signs a
newer record (at its next refresh), which is probed afresh. Unreachable servers are re-probed every
``recheck`` seconds too, so one that only missed a probe is back within that.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shoal.swarm.records import ServerRecord, State

WATCHERS = 2  # ring successors each peer probes every round
MAX_PROBES = 16  # probes a peer starts per round at most (admission of a big table spreads over rounds)
RECHECK_S = 30.0  # an unreachable server is probed again after this long
PROBE_TIMEOUT_S = 2.0  # a live server answers a ping within this, however busy its compute is
MAX_REPORTED = 64  # peers one suspect report may name
REPROBE_GAP_S = 1.0  # a reported peer probed this recently is not probed again for the report


class Reach(enum.Enum):
    UNPROBED = "unprobed"  # not reached yet at the record's addresses: not counted
    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"  # a probe failed (or an admitted server said so, until our own probe)


@dataclass(frozen=True)
class Probe:
    """What a probe found: at which addresses, against which record version, when."""

    addrs: tuple[str, ...]
    timestamp: float  # the record's
    ok: bool
    at: float  # when (the caller's clock)
    hearsay: str = ""  # the admitted server whose report this is, not yet checked by our own probe


@dataclass
class Liveness:
    """One peer's reachability view of the server records it holds (``self_id``: its own peer id,
    never probed)."""

    self_id: str
    watchers: int = WATCHERS
    max_probes: int = MAX_PROBES
    recheck: float = RECHECK_S
    probes: dict[str, Probe] = field(default_factory=dict)
    discredited: set[str] = field(default_factory=set)  # reporters whose word a probe contradicted
    _suspects: dict[str, None] = field(default_factory=dict)  # reported, to probe first (ordered)
    _in_flight: set[str] = field(default_factory=set)

    def reach(self, record: ServerRecord) -> Reach:
        probe = self.probes.get(record.peer)
        if record.peer == self.self_id:
            return Reach.REACHABLE
        if probe is None:
            return Reach.UNPROBED
        if not probe.ok and record.timestamp <= probe.timestamp:
            return Reach.UNREACHABLE
        if probe.ok and set(probe.addrs) & set(record.addrs):
            return Reach.REACHABLE
        return Reach.UNPROBED  # a newer record after a failure, or new addresses: probe again

    def watched(self, servers: Sequence[ServerRecord]) -> list[str]:
        """The ``watchers`` online servers after this peer in the ring of peer ids (unreachable
        ones skipped: the next live one is watched instead)."""
        ring = sorted({r.peer for r in servers if r.state is not State.OFFLINE and r.peer != self.self_id})
        live = [p for p in ring if not self._failed(p)]
        after = [p for p in live if p > self.self_id] + [p for p in live if p < self.self_id]
        return after[: self.watchers]

    def due(self, servers: Sequence[ServerRecord], now: float) -> list[str]:
        """Peers to probe now, most urgent first, at most ``max_probes``: ones an admitted server
        said are gone (to check its word), reported ones not probed in the last ``REPROBE_GAP_S``
        (reports cannot make a peer ping a live server over and over), the watched ring
        successors, records not yet reached (admission), unreachable ones due a re-check."""
        records = {r.peer: r for r in servers if r.peer != self.self_id and r.state is not State.OFFLINE}
        order: dict[str, None] = {}
        for peer, record in records.items():
            if self.reach(record) is Reach.UNREACHABLE and self.probes[peer].hearsay:
                order[peer] = None
        for peer in self._suspects:
            last = self.probes.get(peer)
            if peer in records and (last is None or now - last.at >= REPROBE_GAP_S):
                order[peer] = None
        for peer in self.watched(list(records.values())):
            order[peer] = None
        for peer, record in records.items():
            state = self.reach(record)
            if state is Reach.UNPROBED or (state is Reach.UNREACHABLE and now - self.probes[peer].at >= self.recheck):
                order[peer] = None
        chosen = [p for p in order if p not in self._in_flight][: self.max_probes]
        self._in_flight.update(chosen)
        for peer in chosen:
            self._suspects.pop(peer, None)
        return chosen

    def probed(self, record: ServerRecord, ok: bool, now: float) -> bool:
        """Record a probe of ``record``'s server; True when it newly found the server unreachable
        (worth telling the others)."""
        self._in_flight.discard(record.peer)
        before = self.probes.get(record.peer)
        newly = not ok and (before is None or before.ok or bool(before.hearsay))
        if ok and before is not None and before.hearsay:
            self.discredited.add(before.hearsay)
        self.probes[record.peer] = Probe(tuple(record.addrs), record.timestamp, ok, now)
        return newly

    def reported(
        self, peers: Iterable[str], reporter: str, admitted: bool, records: dict[str, ServerRecord], now: float
    ) -> None:
        """``reporter`` says ``peers`` did not answer it. ``admitted``: it is a server this peer has
        reached; unless a probe proved it wrong before, its word marks them unreachable until our
        own probe. Either way they are probed next."""
        trusted = admitted and reporter not in self.discredited
        for peer in list(peers)[:MAX_REPORTED]:
            record = records.get(peer)
            if record is None or peer in (self.self_id, reporter):
                continue
            self._suspects[peer] = None
            held = self.probes.get(peer)
            if trusted and (held is None or held.ok):
                self.probes[peer] = Probe(tuple(record.addrs), record.timestamp, False, now, hearsay=reporter)

    def forget(self, peers: Iterable[str]) -> None:
        """Records that left the table: nothing more to know about them."""
        for peer in peers:
            self.probes.pop(peer, None)
            self._suspects.pop(peer, None)

    def _failed(self, peer: str) -> bool:
        probe = self.probes.get(peer)
        return probe is not None and not probe.ok


__all__ = ["MAX_REPORTED", "PROBE_TIMEOUT_S", "Liveness", "Probe", "Reach"]
