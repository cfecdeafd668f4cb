"""The sampled registry simulation's model (:mod:`bench.registry_scale` runs it and says what it
is): every peer, one shared version map for what every peer holds, per-peer entries only for
versions still spreading, real record tables at a few observers, and the swarm protocol's message
sizes as :mod:`shoal.swarm.messages` encodes them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench.registry_peer import MODEL, RELAY, SWARM, SimConfig
from bench.sim_clock import SimClock
from shoal import __version__
from shoal.ids import BlockRange
from shoal.swarm.messages import ENTRY, ID_BYTES
from shoal.swarm.records import ModelRecord, ServerRecord, SignedRecord, State, sign
from shoal.swarm.table import RecordTable


def bin_size(n: int) -> int:
    """msgpack bytes of a bin of ``n`` bytes."""
    return n + (2 if n < 1 << 8 else 3 if n < 1 << 16 else 5)


def array_header(n: int) -> int:
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


def digest_payload(entries: int) -> int:
    """``OfferRequest``/``SyncRequest`` of ``entries`` packed entries."""
    return 1 + 7 + bin_size(entries * ENTRY.size)


def wanted_payload(ids: int) -> int:
    """``OfferReply`` of ``ids`` key ids."""
    return 1 if ids == 0 else 1 + 7 + bin_size(ids * ID_BYTES)


def records_payload(sizes: list[int]) -> int:
    """``PushRequest`` of records of ``sizes`` bytes."""
    return 1 + (8 + array_header(len(sizes)) + sum(bin_size(s) for s in sizes) if sizes else 0)


PUSH_HEADER = records_payload([0]) - bin_size(0)  # a push's bytes besides its records


def sync_reply_payload(sizes: list[int], ids: int) -> int:
    records = 8 + array_header(len(sizes)) + sum(bin_size(s) for s in sizes) if sizes else 0
    return 1 + records + (7 + bin_size(ids * ID_BYTES) if ids else 0)


class Peer:
    """A simulated server: its key, span, liveness, and what it holds of the versions spreading."""

    __slots__ = ("alive", "batch", "held", "id", "index", "news", "observer", "phase", "rounds", "running", "secret")
    __slots__ += ("signed", "start", "end")

    def __init__(self, index: int, secret: bytes, start: int, end: int):
        self.index, self.secret, self.start, self.end = index, secret, start, end
        self.id = Ed25519PrivateKey.from_private_bytes(secret).public_key().public_bytes_raw().hex()
        self.alive = self.running = False
        self.held: dict[str, float] = {}  # versions still spreading that this peer holds
        self.news: dict[str, float] = {}  # learned since its last offer batch
        self.batch = False  # an offer batch is due
        self.observer: RecordTable | None = None
        self.signed: SignedRecord | None = None
        self.rounds = 0
        self.phase = 0.0


class Spread:
    """One version on its way to every peer, and what its spread cost (bytes, by part)."""

    __slots__ = ("begun", "bytes", "done", "holders", "key", "signed", "timestamp", "tracked_for_bytes")

    def __init__(self, signed: SignedRecord, begun: float, for_bytes: bool):
        self.signed, self.key, self.timestamp, self.begun = signed, signed.key, signed.timestamp, begun
        self.holders: set[int] = set()
        self.bytes: Counter[str] = Counter()
        self.done: float | None = None
        self.tracked_for_bytes = for_bytes


class ScaleSim(SimClock):
    """The event loop, the peers, the shared version map and the versions spreading."""

    def __init__(self, config: SimConfig, observers: int, sample_rate: float):
        super().__init__(config)
        self.g = config.gossip
        self.model_fps = tuple(self.rng.randbytes(32) for _ in range(config.num_blocks))
        self.peers: list[Peer] = []
        self.running: list[Peer] = []  # peers others may pick (running, or gone unseen)
        self.by_start: dict[int, list[Peer]] = {}
        self.base: dict[str, SignedRecord] = {}  # the version every peer holds, per key
        self.spreads: dict[str, Spread] = {}  # key -> the version spreading
        self.finished: list[Spread] = []
        self.n_observers, self.sample_rate, self.sampling = observers, sample_rate, False
        self.model_publisher: Peer | None = None
        self.signed_sizes: list[tuple[float, int]] = []  # (time, bytes) of server records signed
        self.failed_calls = 0
        self.crashed: Peer | None = None
        self.dropped: set[int] = set()  # peers whose table dropped the crashed peer's record
        self.crash_done: float | None = None
        self.envelopes: Counter[str] = Counter()  # framing and payload headers of non-sampled messages
        self.alive_count = 0
        self.observers: list[Peer] = []
        self.join_sync_bytes = (0, 0)  # (sent, received) by a joiner in its bootstrap syncs

    # ---- records --------------------------------------------------------------------------------
    def new_peer(self) -> Peer:
        lo, hi = self.config.span
        length = self.rng.randint(lo, hi)
        start = self.rng.randrange(self.config.num_blocks - length + 1)
        peer = Peer(len(self.peers), self.rng.randbytes(32), start, start + length)
        self.peers.append(peer)
        self.by_start.setdefault(start, []).append(peer)
        return peer

    def server_record(self, peer: Peer, now: float, state: State = State.ONLINE) -> SignedRecord:
        nxt = [p.id for p in self.by_start.get(peer.end, []) if p is not peer and p.running][:8]
        record = ServerRecord(
            swarm=SWARM, peer=peer.id, addrs=(f"198.51.{100 + peer.index // 250}.{peer.index % 250 + 1}:40000",
                                              f"[2001:db8::{peer.index:x}]:40000"),
            relay=RELAY, model=MODEL, blocks=BlockRange(peer.start, peer.end),
            fingerprints=self.model_fps[peer.start : peer.end], state=state,
            throughput=round(self.rng.uniform(1.0, 50.0), 2), cache_tokens_free=self.rng.randrange(1 << 20),
            rtts=tuple(sorted((p, round(self.rng.uniform(2.0, 150.0), 3)) for p in nxt)),
            version=__version__, timestamp=now, expires=now + self.g.expiry,
        )  # fmt: skip
        peer.signed = sign(record, peer.secret)
        self.signed_sizes.append((self.now, len(peer.signed.data)))
        return peer.signed

    def model_record(self, peer: Peer, now: float) -> SignedRecord:
        record = ModelRecord(SWARM, peer.id, MODEL, len(self.model_fps), self.model_fps, now, now + self.g.expiry)
        return sign(record, peer.secret)

    def holds(self, peer: Peer, key: str, timestamp: float) -> bool:
        held = peer.held.get(key)
        if held is None:
            base = self.base.get(key)
            return base is not None and base.timestamp >= timestamp
        return held >= timestamp

    def settle(self, signed: SignedRecord) -> None:
        """``signed`` is in every table: into the shared map (and every observer's table)."""
        self.base[signed.key] = signed
        for peer in self.observers:
            if peer.alive:
                self.observe(peer, signed)

    def observe(self, peer: Peer, signed: SignedRecord) -> None:
        table = peer.observer
        held = table.get(signed.key)
        if (held is None or held.timestamp < signed.timestamp) and not table.merge(signed):
            raise AssertionError(f"observer {peer.index} refused {signed.key}: {dict(table.rejected)}")

    # ---- a version spreading --------------------------------------------------------------------
    def publish(self, peer: Peer, signed: SignedRecord, for_bytes: bool = False) -> Spread:
        spread = Spread(signed, self.now, for_bytes)
        old = self.spreads.pop(signed.key, None)
        if old is not None:  # superseded while spreading: every holder of the old one holds it
            self._finish(old, settle=False)
        self.spreads[signed.key] = spread
        self.learn(peer, spread)
        return spread

    def learn(self, peer: Peer, spread: Spread) -> bool:
        if not peer.alive or self.spreads.get(spread.key) is not spread or peer.index in spread.holders:
            spread.bytes["duplicate_records"] += 1
            return False
        peer.held[spread.key] = spread.timestamp
        spread.holders.add(peer.index)
        if peer.observer is not None:
            self.observe(peer, spread.signed)
        if peer.running:
            peer.news[spread.key] = spread.timestamp
            if not peer.batch:
                peer.batch = True
                # the offers loop of a peer that hears news all the time: its next batch
                wait = self.g.push_delay - (self.now - peer.phase) % self.g.push_delay
                self.after(wait, self.offer_batch, peer)
        if len(spread.holders) >= self.alive_count and all(self.holds(p, spread.key, spread.timestamp) for p in
                                                           self.alive_peers()):  # fmt: skip
            self._finish(spread)
        return True

    def alive_peers(self) -> list[Peer]:
        return [p for p in self.peers if p.alive]

    def _finish(self, spread: Spread, settle: bool = True) -> None:
        spread.done = self.now
        if self.spreads.get(spread.key) is spread:
            del self.spreads[spread.key]
        for index in spread.holders:
            self.peers[index].held.pop(spread.key, None)
            self.peers[index].news.pop(spread.key, None)
        if settle:
            self.settle(spread.signed)
        self.finished.append(spread)

    # ---- whom to talk to --------------------------------------------------------------------------
    def pick(self, peer: Peer) -> Peer:
        """A random peer ``peer`` believes online (it may be gone unseen)."""
        while True:
            other = self.rng.choice(self.running)
            if other is peer:
                continue
            left = not other.running and other.signed is not None and other.signed.record.state is State.OFFLINE
            if left and self.holds(peer, other.signed.key, other.signed.timestamp):
                continue  # it knows the peer left
            if other is self.crashed and peer.index in self.dropped:
                continue
            return other

    def call(self, target: Peer, fn: Callable, *args) -> bool:
        if not target.alive:
            self.failed_calls += 1
            return False
        self.after(self.latency(), fn, *args)
        return True

    # ---- the offers loop --------------------------------------------------------------------------
    def offer_batch(self, peer: Peer) -> None:
        peer.batch = False
        if not peer.running or not peer.news:
            return
        news, peer.news = peer.news, {}
        spreads = [self.spreads[k] for k, ts in news.items() if k in self.spreads and self.spreads[k].timestamp == ts]
        for _ in range(self.g.fanout):
            target = self.pick(peer)
            for spread in spreads:
                spread.bytes["offer"] += ENTRY.size
            self.call(target, self.on_offer, peer, target, spreads)

    def on_offer(self, peer: Peer, target: Peer, spreads: list[Spread]) -> None:
        wanted = [s for s in spreads if not self.holds(target, s.key, s.timestamp)]
        for spread in wanted:
            spread.bytes["offer.reply"] += ID_BYTES
        if wanted:
            self.after(self.latency(), self.push, peer, target, wanted)

    def push(self, peer: Peer, target: Peer, spreads: list[Spread]) -> None:
        if not peer.alive:
            return
        for spread in spreads:
            spread.bytes["push"] += bin_size(len(spread.signed.data))
        self.call(target, self.on_push, target, spreads)

    def on_push(self, target: Peer, spreads: list[Spread]) -> None:
        for spread in spreads:
            self.learn(target, spread)

    # ---- rounds and syncs ------------------------------------------------------------------------
    def round(self, peer: Peer) -> None:
        if not peer.running:
            return
        now = self.clock()
        if self.crashed is not None and peer.index not in self.dropped and self.crashed.signed.record.expires <= now:
            self.dropped.add(peer.index)
            self._check_crash()
        if peer.observer is not None:
            peer.observer.expire()
        if now - peer.signed.timestamp >= self.g.refresh:
            self.refresh(peer, now)
        if peer is self.model_publisher and now - self.base[f"m:{MODEL}"].timestamp >= self.g.refresh:
            self.settle(self.model_record(peer, now))
        peer.rounds += 1
        if peer.rounds % self.g.sync_every == 0:
            self.sync(peer)
        self.after(self.g.period * self.rng.uniform(0.8, 1.2), self.round, peer)

    def refresh(self, peer: Peer, now: float) -> None:
        signed = self.server_record(peer, now)
        chance = self.sample_rate * self.g.refresh / max(1, len(self.running))
        if self.sampling and self.rng.random() < chance:
            self.publish(peer, signed, for_bytes=True)
        else:
            old = self.spreads.get(signed.key)
            if old is not None:
                self._finish(old, settle=False)
            self.settle(signed)

    def sync(self, peer: Peer) -> None:
        target = self.pick(peer)
        self.envelopes["sync"] += self.config.overhead + digest_payload(len(self.base) + 1)
        self.call(target, self.on_sync, peer, target)

    def on_sync(self, peer: Peer, target: Peer) -> None:
        if (
            self.crashed is not None
            and target.index not in self.dropped
            and self.crashed.signed.record.expires <= (self.clock())
        ):  # SwarmService.handle: expire before answering
            self.dropped.add(target.index)
            self._check_crash()
        theirs, mine = [], []
        for spread in list(self.spreads.values()):
            has_peer, has_target = peer.index in spread.holders, target.index in spread.holders
            if has_target and not has_peer:
                theirs.append(spread)
            elif has_peer and not has_target:
                mine.append(spread)
        for spread in theirs:
            spread.bytes["sync.reply"] += bin_size(len(spread.signed.data))
        for spread in mine:
            spread.bytes["sync.reply"] += ID_BYTES
        self.envelopes["sync.reply"] += self.config.overhead + sync_reply_payload([], 0)
        if theirs or mine:
            self.after(self.latency(), self.on_sync_reply, peer, target, theirs, mine)

    def on_sync_reply(self, peer: Peer, target: Peer, theirs: list[Spread], mine: list[Spread]) -> None:
        if not peer.alive:
            return
        for spread in theirs:
            self.learn(peer, spread)
        if mine:
            self.envelopes["push"] += self.config.overhead + PUSH_HEADER + self.config.overhead + 1
            self.push(peer, target, mine)

    def _check_crash(self) -> None:
        if self.crash_done is not None or len(self.dropped) < self.alive_count:
            return
        if all(p.index in self.dropped for p in self.alive_peers()):
            self.crash_done = self.now

    # ---- the swarm ---------------------------------------------------------------------------------
    def populate(self, n: int) -> None:
        peers = [self.new_peer() for _ in range(n)]
        for peer in peers:
            peer.alive = peer.running = True
        self.running = list(peers)
        self.alive_count = n
        refresh, now = self.g.refresh, self.clock()
        self.model_publisher = peers[0]
        records = [self.model_record(peers[0], now - self.rng.uniform(0, refresh))]
        records += [self.server_record(p, now - self.rng.uniform(0, refresh)) for p in peers]
        self.signed_sizes.clear()
        self.observers = self.rng.sample(peers[1:], min(self.n_observers, n - 1))
        for peer in self.observers:
            peer.observer = RecordTable(SWARM, clock=self.clock, max_lifetime=max(3600.0, 2 * self.g.expiry))
        for signed in records:
            self.settle(signed)
        for peer in peers:
            peer.phase = self.rng.uniform(0, self.g.push_delay)
            self.after(self.rng.uniform(0, self.g.period), self.round, peer)

    def join(self, bootstrap: int = 2) -> Spread:
        """A server joins: bootstrap syncs (whole tables), then its record spreads."""
        sources = self.rng.sample([p for p in self.running if p.running], bootstrap)
        peer = self.new_peer()
        peer.alive = True
        self.alive_count += 1
        table_bytes = records_payload([len(s.data) for s in self.base.values()])
        self.join_sync_bytes = (
            2 * (self.config.overhead + digest_payload(0)),
            2 * (self.config.overhead + table_bytes),
        )
        self.run_until(self.now + 2 * max(self.config.latency))  # the syncs' round trips
        for spread in list(self.spreads.values()):  # what the bootstrap peers hold of what spreads
            if any(p.index in spread.holders for p in sources):
                self.learn(peer, spread)
        peer.running = True
        self.running.append(peer)
        peer.phase = self.rng.uniform(0, self.g.push_delay)
        self.after(self.g.period * self.rng.uniform(0.8, 1.2), self.round, peer)
        return self.publish(peer, self.server_record(peer, self.clock()))

    def leave(self, peer: Peer) -> Spread:
        """``announce_to_all`` of the offline record: a push to every peer it knows, then it closes."""
        peer.running = False
        spread = self.publish(peer, self.server_record(peer, self.clock(), State.OFFLINE))
        size = self.config.overhead + records_payload([len(spread.signed.data)])
        for other in self.running:
            if other is not peer and (other.running or (other is self.crashed and peer.index not in self.dropped)):
                spread.bytes["push"] += size
                self.call(other, self.on_push, other, [spread])

        def close() -> None:
            peer.alive = False
            self.alive_count -= 1

        self.after(self.config.announce_timeout, close)
        return spread

    def crash(self, peer: Peer) -> None:
        peer.alive = peer.running = False
        self.alive_count -= 1
        self.crashed = peer

    def pick_leaver(self) -> Peer:
        return self.rng.choice([p for p in self.running if p.running and p is not self.model_publisher
                                and p.observer is None])  # fmt: skip


__all__ = [
    "PUSH_HEADER",
    "Peer",
    "ScaleSim",
    "Spread",
    "bin_size",
    "digest_payload",
    "records_payload",
    "sync_reply_payload",
    "wanted_payload",
]
