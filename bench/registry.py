"""Swarm registry at scale: the real record, table and gossip code over a simulated network.

    python -m bench.registry          # 1,000 peers, 5 s rounds, 60 s refresh: ~2.5 min on 2 busy cores
    python -m bench.registry --peers 200 --period 2 --refresh 20 [--fanout F --push-delay S --sync-every R]
    python -m bench.registry --peers 10000   # sampled mode (bench/registry_scale.py): ~30 s, ~400 MB

Past ``FULL_MAX_PEERS`` (2,000) peers, or with ``--sampled``, the run is :mod:`bench.registry_scale`:
every peer simulated, full tables only at a sample of observers (this mode's N^2 tables take 24 GB
at 10,000 peers). What follows describes the full mode.

One process, a virtual clock, no sockets. Every peer has its own :class:`RecordTable` (whose clock
is the virtual clock) and :class:`Gossiper`, driven the way :class:`shoal.swarm.service.SwarmService`
drives them: a round every ``period * U(0.8, 1.2)`` (random phase) that republishes the peer's own
records when due and calls ``tick``; an offers loop that waits for news, sleeps ``push_delay`` and
sends the offers without awaiting them; follow-ups of replies at most ``MAX_FOLLOW_UPS`` deep;
``table.expire()`` before answering each request; ``join`` syncs with two bootstrap peers, then
publishes; a clean leave is ``announce_to_all`` of the offline record.

Records are real: each peer has an ed25519 key and signs its :class:`ServerRecord` (32-block
model, spans of 4-8 blocks, round-trip times to up to 8 servers of the next span, as
``Announcement`` measures them); every payload is a real :mod:`shoal.swarm.messages` struct as
msgpack, its records through ``records.decode`` and the tables' checks. A message takes
``U(20, 80)`` ms one way; a call to a peer that is gone fails after ``--dead-timeout`` s (default
``SwarmService.call_timeout``, ``min(60, 5 + 2 * period)``). Bytes are every payload sent
(requests and replies) plus ``overhead`` (64) bytes of framing per message.

Signature checks are memoised per process (``records._verified``), and all simulated peers share
that cache: each distinct record is verified once in the whole run, as one real peer verifies each
distinct record once. By default ``records.decode`` is shared the same way (see
:class:`SharedDecode`: it is a pure function of the bytes; 1,000 peers each decoding every copy
would take ~20 minutes here); ``--per-peer-decode`` turns that off. Table checks and merges always
run per peer.

Prints JSON: convergence after joins, clean leaves and a crash, and steady-state traffic per peer
against the floor ``N * record_bytes * 60 / refresh``, with ``targets_met``; in both modes a summary
of ``join_convergence_s`` and ``leave_convergence_s`` (the worst trial), ``bytes_ratio`` and
``peak_rss_mb``. Tables run with the default :class:`~shoal.limits.RegistryLimits` (caps, and
senders' budgets: ``rejected_records`` counts what they refused of honest traffic).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import math
import random
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal import __version__
from shoal.ids import BlockRange
from shoal.swarm import gossip as gossip_module
from shoal.swarm.gossip import GossipConfig, Gossiper, Outgoing
from shoal.swarm.messages import Payload, PushRequest, encode_payload
from shoal.swarm.records import ModelRecord, RecordError, ServerRecord, SignedRecord, State, decode, sign
from shoal.swarm.table import RecordTable

MAX_FOLLOW_UPS = 4  # as shoal.swarm.service (not imported: it pulls in torch and the transport)
EPOCH = 1.75e9  # virtual time 0 on the records' clock
SWARM = "bench-swarm"
MODEL = "bench/model-32"
RELAY = "https://euw1-1.relay.iroh.network./"
OUTSIDER = "0" * 64  # the sender of requests from outside the swarm (Sim.inject)
FULL_MAX_PEERS = 2000  # past this the full simulation's N^2 tables do not fit: sampled mode
TARGET_CONVERGENCE_S = 30.0
TARGET_BYTES_RATIO = 2.0


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


class Sim:
    """The event loop, the peers, and the probes that time convergence."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self._queue: list = []
        self._seq = itertools.count()
        self.meter = Meter(config.overhead)
        self.failed_calls = 0
        self.signed_records: list[tuple[float, int]] = []  # (virtual time, bytes) of server records signed
        self.model_fps = tuple(self.rng.randbytes(32) for _ in range(config.num_blocks))
        self.peers: list[SimPeer] = []
        self.by_id: dict[str, SimPeer] = {}
        self._by_start: dict[int, list[SimPeer]] = {}

    def clock(self) -> float:
        return EPOCH + self.now

    def latency(self) -> float:
        return self.rng.uniform(*self.config.latency)

    # ---- events -------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def later(self, dt: float, done: Callable[[], None] | None) -> None:
        if done is not None:
            self.after(dt, done)

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


# ---- the benchmark ---------------------------------------------------------------------------------


def _rounded(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _decode_us(sim: Sim) -> float:
    """Microseconds one real ``records.decode`` of a server record (the one with the most rtts)
    takes here: what each real peer spends per record it receives."""
    data = max((p.signed for p in sim.peers if p.signed is not None), key=lambda s: len(s.record.rtts)).data
    decode(data)
    started, n = time.perf_counter(), 300
    for _ in range(n):
        decode(data)
    return (time.perf_counter() - started) / n * 1e6


def run(config: SimConfig, window: float = 60.0, trials: int = 3, per_peer_decode: bool = False, log=None) -> dict:
    """The benchmark: a crash at t=1 s, the steady-state window, then ``trials`` joins each followed
    by a clean leave (one at a time, each once the previous converged), then the crash's expiry."""
    started = time.perf_counter()
    say = log or (lambda *_: None)
    with contextlib.nullcontext() if per_peer_decode else shared_decode() as shared:
        return _run(config, window, trials, shared, started, say)


def run_settings(n: int, g: GossipConfig, config: SimConfig) -> dict:
    """What a run simulated (peers, gossip periods, the network): the head of both modes' reports."""
    return {
        "peers": n,
        "period_s": g.period,
        "refresh_s": g.refresh,
        "expiry_s": g.expiry,
        "gossip": {"fanout": g.fanout, "push_delay_s": g.push_delay, "sync_every_rounds": g.sync_every},
        "network": {
            "latency_ms_one_way": [config.latency[0] * 1e3, config.latency[1] * 1e3],
            "overhead_bytes_per_message": config.overhead,
            "dead_peer_timeout_s": config.dead_timeout,
            "seed": config.seed,
        },
    }


def _stats(seconds: list[float | None], period: float) -> dict:
    done = [s for s in seconds if s is not None]
    worst = max(done) if len(done) == len(seconds) and done else None
    return {
        "seconds": [_rounded(s) for s in seconds],
        "max_s": _rounded(worst),
        "max_rounds": _rounded(worst / period if worst is not None else None),
    }


def _run(config: SimConfig, window: float, trials: int, shared: SharedDecode | None, started: float, say) -> dict:
    g = config.gossip
    sim = Sim(config)
    sim.populate(config.peers)
    say(f"populated {config.peers} peers in {time.perf_counter() - started:.1f} s")

    # A crash at t=1 s, of the server whose record is the oldest (its refresh was due next): the
    # earliest its record can lapse. From its last signature, any crash takes the same time.
    sim.run_until(1.0)
    crashed = min((p for p in sim.peers if p.running), key=lambda p: p.signed.timestamp)
    crashed_ts = crashed.signed.timestamp
    crash_watch = sim.crash(crashed)

    # Steady state: all traffic over the window.
    sim.run_until(max(2 * g.period, 10.0))
    bytes0, messages0 = sim.meter.snapshot()
    signed0, calls0 = len(sim.signed_records), shared.calls if shared else 0
    t0 = sim.now
    sim.run_for(window)
    bytes1, messages1 = sim.meter.snapshot()
    signed_in_window = sim.signed_records[signed0:]
    decodes = (shared.calls if shared else 0) - calls0
    minutes = (sim.now - t0) / 60
    say(f"steady state measured until t={sim.now:.0f} s ({time.perf_counter() - started:.1f} s)")

    # Joins and clean leaves, one at a time.
    joins, leaves, sync_bytes = [], [], []
    for _ in range(trials):
        joining = sim.join()
        sim.run_while(lambda j=joining: not j.done, 10 * g.refresh)
        joins.append(joining.watch.seconds if joining.watch else None)
        sync_bytes.append(joining.sync_bytes)
        _, watch = sim.leave(sim.pick(exclude=[crashed]))
        sim.run_while(lambda w=watch: not w.done, 10 * g.refresh)
        leaves.append(watch.seconds)
        say(f"join and leave converged at t={sim.now:.0f} s ({time.perf_counter() - started:.1f} s)")
    sim.run_while(lambda: not crash_watch.done, 2 * g.expiry + 2 * g.period)
    say(f"crash forgotten at t={sim.now:.0f} s ({time.perf_counter() - started:.1f} s)")

    n = config.peers
    window_bytes = {op: bytes1[op] - bytes0[op] for op in sorted(bytes1) if bytes1[op] > bytes0[op]}
    window_messages = {op: messages1[op] - messages0[op] for op in sorted(messages1) if messages1[op] > messages0[op]}
    record_bytes = statistics.fmean(size for _, size in signed_in_window)
    per_peer_minute = sum(window_bytes.values()) / n / minutes
    floor = n * record_bytes * 60 / g.refresh
    signed_floor = len(signed_in_window) * record_bytes / minutes  # each peer receives each record signed once
    ratio = per_peer_minute / floor
    join, leave = _stats(joins, g.period), _stats(leaves, g.period)
    join["bootstrap_sync_bytes_sent_received"] = sync_bytes[0]
    out = {
        **run_settings(n, g, config),
        "signature_cache": (
            "shared: every simulated peer runs in this one process and uses the same records._verified "
            "lru_cache, so each distinct record's signature is verified once in the run (a real peer "
            "verifies each distinct record once)"
        ),
        "decode": (
            "per peer: every peer decodes every copy it receives"
            if shared is None
            else "shared: records.decode memoised on the record bytes for all peers (a pure function of them: "
            "outcomes are unchanged); every table check and merge runs per peer"
        ),
        "join": join,
        "leave": leave,
        "crash": {
            "seconds_until_all_dropped": _rounded(crash_watch.seconds),
            "record_age_at_crash_s": _rounded(crash_watch.begun + EPOCH - crashed_ts),
            "seconds_since_last_signature": _rounded(
                crash_watch.begun + crash_watch.seconds + EPOCH - crashed_ts if crash_watch.done else None
            ),
            # each peer drops it at its first round after it expired; the probe looks every 0.1 s
            "bound_since_last_signature_s": round(g.expiry + 1.2 * g.period + 0.1, 2),
        },
        "steady_state": {
            "window_s": [round(t0, 1), round(t0 + minutes * 60, 1)],
            "record_bytes": round(record_bytes, 1),
            "bytes_per_peer_per_minute": round(per_peer_minute),
            "floor_bytes_per_peer_per_minute": round(floor),
            "ratio": round(ratio, 3),
            "records_signed_per_minute": round(len(signed_in_window) / minutes, 1),
            "ratio_to_records_actually_signed": round(per_peer_minute / signed_floor, 3),
            "bytes_per_peer_per_minute_by_op": {op: round(b / n / minutes) for op, b in window_bytes.items()},
            "messages_per_peer_per_minute": {op: round(m / n / minutes, 1) for op, m in window_messages.items()},
            "record_decodes_per_peer_per_second": round(decodes / n / (minutes * 60), 2) if shared else None,
            "decode_us_per_record": round(_decode_us(sim), 1),
            "failed_calls_total": sim.failed_calls,
            # every table's refusals over the run but stale copies (normal in gossip): honest
            # traffic under the registry's caps and senders' budgets (shoal.limits.RegistryLimits)
            "rejected_records": {
                reason: n
                for reason, n in sum((p.table.rejected for p in sim.peers), start=Counter()).items()
                if reason != "stale"
            },
        },
        "targets": {"convergence_s": TARGET_CONVERGENCE_S, "bytes_ratio": TARGET_BYTES_RATIO},
    }
    out["mode"] = "full"
    return finish(out, join, leave, ratio, sim.now, started)


def finish(out: dict, join: dict, leave: dict, ratio: float, virtual: float, started: float) -> dict:
    """The summary keys every mode prints, and whether the targets are met."""
    out["join_convergence_s"] = join["max_s"]
    out["leave_convergence_s"] = leave["max_s"]
    out["bytes_ratio"] = round(ratio, 3)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["targets_met"] = bool(
        join["max_s"] is not None
        and join["max_s"] < TARGET_CONVERGENCE_S
        and leave["max_s"] is not None
        and leave["max_s"] < TARGET_CONVERGENCE_S
        and ratio <= TARGET_BYTES_RATIO
    )
    out["virtual_s"] = round(virtual, 1)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--period", type=float, default=5.0, help="gossip round, seconds")
    parser.add_argument("--refresh", type=float, default=60.0, help="record refresh, seconds")
    parser.add_argument("--expiry", type=float, default=None, help="record lifetime (default 3 x refresh)")
    parser.add_argument("--fanout", type=int, default=None)
    parser.add_argument("--push-delay", type=float, default=None)
    parser.add_argument("--sync-every", type=int, default=None)
    parser.add_argument("--window", type=float, default=60.0, help="steady-state measurement, seconds")
    parser.add_argument("--trials", type=int, default=3, help="joins (each followed by a leave) to time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dead-timeout", type=float, default=None, help="seconds a call to a crashed peer takes to fail"
    )
    parser.add_argument(
        "--per-peer-decode", action="store_true", help="every peer decodes every copy (slow: minutes for 200 peers)"
    )
    parser.add_argument(
        "--sampled",
        action="store_true",
        help=f"every peer simulated, full tables only at observers (bench/registry_scale.py; "
        f"the default above {FULL_MAX_PEERS} peers)",
    )
    parser.add_argument("--observers", type=int, default=16, help="sampled: peers that hold a real table")
    parser.add_argument("--sample-rate", type=float, default=1.0, help="sampled: refreshes per second spread as gossip")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    base = GossipConfig()
    gossip = GossipConfig(
        period=args.period,
        refresh=args.refresh,
        expiry=args.expiry if args.expiry is not None else 3 * args.refresh,
        fanout=args.fanout if args.fanout is not None else base.fanout,
        push_delay=args.push_delay,
        sync_every=args.sync_every if args.sync_every is not None else base.sync_every,
    )
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.verbose else None
    config = SimConfig(peers=args.peers, gossip=gossip, seed=args.seed, dead_timeout=args.dead_timeout)
    if args.sampled or args.peers > FULL_MAX_PEERS:
        from bench import registry_scale  # it imports this module

        say = log or (lambda *_: None)
        result = registry_scale.run(config, args.window, args.trials, args.observers, args.sample_rate, say)
    else:
        result = run(config, window=args.window, trials=args.trials, per_peer_decode=args.per_peer_decode, log=log)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
