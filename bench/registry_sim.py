"""The simulated network of :mod:`bench.registry`: a virtual clock and event queue, one-way delays,
the peers (:mod:`bench.registry_peer`) joining, leaving and crashing, and the watches that time
how long a record takes to reach every peer."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from bench.registry_peer import MODEL, Meter, SimConfig, SimPeer
from bench.sim_clock import SimClock
from shoal.swarm.gossip import Outgoing
from shoal.swarm.messages import Payload, encode_payload
from shoal.swarm.records import SignedRecord


class Sim(SimClock):
    """The event loop, the peers, and the probes that time convergence."""

    def __init__(self, config: SimConfig):
        super().__init__(config)
        self.meter = Meter(config.overhead)
        self.failed_calls = 0
        self.signed_records: list[tuple[float, int]] = []  # (virtual time, bytes) of server records signed
        self.model_fps = tuple(self.rng.randbytes(32) for _ in range(config.num_blocks))
        self.peers: list[SimPeer] = []
        self.by_id: dict[str, SimPeer] = {}
        self._by_start: dict[int, list[SimPeer]] = {}

    def later(self, dt: float, done: Callable[[], None] | None) -> None:
        if done is not None:
            self.after(dt, done)

    # ---- peers --------------------------------------------------------------------------------
    def new_peer(self) -> SimPeer:
        lo, hi = self.config.span
        length = self.rng.randint(lo, hi)
        start = self.rng.randrange(self.config.num_blocks - length + 1)
        peer = SimPeer(self, len(self.peers), start, start + length)
        self.peers.append(peer)
        self.by_id[peer.id] = peer
        self._by_start.setdefault(start, []).append(peer)
        return peer

    def next_span_peers(self, peer: SimPeer, now: float) -> list[str]:
        """``Announcement.measure_next_rtts``: up to 8 servers (in the peer's table, else by
        construction) whose span starts where the peer's ends."""
        if len(peer.table):
            found = [r.peer for r in peer.table.servers(MODEL) if r.start == peer.end and r.peer != peer.id]
        else:
            found = [p.id for p in self._by_start.get(peer.end, []) if p is not peer]
        return found[:8]

    def populate(self, n: int) -> None:
        """``n`` peers in steady state: every table holds every record, each signed at a random
        moment of the last refresh period (so refreshes are spread evenly)."""
        peers = [self.new_peer() for _ in range(n)]
        refresh = self.config.gossip.refresh
        now = self.clock()
        model = peers[0].model_record(now - self.rng.uniform(0, refresh))
        records = [model] + [p.server_record(now - self.rng.uniform(0, refresh)) for p in peers]
        self.signed_records.clear()
        for peer in peers:
            for signed in records:
                if not peer.table.merge(signed):
                    raise AssertionError(f"populate: {signed.key} rejected: {dict(peer.table.rejected)}")
        for peer in peers:
            peer.begin(self.rng.uniform(0, self.config.gossip.period))

    def alive(self) -> list[SimPeer]:
        return [p for p in self.peers if p.alive]

    def pick(self, exclude: Iterable[SimPeer] = ()) -> SimPeer:
        """A random running peer, not the model record's publisher."""
        excluded = {p.id for p in exclude}
        model = self.peers[0].table.get(f"m:{MODEL}")
        if model is not None:
            excluded.add(model.record.signer)  # its leaving is another story (the model record lapses)
        return self.rng.choice([p for p in self.peers if p.alive and p.running and p.id not in excluded])

    def join(self, bootstrap: int = 2) -> Joining:
        """A new server joins through ``bootstrap`` random peers, then publishes its record."""
        joining = Joining(self, self.new_peer(), self.rng.sample([p for p in self.peers if p.running], bootstrap))
        joining.peer.join(joining.bootstrap, joining.synced)
        return joining

    def leave(self, peer: SimPeer) -> tuple[SignedRecord, Watch]:
        """``peer`` leaves cleanly; the watch times its offline record reaching every other peer."""
        others = [p for p in self.alive() if p is not peer]
        offline = peer.leave()
        return offline, self.watch(holds(offline.key, offline.timestamp), others)

    def crash(self, peer: SimPeer) -> Watch:
        """``peer`` stops answering; the watch times its record leaving every table."""
        peer.crash()
        return self.watch(lacks(f"s:{peer.id}"), self.alive(), every=0.1)

    def inject(self, peer: SimPeer, op: str, request: Payload) -> None:
        """A request from outside the swarm (a forger, say) delivered to ``peer``; the reply is dropped."""
        payload = encode_payload(request)
        self.meter.count(op, len(payload))
        self.after(self.latency(), peer._serve, None, Outgoing(peer.id, op, payload), 0, None)

    # ---- probes -------------------------------------------------------------------------------
    def watch(self, until: Callable[[SimPeer], bool], peers: list[SimPeer], every: float = 0.01) -> Watch:
        watch = Watch(self, until, peers, every)
        watch.probe()
        return watch


class Watch:
    """Time from now until ``until(peer)`` holds for every peer of ``peers`` that is still alive
    (probed every ``every`` s)."""

    def __init__(self, sim: Sim, until: Callable[[SimPeer], bool], peers: list[SimPeer], every: float):
        self.sim, self.until, self.every = sim, until, every
        self.begun = sim.now
        self.left = list(peers)
        self.seconds: float | None = None

    @property
    def done(self) -> bool:
        return self.seconds is not None

    def probe(self) -> None:
        self.left = [p for p in self.left if p.alive and not self.until(p)]
        if not self.left:
            self.seconds = self.sim.now - self.begun
        else:
            self.sim.after(self.every, self.probe)


class Joining:
    """A join in progress: bootstrap syncs, then the record's publication (``watch`` from then on)."""

    def __init__(self, sim: Sim, peer: SimPeer, bootstrap: list[SimPeer]):
        self.sim, self.peer, self.bootstrap = sim, peer, bootstrap
        self.begun = sim.now
        self.sync_bytes: tuple[int, int] | None = None  # (sent, received) by the joiner in its bootstrap syncs
        self.record: SignedRecord | None = None
        self.watch: Watch | None = None

    @property
    def done(self) -> bool:
        return self.watch is not None and self.watch.done

    def synced(self) -> None:
        sim, peer = self.sim, self.peer
        self.sync_bytes = (peer.sent, peer.received)
        peer.begin(sim.config.gossip.period * peer.rng.uniform(0.8, 1.2))
        self.record = peer.server_record(sim.clock())
        self.watch = sim.watch(holds(self.record.key, self.record.timestamp), sim.alive())
        peer.publish(self.record)


def holds(key: str, timestamp: float) -> Callable[[SimPeer], bool]:
    def check(peer: SimPeer) -> bool:
        held = peer.table.get(key)
        return held is not None and held.timestamp >= timestamp

    return check


def lacks(key: str) -> Callable[[SimPeer], bool]:
    return lambda peer: peer.table.get(key) is None
