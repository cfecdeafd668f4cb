"""What a server tells the swarm about itself: its signed server record (and the model record,
when it holds the whole checkpoint and the swarm has none yet)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shoal import __version__
from shoal.ids import BlockRange
from shoal.quantization import Quantization
from shoal.swarm.gossip import GossipConfig
from shoal.swarm.records import MAX_QUEUED, ModelRecord, ServerRecord, SignedRecord, State, sign
from shoal.swarm.service import SwarmService
from shoal.swarm.verdicts import convicted
from shoal.transport import META, Node
from shoal.wire import Message
from shoal.wire.schema import CAPABILITIES, WEIGHTS, Ping

MAX_RTTS = 8  # next hops a record lists at most
FOLLOW_INTERVAL = 1.0  # seconds between looks at the table for next hops that came or went


@dataclass
class Announcement:
    """The mutable facts behind a server's record; :meth:`records` signs them when due."""

    node: Node
    secret_key: bytes
    swarm: str
    model: str
    blocks: BlockRange
    fingerprints: list[str]  # of the span, hex
    throughput: float  # tokens/s per block (see ServerRecord)
    gossip: GossipConfig
    model_fingerprints: list[str] | None = None  # of every block, when this server can vouch for them
    model_manifest: bytes = b""  # BLAKE3 of the model's chunk manifest, when this server can vouch for it
    gives_weights: bool = False  # answers the weights protocol (announced as the WEIGHTS capability)
    state: State = State.JOINING
    cache_tokens_free: int = 0
    step_ms: float = 0.0  # one-token step latency per block
    quantization: Quantization = Quantization.NONE  # how the span's weights are held
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters the span runs with: (name, digest), by name
    compute: str = ""  # the label its receipts sign ("bf16/cuda"; "": not known yet)
    queued: int = 0  # steps waiting in its batcher, sampled every gossip period (capped at MAX_QUEUED)
    service: SwarmService | None = None
    cert: bytes | None = None  # the server's member certificate, carried by its records (private swarms)
    _signed: SignedRecord | None = None
    _rtts: dict[str, float] | None = None
    _tried: set[str] = field(default_factory=set)  # next hops pinged since the last full measurement

    def server_record(self, now: float) -> SignedRecord:
        ticket = self.node.ticket()
        record = ServerRecord(
            swarm=self.swarm,
            peer=self.node.id,
            addrs=ticket.addrs,
            relay=ticket.relay_url,
            model=self.model,
            blocks=self.blocks,
            fingerprints=tuple(bytes.fromhex(f) for f in self.fingerprints),
            state=self.state,
            throughput=self.throughput,
            cache_tokens_free=self.cache_tokens_free,
            rtts=tuple(sorted((self._rtts or {}).items())),
            version=__version__,
            timestamp=now,
            expires=now + self.gossip.expiry,
            step_ms=self.step_ms,
            capabilities=tuple(sorted(CAPABILITIES | ({WEIGHTS} if self.gives_weights else set()))),
            quantization=self.quantization,
            adapters=tuple(sorted(self.adapters)),
            compute=self.compute,
            queued=min(max(self.queued, 0), MAX_QUEUED),
        )
        self._signed = sign(record, self.secret_key, self.cert)
        return self._signed

    def records(self, force: bool = False) -> list[SignedRecord]:
        """Records due for (re)publication now."""
        now = time.time()
        out = []
        # Before its blocks are loaded a server does not know their fingerprints; a record without
        # them is invalid (every peer would reject it), so the server is announced once loaded.
        known = len(self.fingerprints) == len(self.blocks)
        if known and (force or self._signed is None or now - self._signed.timestamp >= self.gossip.refresh):
            out.append(self.server_record(now))
        if self.model_fingerprints and self.service is not None:
            held = self.service.table.get(f"m:{self.model}")
            mine = held is not None and held.record.signer == self.node.id
            if held is None or (mine and now - held.timestamp >= self.gossip.refresh):
                model = ModelRecord(
                    self.swarm, self.node.id, self.model, len(self.model_fingerprints),
                    tuple(bytes.fromhex(f) for f in self.model_fingerprints), now, now + self.gossip.expiry,
                    self.model_manifest,
                )  # fmt: skip
                out.append(sign(model, self.secret_key, self.cert))
        return out

    def set_state(self, state: State) -> SignedRecord:
        self.state = state
        return self.server_record(time.time())

    def next_hops(self) -> list[str]:
        """Servers of our model (not offline, not convicted of lying by the swarm) whose span starts
        where ours ends, in the table's order."""
        if self.service is None:
            return []
        now = time.time()
        liars = convicted(self.service.table, self.model, now)
        return [
            r.peer
            for r in self.service.table.servers(self.model)
            if r.start == self.blocks.end and r.peer != self.node.id and r.expires > now and r.peer not in liars
        ]

    async def _ping_ms(self, peer: str) -> float | None:
        """The round trip to ``peer`` in ms, the faster of two pings (the first may include dialing
        a new connection); None if it did not answer within a second."""
        ticket = self.service.ticket_for(peer)
        best = None
        for _ in range(2):
            started = time.perf_counter()
            try:
                await self.node.request(ticket, META, Message("ping", 1, Ping(echo=False)), timeout=1.0)
            except Exception:  # unreachable: leave it out
                return None
            ms = (time.perf_counter() - started) * 1e3
            best = ms if best is None else min(best, ms)
        return round(best, 3)

    async def measure_next_rtts(self) -> bool:
        """Round-trip times to the servers whose span starts where ours ends (for routing), all of
        them afresh (at most ``MAX_RTTS``); True if they differ from those held."""
        rtts: dict[str, float] = {}
        self._tried = set()
        for peer in self.next_hops():
            self._tried.add(peer)
            ms = await self._ping_ms(peer)
            if ms is not None:
                rtts[peer] = ms
                if len(rtts) >= MAX_RTTS:
                    break
        changed, self._rtts = rtts != (self._rtts or {}), rtts
        return changed

    async def follow_next_hops(self) -> bool:
        """Measure only the next hops that appeared since the last look (each once, until the next
        full measurement) and drop those that left; True if the RTTs changed. Costs nothing on the
        network while the next hops stay the same."""
        hops = self.next_hops()
        rtts, tried = dict(self._rtts or {}), self._tried
        changed = False
        for peer in [p for p in rtts if p not in hops]:
            del rtts[peer]
            changed = True
        for peer in hops:
            if peer in tried or len(rtts) >= MAX_RTTS:
                continue
            tried.add(peer)
            ms = await self._ping_ms(peer)
            if ms is not None:
                rtts[peer] = ms
                changed = True
        self._tried = tried & set(hops)
        self._rtts = rtts
        return changed

    def republish(self) -> None:
        """Sign and gossip the record now (e.g. with new RTTs), if it is announced at all."""
        announced = self._signed is not None and len(self.fingerprints) == len(self.blocks)
        if self.service is not None and announced and self.state is not State.OFFLINE:
            self.service.publish(self.server_record(time.time()))


async def keep_measuring(announcement: Announcement, period: float) -> None:
    """Every ``period``: measure every next hop afresh. In between, every ``FOLLOW_INTERVAL`` seconds
    (or the gossip period, if shorter): measure next hops that just appeared, drop those that left,
    and republish the record at once when that changed its RTTs, so a new swarm shows its RTTs in
    seconds rather than after the first refresh. A republished record resets the refresh clock,
    so the periodic re-signing does not add a record on top."""
    check = min(FOLLOW_INTERVAL, announcement.gossip.period)
    while True:
        if await announcement.measure_next_rtts():
            announcement.republish()
        deadline = time.monotonic() + period
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(check, left))
            if await announcement.follow_next_hops():
                announcement.republish()
