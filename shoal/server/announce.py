"""What a server tells the swarm about itself: its signed server record (and the model record,
when it holds the whole checkpoint and the swarm has none yet)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from shoal import __version__
from shoal.ids import BlockRange
from shoal.swarm.gossip import GossipConfig
from shoal.swarm.records import ModelRecord, ServerRecord, SignedRecord, State, sign
from shoal.swarm.service import SwarmService
from shoal.transport import META, Node
from shoal.wire import Message
from shoal.wire.schema import CAPABILITIES, Ping


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
    state: State = State.JOINING
    cache_tokens_free: int = 0
    step_ms: float = 0.0  # one-token step latency per block
    service: SwarmService | None = None
    _signed: SignedRecord | None = None
    _rtts: dict[str, float] | None = None

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
            capabilities=tuple(sorted(CAPABILITIES)),
        )
        self._signed = sign(record, self.secret_key)
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
                )  # fmt: skip
                out.append(sign(model, self.secret_key))
        return out

    def set_state(self, state: State) -> SignedRecord:
        self.state = state
        return self.server_record(time.time())

    async def measure_next_rtts(self) -> None:
        """Round-trip times to the servers whose span starts where ours ends (for routing)."""
        if self.service is None:
            return
        rtts = {}
        for record in self.service.table.servers(self.model):
            if record.start != self.blocks.end or record.peer == self.node.id:
                continue
            ticket = self.service.ticket_for(record.peer)
            started = time.perf_counter()
            try:
                await self.node.request(ticket, META, Message("ping", 1, Ping(echo=False)), timeout=1.0)
            except Exception:  # unreachable: leave it out
                continue
            rtts[record.peer] = round((time.perf_counter() - started) * 1e3, 3)
            if len(rtts) >= 8:
                break
        self._rtts = rtts


async def keep_measuring(announcement: Announcement, period: float) -> None:
    while True:
        await announcement.measure_next_rtts()
        await asyncio.sleep(period)
