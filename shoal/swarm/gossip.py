"""Push-pull gossip of swarm records, as a sans-I/O state machine (the network runner and the
1,000-peer simulation in ``bench/registry.py`` drive the same code).

Three exchanges, all request/response (the payloads: :mod:`shoal.swarm.messages`):

    offer  OfferRequest(digest)   -> OfferReply(wanted)          rumour: "I learned these"
    push   PushRequest(records)   -> PushReply()                 the records the peer wanted
    sync   SyncRequest(digest)    -> SyncReply(records, wanted)  anti-entropy: full digests

A digest is one bytes string of 16-byte entries: a key id (the first 8 bytes of blake2b of the
record's key) and the record's timestamp (big-endian float64); ``wanted`` is the concatenated key
ids. A digest may also come as a list ``[[key, timestamp], ...]``; it is then answered in kind,
``wanted`` as a list of keys.

A record learned from anywhere (own publication, a push, a sync) is offered to ``fanout`` random
peers after a short batching delay, so news spreads in O(log N) network hops, not rounds; each
peer pulls a record's bytes once, which keeps traffic near the floor of one copy per peer per
refresh. Offers alone miss about ``exp(-fanout)`` of the peers; every ``sync_every`` rounds a peer
swaps full digests with one random peer, which repairs those (and anything else: lost messages,
peers that were down) within a round or two. ``bench/registry.py`` measures both on 1,000 peers
(and, sampled, on 10,000).

What a peer takes from another is bounded (:mod:`shoal.swarm.quota`): each request is charged its
bytes against the sender's budget, the keys wanted of an offer or sync are at most what the
sender's record budget covers, and a push merges the records asked for and at most a few more.
Replies to our own syncs are merged whole (we asked); the table's caps hold for every record.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass

from shoal.limits import RegistryLimits
from shoal.swarm.messages import (
    ENTRY,
    ID_BYTES,
    MAX_OFFER,
    MAX_PUSH,
    Entries,
    OfferReply,
    OfferRequest,
    PushReply,
    PushRequest,
    SyncReply,
    SyncRequest,
    decode_payload,
    encode_payload,
)
from shoal.swarm.quota import Quota
from shoal.swarm.records import RecordError, ServerRecord, SignedRecord, State, decode
from shoal.swarm.table import RecordTable

REGISTRY = RegistryLimits()


@dataclass(frozen=True)
class GossipConfig:
    period: float = 5.0  # seconds between rounds
    refresh: float = 60.0  # a server re-signs its record this often
    expiry: float = 180.0  # records live this long after signing
    fanout: int = 3  # peers offered each batch of news
    push_delay: float | None = None  # batching window for offers; None: period / 10, at most 0.5 s
    sync_every: int = 1  # rounds between anti-entropy syncs

    def __post_init__(self):
        if self.expiry > REGISTRY.max_announce_lifetime:  # peers would refuse every record we sign
            raise ValueError(f"expiry {self.expiry:g} s is over the {REGISTRY.max_announce_lifetime:g} s tables accept")
        if self.push_delay is None:  # rumours then reach ~1,000 peers in about a round
            object.__setattr__(self, "push_delay", min(self.period / 10, 0.5))


@dataclass(frozen=True)
class Outgoing:
    peer: str
    op: str
    payload: bytes


def key_id(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=ID_BYTES).digest()


def _entries(digest: bytes | Entries) -> tuple[list[tuple[bytes, float]], list[str] | None]:
    """A (validated) digest's entries as (key id, timestamp), and its keys when it came as a list."""
    if isinstance(digest, bytes):
        return list(ENTRY.iter_unpack(digest)), None
    return [(key_id(key), timestamp) for key, timestamp in digest], [key for key, _ in digest]


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
        self.quota = Quota(table.limits, table.clock)  # what each sender may make us take
        # An index of the table, kept up to date by what merges through here; rebuilt whenever the
        # table's size or merge count says that something else changed it (expiry, a purge, a merge
        # that did not come through here).
        self._ids: dict[str, bytes] = {}  # key -> key id
        self._keys: dict[bytes, str] = {}  # key id -> key
        self._mine: dict[bytes, float] = {}  # key id -> timestamp of the record held
        self._online: set[str] = set()  # peers with a server record that is not offline
        self._indexed = (-1, -1)  # (len(table), table.accepted) the index matches
        self._peers: list[str] | None = None  # sorted peers(), None when stale
        self._extra_seen: frozenset[str] = frozenset()

    # ---- the index --------------------------------------------------------------------------
    def _id(self, key: str) -> bytes:
        kid = self._ids.get(key)
        return kid if kid is not None else key_id(key)

    def _reindex(self) -> None:
        ids, mine, online = {}, {}, set()
        for signed in self.table.records():
            kid = ids[signed.key] = self._id(signed.key)
            mine[kid] = signed.timestamp
            record = signed.record
            if isinstance(record, ServerRecord) and record.state is not State.OFFLINE:
                online.add(record.peer)
        self._ids, self._keys, self._mine = ids, {kid: key for key, kid in ids.items()}, mine
        if online != self._online:
            self._online, self._peers = online, None
        self._indexed = (len(self.table), self.table.accepted)

    def _current(self) -> None:
        if self._indexed != (len(self.table), self.table.accepted):
            self._reindex()

    def _note(self, signed: SignedRecord) -> None:
        """``signed`` was just merged into the table."""
        size, accepted = self._indexed
        key = signed.key
        kid = self._ids.get(key)
        if kid is None:
            kid = self._ids[key] = key_id(key)
            self._keys[kid] = key
            size += 1
        self._mine[kid] = signed.timestamp
        self._indexed = (size, accepted + 1)
        record = signed.record
        if isinstance(record, ServerRecord):
            online = record.state is not State.OFFLINE
            if online != (record.peer in self._online):
                (self._online.add if online else self._online.discard)(record.peer)
                self._peers = None

    def _older(self, kid: bytes, timestamp: float) -> bool:
        """Whether we lack the record with key id ``kid`` or hold one older than ``timestamp``."""
        return self._mine.get(kid, -1.0) < timestamp

    def _digest(self) -> bytes:
        self._current()
        return encode_payload(SyncRequest(digest=b"".join(itertools.starmap(ENTRY.pack, self._mine.items()))))

    # ---- whom to talk to ------------------------------------------------------------------
    def peers(self) -> list[str]:
        return list(self._peer_list())

    def _peer_list(self) -> list[str]:
        self._current()
        if self._peers is None or self._extra_seen != self.extra_peers:
            self._extra_seen = frozenset(self.extra_peers)
            self._peers = sorted((self._online | self._extra_seen) - {self.self_id})
        return self._peers

    def _sample(self, k: int) -> list[str]:
        peers = self._peer_list()
        return self.rng.sample(peers, min(k, len(peers)))

    # ---- events -----------------------------------------------------------------------------
    def learned(self, keys: list[str]) -> None:
        for key in keys:
            signed = self.table.get(key)
            if signed is not None:
                self._note(signed)
                self._news[key] = signed.timestamp

    def publish(self, signed: SignedRecord) -> bool:
        if self.table.merge(signed):
            self.learned([signed.key])
            return True
        return False

    def has_news(self) -> bool:
        return bool(self._news)

    def take_offers(self) -> list[Outgoing]:
        """Offer what we learned since last time (up to ``MAX_OFFER`` keys) to ``fanout`` random peers."""
        if not self._news:
            return []
        batch = list(itertools.islice(self._news.items(), MAX_OFFER))
        for key, _ in batch:
            del self._news[key]
        payload = encode_payload(OfferRequest(digest=b"".join(ENTRY.pack(self._id(key), ts) for key, ts in batch)))
        return [Outgoing(peer, "offer", payload) for peer in self._sample(self.config.fanout)]

    def tick(self) -> list[Outgoing]:
        """A round: expire, and every ``sync_every`` rounds an anti-entropy sync with one random peer."""
        self.table.expire()
        self._round += 1
        if self._round % self.config.sync_every:
            return []
        peers = self._sample(1)
        return [Outgoing(peers[0], "sync", self._digest())] if peers else []

    def join_sync(self, peer: str) -> Outgoing:
        """First contact with a bootstrap peer: a full sync pulls its whole table."""
        return Outgoing(peer, "sync", self._digest())

    # ---- serving requests ---------------------------------------------------------------------
    def handle(self, op: str, payload: bytes, sender: str) -> bytes:
        """Answer ``sender``'s request; raise :class:`RecordError` on malformed input, ``rate_limited``
        past the sender's byte budget. Records are taken from a sender only as :mod:`shoal.swarm.quota`
        allows: the keys we want of its offer or sync are those its budget covers (asked for), and of
        its push those asked for, and at most a few more."""
        self.quota.charge(sender, len(payload))
        self._current()
        if op == "offer":
            entries, keys = _entries(decode_payload(payload, OfferRequest).digest)
            older = {kid for kid, ts in entries if self._older(kid, ts)}
            granted = set(self.quota.ask(sender, (kid for kid, _ in entries if kid in older)))
            wanted = [i for i, (kid, _) in enumerate(entries) if kid in granted]
            ids_or_keys = b"".join(entries[i][0] for i in wanted) if keys is None else tuple(keys[i] for i in wanted)
            return encode_payload(OfferReply(wanted=ids_or_keys))
        if op == "push":
            self._merge_push(decode_payload(payload, PushRequest).records, sender)
            return encode_payload(PushReply())
        if op == "sync":
            entries, keys = _entries(decode_payload(payload, SyncRequest).digest)
            # Compare only the entries that differ (set operations: digests mostly agree).
            theirs = dict(set(entries) - self._mine.items())  # they hold it, and we don't hold that version
            newer = [self._keys[kid] for kid, ts in self._mine.items() - set(entries) if theirs.get(kid, -1.0) < ts]
            wanted = self.quota.ask(sender, [kid for kid, ts in theirs.items() if self._older(kid, ts)])
            if keys is not None:
                by_id = dict(zip((kid for kid, _ in entries), keys, strict=True))
                return encode_payload(SyncReply(records=self._records(newer), wanted=tuple(by_id[k] for k in wanted)))
            return encode_payload(SyncReply(records=self._records(newer), wanted=b"".join(wanted)))
        raise RecordError("malformed", f"unknown gossip op {op!r}")

    def _merge_push(self, items: Iterable[bytes], sender: str) -> list[str]:
        """A push of ``sender``: the records we asked it for, and up to ``max_unasked_per_push`` others
        (records that do not decode among them) its budget covers. Past those, the rest is dropped
        (counted ``unasked``; an honest sender's are copies it pushed twice, by an offer and a sync):
        decoded only while it still has asks open, each such decode taken from its budget, so a flood
        costs at most its budget's decodes and signature checks."""
        accepted, unasked, items = [], 0, list(items)
        cap = self.table.limits.max_unasked_per_push
        for i, data in enumerate(items):
            if unasked > cap and not (self.quota.open_asks(sender) and self.quota.unasked(sender)):
                self.table.rejected["unasked"] += len(items) - i
                break
            try:
                signed = decode(data)
            except RecordError as exc:  # not what we asked for: counts against the few unasked
                self.table.rejected[exc.reason] += 1
                unasked += 1
                continue
            if not self.quota.asked_of(sender, self._id(signed.key)):
                unasked += 1
                if unasked > cap:
                    self.table.rejected["unasked"] += 1
                    continue
                if not self.quota.unasked(sender):
                    self.table.rejected["rate_limited"] += 1
                    continue
            if self.table.merge(signed):
                accepted.append(signed.key)
        self.learned(accepted)
        return accepted

    def _merge(self, items: Iterable[bytes]) -> list[str]:
        """Merge each record of a reply to our request on its own: a bad one is counted by its reason,
        the rest still count (the table's caps hold; no sender's budget is charged: we asked)."""
        accepted = []
        for data in items:
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
            return self._push_to(request.peer, decode_payload(reply, OfferReply).wanted)
        if request.op == "sync":
            answer = decode_payload(reply, SyncReply)
            self._merge(answer.records)
            return self._push_to(request.peer, answer.wanted)
        if request.op == "push":
            decode_payload(reply, PushReply)
        return []

    def _push_to(self, peer: str, wanted: bytes | tuple[str, ...]) -> list[Outgoing]:
        """Push the records of ``wanted`` (key ids, or keys; validated) that we hold, at most ``MAX_PUSH``."""
        self._current()
        if isinstance(wanted, bytes):
            ids = (wanted[i : i + ID_BYTES] for i in range(0, len(wanted), ID_BYTES))
            keys = [self._keys.get(kid) for kid in itertools.islice(ids, MAX_PUSH)]
        else:
            keys = list(wanted[:MAX_PUSH])
        records = self._records(keys)
        return [Outgoing(peer, "push", encode_payload(PushRequest(records=records)))] if records else []

    def _records(self, keys: Iterable[str | None]) -> list[bytes]:
        return [s.data for key in keys if key is not None and (s := self.table.get(key)) is not None]
