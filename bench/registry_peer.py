"""One simulated peer of :mod:`bench.registry`: its key and signed records, its own
:class:`RecordTable` and :class:`Gossiper` on the virtual clock, and its service loops, driven as
:class:`shoal.swarm.service.SwarmService` drives them; with the run's settings (:class:`SimConfig`)
and the byte meter."""

from __future__ import annotations

import contextlib
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal import __version__
from shoal.ids import BlockRange
from shoal.swarm import gossip as gossip_module
from shoal.swarm.gossip import GossipConfig, Gossiper, Outgoing
from shoal.swarm.messages import PushRequest, encode_payload
from shoal.swarm.records import ModelRecord, RecordError, ServerRecord, SignedRecord, State, decode, sign
from shoal.swarm.table import RecordTable

if TYPE_CHECKING:
    from bench.registry_sim import Sim

MAX_FOLLOW_UPS = 4  # as shoal.swarm.service (not imported: it pulls in torch and the transport)
EPOCH = 1.75e9  # virtual time 0 on the records' clock
SWARM = "bench-swarm"
MODEL = "bench/model-32"
RELAY = "https://euw1-1.relay.iroh.network./"
OUTSIDER = "0" * 64  # the sender of requests from outside the swarm (Sim.inject)


@dataclass
class SimConfig:
    peers: int = 1000
    gossip: GossipConfig = field(default_factory=GossipConfig)
    seed: int = 0
    latency: tuple[float, float] = (0.020, 0.080)  # one way, seconds
    overhead: int = 64  # framing bytes per message
    dead_timeout: float | None = None  # a call to a peer that is gone fails after this; None: as
    # SwarmService.call_timeout with the default deadlines, min(60, 5 + 2 * period)
    announce_timeout: float = 2.0  # as SwarmService.announce_to_all
    num_blocks: int = 32
    span: tuple[int, int] = (4, 8)

    def __post_init__(self):
        if self.dead_timeout is None:
            self.dead_timeout = min(60.0, 5.0 + 2 * self.gossip.period)


class SharedDecode:
    """``records.decode`` memoised on the record's bytes, for every simulated peer at once.

    ``decode`` is a pure function of the bytes (the record, or the same ``RecordError``), so sharing
    its results changes no outcome; it saves the parse and field checks that each of the N peers
    would otherwise repeat on each copy (about 0.1-0.25 ms each: too slow for 1,000 peers in one
    process), and memory (tables hold shared immutable records). ``calls`` counts the decodes the
    peers asked for; ``runs`` the ones that ran."""

    def __init__(self):
        self._memo: dict[bytes, SignedRecord | tuple[str, str]] = {}
        self.calls = 0
        self.runs = 0

    def __call__(self, data: bytes) -> SignedRecord:
        self.calls += 1
        hit = self._memo.get(data) if isinstance(data, bytes) else None
        if hit is None:
            self.runs += 1
            try:
                hit = decode(data)
            except RecordError as exc:
                hit = (exc.reason, str(exc))
            if isinstance(data, bytes):
                if len(self._memo) >= 1 << 16:
                    self._memo.clear()
                self._memo[data] = hit
        if isinstance(hit, tuple):
            raise RecordError(hit[0], hit[1].partition(": ")[2])
        return hit


@contextlib.contextmanager
def shared_decode():
    """Make the gossip code of this process decode through one :class:`SharedDecode`."""
    shared = SharedDecode()
    saved, gossip_module.decode = gossip_module.decode, shared
    try:
        yield shared
    finally:
        gossip_module.decode = saved


class Meter:
    """Bytes and messages sent, by op (``offer``, ``offer.reply``, ...)."""

    def __init__(self, overhead: int):
        self.overhead = overhead
        self.bytes: Counter[str] = Counter()
        self.messages: Counter[str] = Counter()

    def count(self, op: str, payload: int) -> int:
        size = payload + self.overhead
        self.bytes[op] += size
        self.messages[op] += 1
        return size

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        return Counter(self.bytes), Counter(self.messages)


class _Gather:
    """Calls ``done`` once ``n`` calls finished (``asyncio.gather`` of calls)."""

    __slots__ = ("done", "left")

    def __init__(self, n: int, done: Callable[[], None] | None):
        self.left, self.done = n, done
        if n == 0 and done is not None:
            done()

    def one(self) -> None:
        self.left -= 1
        if self.left == 0 and self.done is not None:
            self.done()


class SimTable(RecordTable):
    """A :class:`RecordTable` whose ``expire`` skips its scan of every record while nothing can have
    lapsed (before the earliest expiry it may hold; merges only lower that bound). Same results as
    ``RecordTable.expire``, which the service calls on every request: 1,000 peers scanning 1,000
    records per request would dominate the simulation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._due = math.inf  # no record expires before this

    def merge(self, data) -> bool:
        if not super().merge(data):
            return False
        self._due = min(self._due, data.record.expires) if isinstance(data, SignedRecord) else -math.inf
        return True

    def expire(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        if now < self._due:
            return []
        gone = super().expire(now)
        self._due = min((s.record.expires for s in self._records.values()), default=math.inf)
        return gone


class SimPeer:
    """One server: its key, its announcement facts, its table, its gossiper, its service loops."""

    def __init__(self, sim: Sim, index: int, start: int, end: int):
        self.sim, self.index, self.start, self.end = sim, index, start, end
        self.secret = sim.rng.randbytes(32)
        self.id = Ed25519PrivateKey.from_private_bytes(self.secret).public_key().public_bytes_raw().hex()
        self.rng = random.Random(sim.rng.random())
        self.table = SimTable(SWARM, clock=sim.clock, max_lifetime=max(3600.0, 2 * sim.config.gossip.expiry))
        self.gossiper = Gossiper(self.table, self.id, sim.config.gossip, random.Random(self.rng.random()))
        port = 40000 + index % 20000
        self.addrs = (f"198.51.{100 + index // 250}.{index % 250 + 1}:{port}", f"[2001:db8::{index:x}]:{port}")
        self.alive = False  # answers requests
        self.running = False  # runs rounds and offers (SwarmService.start .. stop)
        self.signed: SignedRecord | None = None
        self.sent = self.received = 0  # bytes, framing included
        self._offering = False  # the offers loop is sleeping push_delay

    # ---- Announcement ---------------------------------------------------------------------------
    def server_record(self, now: float, state: State = State.ONLINE) -> SignedRecord:
        nxt = self.sim.next_span_peers(self, now)
        record = ServerRecord(
            swarm=SWARM, peer=self.id, addrs=self.addrs, relay=RELAY, model=MODEL,
            blocks=BlockRange(self.start, self.end), fingerprints=self.sim.model_fps[self.start : self.end],
            state=state,
            throughput=round(self.rng.uniform(1.0, 50.0), 2), cache_tokens_free=self.rng.randrange(1 << 20),
            rtts=tuple(sorted((p, round(self.rng.uniform(2.0, 150.0), 3)) for p in nxt)),
            version=__version__, timestamp=now, expires=now + self.sim.config.gossip.expiry,
        )  # fmt: skip
        self.signed = sign(record, self.secret)
        self.sim.signed_records.append((self.sim.now, len(self.signed.data)))
        return self.signed

    def model_record(self, now: float) -> SignedRecord:
        record = ModelRecord(
            SWARM, self.id, MODEL, len(self.sim.model_fps), self.sim.model_fps, now, now + self.sim.config.gossip.expiry
        )
        return sign(record, self.secret)

    def own_records(self) -> list[SignedRecord]:
        """``Announcement.records``: the server record when due; the model record when none is held
        or ours is due (every simulated server can vouch for the model's fingerprints)."""
        now, refresh = self.sim.clock(), self.sim.config.gossip.refresh
        out = []
        if self.signed is None or now - self.signed.timestamp >= refresh:
            out.append(self.server_record(now))
        held = self.table.get(f"m:{MODEL}")
        mine = held is not None and held.record.signer == self.id
        if held is None or (mine and now - held.timestamp >= refresh):
            out.append(self.model_record(now))
        return out

    # ---- SwarmService ---------------------------------------------------------------------------
    def publish(self, signed: SignedRecord) -> None:
        self.gossiper.publish(signed)
        self._wake()

    def _wake(self) -> None:
        if self.gossiper.has_news() and self.running and not self._offering:
            self._offering = True
            self.sim.after(self.sim.config.gossip.push_delay, self._offer_batch)

    def _offer_batch(self) -> None:
        """``SwarmService._offers``: after ``push_delay``, take the offers and send them (not awaited)."""
        self._offering = False
        if self.running:
            for out in self.gossiper.take_offers():
                self.call(out)

    def _round(self) -> None:
        if not self.running:
            return
        for signed in self.own_records():
            self.publish(signed)
        for out in self.gossiper.tick():
            self.call(out)
        self.sim.after(self.sim.config.gossip.period * self.rng.uniform(0.8, 1.2), self._round)

    def begin(self, first_round: float) -> None:
        self.alive = self.running = True
        self.sim.after(first_round, self._round)
        self._wake()

    def call(self, out: Outgoing, depth: int = 0, done: Callable[[], None] | None = None) -> None:
        sim = self.sim
        self.sent += sim.meter.count(out.op, len(out.payload))
        target = sim.by_id.get(out.peer)
        if target is None or not target.alive:
            sim.failed_calls += 1
            sim.later(sim.config.dead_timeout, done)
            return
        sim.after(sim.latency(), target._serve, self, out, depth, done)

    def _serve(self, caller: SimPeer | None, out: Outgoing, depth: int, done) -> None:
        sim = self.sim
        if not self.alive:  # went away while the request was in flight
            sim.failed_calls += 1
            sim.later(sim.config.dead_timeout, done)
            return
        try:
            self.table.expire()  # SwarmService.handle: never hand out records that have lapsed
            reply = self.gossiper.handle(out.op, out.payload, caller.id if caller is not None else OUTSIDER)
            self._wake()
        except RecordError as exc:
            self.table.rejected[exc.reason] += 1
            self.sent += sim.meter.count(out.op + ".error", len(str(exc)))
            sim.later(sim.latency(), done)
            return
        size = sim.meter.count(out.op + ".reply", len(reply))
        self.sent += size
        if caller is not None:
            caller.received += size
            sim.after(sim.latency(), caller._on_reply, out, reply, depth, done)

    def _on_reply(self, out: Outgoing, reply: bytes, depth: int, done) -> None:
        if not self.alive:
            return
        try:
            follow_ups = self.gossiper.on_reply(out, reply)
        except RecordError:  # SwarmService.call: the call failed
            if done:
                done()
            return
        self._wake()
        if depth >= MAX_FOLLOW_UPS or not follow_ups:
            if done:
                done()
            return
        gather = _Gather(len(follow_ups), done)
        for follow_up in follow_ups:
            self.call(follow_up, depth + 1, gather.one)

    def join(self, bootstrap: list[SimPeer], then: Callable[[], None]) -> None:
        """``SwarmService.join``: pull the tables of the bootstrap peers, concurrently."""
        self.alive = True
        self.gossiper.extra_peers.update(p.id for p in bootstrap)
        gather = _Gather(len(bootstrap), then)
        for peer in bootstrap:
            self.call(self.gossiper.join_sync(peer.id), 0, gather.one)

    def leave(self, then: Callable[[], None] | None = None) -> SignedRecord:
        """``SwarmService.stop`` then ``announce_to_all`` of the offline record, then the node closes."""
        self.running = False
        signed = self.server_record(self.sim.clock(), State.OFFLINE)
        self.gossiper.publish(signed)
        push = encode_payload(PushRequest(records=[signed.data]))
        outs = [Outgoing(peer, "push", push) for peer in self.gossiper.peers()]
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed, self.alive = True, False
                if then:
                    then()

        gather = _Gather(len(outs), close)
        for out in outs:
            self.call(out, 0, gather.one)
        self.sim.after(self.sim.config.announce_timeout, close)
        return signed

    def crash(self) -> None:
        self.alive = self.running = False
