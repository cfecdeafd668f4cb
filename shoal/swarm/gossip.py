"""Push-pull gossip of swarm records, as a sans-I/O state machine (the network runner and the
1,000-peer simulation in ``bench/registry.py`` drive the same code).

Three exchanges, all request/response:

    offer  [(key, timestamp), ...]  -> [wanted keys]         rumour: "I learned these"
    push   [record bytes, ...]      -> {}                    the records the peer wanted
    sync   [(key, timestamp), ...]  -> {records, wanted}     anti-entropy: full digests

A record learned from anywhere (own publication, a push, a sync) is offered to ``fanout`` random
peers after a short batching delay, so news spreads in O(log N) network hops, not rounds; each
peer pulls a record's bytes once, which keeps traffic near the floor of one copy per peer per
refresh. Every ``sync_every`` rounds a peer swaps full digests with one random peer, which repairs
anything the rumours missed (lost messages, peers that were down).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgpack

from shoal.swarm.records import RecordError, ServerRecord, SignedRecord, State, decode
from shoal.swarm.table import RecordTable

MAX_OFFER = 4096
MAX_PUSH = 4096


@dataclass(frozen=True)
class GossipConfig:
    period: float = 5.0  # seconds between rounds
    refresh: float = 60.0  # a server re-signs its record this often
    expiry: float = 180.0  # records live this long after signing
    fanout: int = 3  # peers offered each batch of news
    push_delay: float = 0.05  # batching window for offers
    sync_every: int = 6  # rounds between anti-entropy syncs


@dataclass(frozen=True)
class Outgoing:
    peer: str
    op: str
    payload: bytes


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(payload: bytes, limit: int):
    value = msgpack.unpackb(payload, raw=False, max_array_len=limit, max_bin_len=1 << 16, max_str_len=1 << 12)
    if not isinstance(value, list | dict):
        raise RecordError("malformed", "gossip payload")
    return value


def _digest_entries(value) -> list[tuple[str, float]]:
    if not isinstance(value, list):
        raise RecordError("malformed", "digest must be a list")
    out = []
    for entry in value:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise RecordError("malformed", "digest entry")
        if not isinstance(entry[1], int | float):
            raise RecordError("malformed", "digest timestamp")
        out.append((entry[0], float(entry[1])))
    return out


class Gossiper:
    """One peer's gossip policy. Feed it events and replies; it says whom to send what."""

    def __init__(self, table: RecordTable, self_id: str, config: GossipConfig, rng: random.Random | None = None):
        self.table = table
        self.self_id = self_id
        self.config = config
        self.rng = rng or random.Random()
        self._news: dict[str, float] = {}  # keys learned since the last offer
        self._round = self.rng.randrange(config.sync_every)  # stagger syncs across peers
        self.extra_peers: set[str] = set()  # bootstrap peers not (yet) in the table

    # ---- whom to talk to ------------------------------------------------------------------
    def peers(self) -> list[str]:
        known = {r.peer for r in self.table.servers() if r.state is not State.OFFLINE}
        return sorted((known | self.extra_peers) - {self.self_id})

    def _sample(self, k: int) -> list[str]:
        peers = self.peers()
        return self.rng.sample(peers, min(k, len(peers)))

    # ---- events -----------------------------------------------------------------------------
    def learned(self, keys: list[str]) -> None:
        for key in keys:
            signed = self.table.get(key)
            if signed is not None:
                self._news[key] = signed.timestamp

    def publish(self, signed: SignedRecord) -> bool:
        if self.table.merge(signed):
            self.learned([signed.key])
            return True
        return False

    def has_news(self) -> bool:
        return bool(self._news)

    def take_offers(self) -> list[Outgoing]:
        """Offer what we learned since last time to ``fanout`` random peers."""
        if not self._news:
            return []
        news = [[k, ts] for k, ts in self._news.items()][:MAX_OFFER]
        self._news.clear()
        payload = pack(news)
        return [Outgoing(peer, "offer", payload) for peer in self._sample(self.config.fanout)]

    def tick(self) -> list[Outgoing]:
        """A round: expire, and now and then an anti-entropy sync with one random peer."""
        self.table.expire()
        self._round += 1
        if self._round % self.config.sync_every:
            return []
        return [Outgoing(peer, "sync", pack([list(e) for e in self.table.digest()])) for peer in self._sample(1)]

    def join_sync(self, peer: str) -> Outgoing:
        """First contact with a bootstrap peer: a full sync pulls its whole table."""
        return Outgoing(peer, "sync", pack([list(e) for e in self.table.digest()]))

    # ---- serving requests ---------------------------------------------------------------------
    def handle(self, op: str, payload: bytes) -> bytes:
        """Answer a peer's request; raise :class:`RecordError` on malformed input."""
        if op == "offer":
            return pack(self.table.wanted(_digest_entries(unpack(payload, MAX_OFFER))))
        if op == "push":
            self._merge(unpack(payload, MAX_PUSH))
            return pack({})
        if op == "sync":
            theirs = _digest_entries(unpack(payload, 1 << 20))
            newer = [s.data for s in self.table.newer_than(theirs)]
            return pack({"records": newer, "wanted": self.table.wanted(theirs)})
        raise RecordError("malformed", f"unknown gossip op {op!r}")

    def _merge(self, items) -> list[str]:
        if not isinstance(items, list):
            raise RecordError("malformed", "records must be a list")
        accepted = []
        for data in items:
            if not isinstance(data, bytes):
                self.table.rejected["malformed"] += 1
                continue
            try:
                signed = decode(data)
            except RecordError as exc:
                self.table.rejected[exc.reason] += 1
                continue
            if self.table.merge(signed):
                accepted.append(signed.key)
        self.learned(accepted)
        return accepted

    # ---- replies to our requests ------------------------------------------------------------
    def on_reply(self, request: Outgoing, reply: bytes) -> list[Outgoing]:
        if request.op == "offer":
            wanted = unpack(reply, MAX_OFFER)
            return self._push_to(request.peer, wanted)
        if request.op == "sync":
            answer = unpack(reply, 1 << 20)
            if not isinstance(answer, dict):
                raise RecordError("malformed", "sync reply")
            self._merge(answer.get("records", []))
            return self._push_to(request.peer, answer.get("wanted", []))
        return []

    def _push_to(self, peer: str, keys) -> list[Outgoing]:
        if not isinstance(keys, list):
            raise RecordError("malformed", "wanted keys")
        records = [s.data for k in keys[:MAX_PUSH] if isinstance(k, str) and (s := self.table.get(k)) is not None]
        return [Outgoing(peer, "push", pack(records))] if records else []


def own_record_due(held: SignedRecord | None, now: float, refresh: float) -> bool:
    return held is None or now - held.timestamp >= refresh


def server_peers(records: list[ServerRecord]) -> dict[str, ServerRecord]:
    return {r.peer: r for r in records}
