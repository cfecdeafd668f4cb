"""The swarm registry's gossip at small scale, in the simulator of ``bench/registry.py`` (the real
records, tables and gossip policy over a virtual clock and network), and the record table's checks.

Bounds (``CONFIG``: 1 s rounds, 10 s refresh, 30 s expiry; push_delay = period / 10; 40 peers;
20-80 ms one-way latency), each over several seeds:

* a joining server's record is in every table within ``JOIN_ROUNDS`` rounds of its publication
  (offers reach all but ~exp(-3) of the peers within a round; the sync every round repairs the rest;
  measured: at most 2.1 rounds over 30 seeds x 3 joins);
* a leaving server's offline record is in every table within ``LEAVE_ROUNDS`` round (it is pushed to
  every peer directly);
* records injected at one peer spread to every table within ``SPREAD_ROUNDS`` rounds if valid, and
  never enter any table if forged.

Every peer decodes every copy it receives here (no shared decode memo); signature checks are
memoised per process (``records._verified``), so all simulated peers share that cache.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench.registry_peer import EPOCH, MODEL, SWARM, SimConfig, SimPeer
from bench.registry_sim import Sim, holds
from shoal.limits import RegistryLimits
from shoal.swarm.gossip import GossipConfig, Gossiper, Outgoing, key_id
from shoal.swarm.messages import (
    ENTRY,
    MAX_OFFER,
    OfferReply,
    OfferRequest,
    PushReply,
    PushRequest,
    SyncReply,
    SyncRequest,
    TableReply,
    decode_payload,
    encode_payload,
)
from shoal.swarm.records import (
    MAX_RECORD_BYTES,
    ModelRecord,
    Record,
    RecordError,
    ServerRecord,
    SignedRecord,
    State,
    decode,
    sign,
)
from shoal.swarm.table import RecordTable
from tests.helpers import registry
from tests.helpers.registry import sign_with, with_field

pytestmark = pytest.mark.timeout(120)

CONFIG = GossipConfig(period=1.0, refresh=10.0, expiry=30.0)
PEERS = 40
JOIN_ROUNDS = 3
LEAVE_ROUNDS = 1
SPREAD_ROUNDS = 3


# ---- records --------------------------------------------------------------------------------------
def keypair(rng: random.Random) -> tuple[bytes, str]:
    secret = rng.randbytes(32)
    return secret, Ed25519PrivateKey.from_private_bytes(secret).public_key().public_bytes_raw().hex()


def server_record(
    peer: str,
    fingerprints: tuple[bytes, ...],
    span: tuple[int, int],
    now: float,
    *,
    lifetime: float = 30.0,
    swarm: str = SWARM,
    state: State = State.ONLINE,
    throughput: float = 10.5,
) -> ServerRecord:
    return registry.server_record(
        swarm, peer, MODEL, span, fingerprints, now, lifetime, state=state, addrs=("192.0.2.1:4000",),
        throughput=throughput, cache_tokens_free=1000,
    )  # fmt: skip


THROUGHPUT_FIELD = 9  # index of ``throughput`` in ServerRecord.fields()


# ---- the record table -------------------------------------------------------------------------------
NOW = EPOCH
RNG = random.Random(7)
FPS = tuple(RNG.randbytes(32) for _ in range(4))
PUBLISHER = keypair(RNG)
ALICE = keypair(RNG)
MALLORY = keypair(RNG)


def model_data(fingerprints=FPS, now: float = NOW, who=PUBLISHER) -> bytes:
    return sign(ModelRecord(SWARM, who[1], MODEL, len(fingerprints), fingerprints, now, now + 30.0), who[0]).data


def alice(now: float = NOW, **kw) -> bytes:
    span = kw.pop("span", (0, 2))
    fps = kw.pop("fingerprints", FPS[span[0] : span[1]])
    return sign(server_record(ALICE[1], fps, span, now, **kw), ALICE[0]).data


@pytest.fixture
def table() -> RecordTable:
    t = RecordTable(SWARM, clock=lambda: NOW)
    assert t.merge(model_data())
    return t


REJECTIONS = {
    "wrong_swarm": lambda: alice(swarm="another-swarm"),
    "expired": lambda: alice(NOW - 40.0),
    "future": lambda: alice(NOW + 10.0),  # max_skew is 5 s
    "lifetime": lambda: alice(lifetime=7200.0),  # max_lifetime is 3600 s
    "fingerprint_mismatch": lambda: alice(fingerprints=(FPS[1], FPS[0])),
    "fingerprint_mismatch/span": lambda: alice(span=(3, 5), fingerprints=(FPS[3], FPS[0])),  # past the model
    "fingerprint_mismatch/model": lambda: model_data(tuple(reversed(FPS)), NOW + 1.0, MALLORY),
    "bad_signature/wrong_key": lambda: sign_with(server_record(ALICE[1], FPS[0:2], (0, 2), NOW), MALLORY[0]),
    "bad_signature/tampered": lambda: with_field(alice(), THROUGHPUT_FIELD, 99999.0),
    "malformed/garbage": lambda: b"\x93not a record",
    "malformed/fingerprint_count": lambda: alice(span=(0, 3), fingerprints=FPS[0:2]),
    "malformed/peer_id": lambda: with_field(alice(), 1, "not-a-peer-id"),
    "malformed/nan": lambda: with_field(alice(), THROUGHPUT_FIELD, math.nan),
    "too_large": lambda: b"\x00" * (MAX_RECORD_BYTES + 1),
}


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_table_rejects_with_reason(table, case):
    data = REJECTIONS[case]()
    before = len(table), table.records()
    assert not table.merge(data)
    assert dict(table.rejected) == {case.split("/")[0]: 1}
    assert (len(table), table.records()) == before


def test_table_takes_newer_only(table):
    assert table.merge(alice())
    assert not table.merge(alice())  # the same record again
    assert not table.merge(alice(NOW - 1.0))  # an older one
    assert table.rejected == {"stale": 2}
    assert table.merge(alice(NOW + 1.0))
    assert table.get(f"s:{ALICE[1]}").timestamp == NOW + 1.0
    assert table.accepted == 3  # the model record, two of alice's


def test_model_record_purges_servers_it_contradicts():
    table = RecordTable(SWARM, clock=lambda: NOW)
    assert table.merge(alice(fingerprints=(FPS[1], FPS[0])))  # no model record yet: taken
    assert table.merge(model_data())
    assert table.servers() == [] and table.rejected == {"fingerprint_mismatch": 1}
    assert table.merge(alice(NOW + 1.0))  # the right weights are welcome


def test_expire_drops_lapsed_records(table):
    assert table.merge(alice(NOW - 25.0))  # expires at NOW + 5
    assert table.expire(NOW + 4.0) == []
    assert table.expire(NOW + 5.0) == [f"s:{ALICE[1]}"]


# ---- gossip payloads --------------------------------------------------------------------------------
def raw(value) -> bytes:
    """``value`` as msgpack, unchecked: what a stranger may send."""
    return msgspec.msgpack.encode(value)


MALFORMED = {  # (op, payload) -> what RecordError's text must say (the field, where there is one)
    "not msgpack": ("offer", b"\xc1", "OfferRequest is not msgpack"),
    "partial entry": ("offer", raw({"digest": b"x" * 15}), "`$.digest` holds 15 bytes, not whole 16-byte entries"),
    "bad timestamp": ("offer", raw({"digest": [["s:x", "soon"]]}), "Expected `float`, got `str` - at `$.digest[0][1]`"),
    "bool timestamp": ("offer", raw({"digest": [["s:x", True]]}), "got `bool` - at `$.digest[0][1]`"),
    "long entry": ("offer", raw({"digest": [["s:x", 1.0, 2]]}), "length 2, got 3 - at `$.digest[0]`"),
    "long key": ("offer", raw({"digest": [["s:" + "k" * 600, 1.0]]}), "length <= 514 - at `$.digest[0][0]`"),
    "too many": ("offer", raw({"digest": bytes(ENTRY.size * (MAX_OFFER + 1))}), "length <= 65536 - at `$.digest`"),
    "missing field": ("offer", raw({}), "missing required field `digest`"),
    "unknown field": ("sync", raw({"digest": b"", "since": 1}), "unknown field `since`"),
    "not a map": ("sync", raw(7), "Expected `object`, got `int`"),
    "push as a list": ("push", raw([b"record"]), "Expected `object`, got `array`"),
    "record not bytes": ("push", raw({"records": [b"record", 7]}), "Expected `bytes`, got `int` - at `$.records[1]`"),
    "unknown op": ("gimme", encode_payload(PushRequest()), "unknown gossip op 'gimme'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_gossip_rejects_malformed_payloads(table, case):
    op, payload, says = MALFORMED[case]
    gossiper = Gossiper(table, ALICE[1], CONFIG, random.Random(0))
    before = table.records()
    with pytest.raises(RecordError, match="malformed") as caught:
        gossiper.handle(op, payload, MALLORY[1])
    assert caught.value.reason == "malformed" and says in str(caught.value), str(caught.value)
    assert table.records() == before


def test_gossip_rejects_malformed_replies(table):
    """A reply is a stranger's payload too: it must validate before anything is pushed or merged."""
    gossiper = Gossiper(table, ALICE[1], CONFIG, random.Random(0))
    offer, sync = Outgoing("p", "offer", b""), Outgoing("p", "sync", b"")
    for request, reply, says in [
        (offer, raw({"wanted": 5}), "at `$.wanted`"),
        (offer, raw({"wanted": b"1234567"}), "`$.wanted` holds 7 bytes, not whole 8-byte entries"),
        (sync, raw({"records": [], "wanted": b"", "more": 1}), "unknown field `more`"),
        (sync, raw([]), "Expected `object`, got `array`"),
        (Outgoing("p", "push", b""), raw({"ok": True}), "unknown field `ok`"),
    ]:
        with pytest.raises(RecordError, match=r"malformed: invalid \w+Reply") as caught:
            gossiper.on_reply(request, reply)
        assert says in str(caught.value), str(caught.value)
    assert table.accepted == 1 and table.rejected == {}


def test_gossip_answers_list_digests_in_kind(table):
    """A digest as ``[[key, timestamp], ...]`` is answered with keys; the compact form with key ids."""
    gossiper = Gossiper(table, ALICE[1], CONFIG, random.Random(0))
    held, fresh = f"m:{MODEL}", f"s:{MALLORY[1]}"
    stamp = table.get(held).timestamp
    offer = encode_payload(OfferRequest(digest=[[held, stamp], [fresh, NOW]]))
    assert decode_payload(gossiper.handle("offer", offer, MALLORY[1]), OfferReply) == OfferReply(wanted=(fresh,))
    compact = encode_payload(OfferRequest(digest=ENTRY.pack(key_id(held), stamp) + ENTRY.pack(key_id(fresh), NOW)))
    assert decode_payload(gossiper.handle("offer", compact, MALLORY[1]), OfferReply) == OfferReply(wanted=key_id(fresh))
    answer = decode_payload(
        gossiper.handle("sync", encode_payload(SyncRequest(digest=[[fresh, NOW]])), MALLORY[1]), SyncReply
    )
    assert answer == SyncReply(records=(table.get(held).data,), wanted=(fresh,))


def test_push_counts_each_bad_record_and_merges_the_rest(table):
    gossiper = Gossiper(table, PUBLISHER[1], CONFIG, random.Random(0))
    push = PushRequest(records=[b"\x93not a record", alice(), b"\x00" * (MAX_RECORD_BYTES + 1)])
    assert gossiper.handle("push", encode_payload(push), MALLORY[1]) == encode_payload(PushReply()) == b"\x80"
    assert table.get(f"s:{ALICE[1]}").data == alice()
    assert table.rejected == {"malformed": 1, "too_large": 1}


def test_payload_encodings():
    """Empty fields are left out (an offer nobody wanted answers in 1 byte); a table reply always
    has both fields, as a map that status tools read by name."""
    assert encode_payload(OfferReply()) == b"\x80"
    assert encode_payload(OfferRequest(digest=b"")) == b"\x81\xa6digest\xc4\x00"
    table = TableReply(records=[], rejected={})
    assert msgspec.msgpack.decode(encode_payload(table)) == {"records": [], "rejected": {}}
    full = TableReply(records=(alice(),), rejected={"stale": 2})
    assert decode_payload(encode_payload(full), TableReply) == full
    with pytest.raises(RecordError, match=r"malformed: invalid TableReply: .* - at `\$.rejected\[...\]`"):
        decode_payload(raw({"records": [], "rejected": {"stale": -1}}), TableReply)


def test_gossiper_follows_table_changes_made_elsewhere():
    """The gossiper's index of the table (for digests and whom to talk to) follows merges that did
    not go through it, expiry and purges."""
    now = [NOW]
    table = RecordTable(SWARM, clock=lambda: now[0])
    gossiper = Gossiper(table, PUBLISHER[1], CONFIG, random.Random(0))
    assert gossiper.peers() == []
    assert table.merge(alice(NOW - 25.0))  # directly, not through the gossiper; expires at NOW + 5
    assert gossiper.peers() == [ALICE[1]]
    alice_id = key_id(f"s:{ALICE[1]}")

    def wanted(timestamp: float) -> bytes:
        offer = encode_payload(OfferRequest(digest=ENTRY.pack(alice_id, timestamp)))
        return decode_payload(gossiper.handle("offer", offer, MALLORY[1]), OfferReply).wanted

    assert wanted(NOW - 25.0) == b""  # held: not wanted
    assert table.merge(alice(NOW - 24.0))  # a newer one, directly
    assert wanted(NOW - 24.5) == b""
    now[0] = NOW + 6.0
    gossiper.tick()  # expires alice's record
    assert gossiper.peers() == []
    assert wanted(NOW + 1.0) == alice_id  # lacked now
    assert gossiper.publish(SignedRecord(decode(alice(NOW + 1.0)).record, alice(NOW + 1.0)))
    assert gossiper.peers() == [ALICE[1]]
    assert table.merge(model_data(tuple(reversed(FPS)), NOW + 2.0))  # purges alice (other weights)
    assert gossiper.peers() == [] and table.rejected["fingerprint_mismatch"] == 1


# ---- the simulated swarm ----------------------------------------------------------------------------
def swarm(seed: int, peers: int = PEERS) -> Sim:
    sim = Sim(SimConfig(peers=peers, gossip=CONFIG, seed=seed))
    sim.populate(peers)
    sim.run_for(3.0)
    return sim


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_join_and_leave_converge(seed):
    sim = swarm(seed)
    joins, leaves = [], []
    for _ in range(3):
        joining = sim.join()
        sim.run_while(lambda j=joining: not j.done, 60.0, step=0.1)
        assert joining.done, f"join not converged: {len(joining.watch.left) if joining.watch else '?'} peers left"
        joins.append(joining.watch.seconds)
        _, watch = sim.leave(sim.pick())
        sim.run_while(lambda w=watch: not w.done, 60.0, step=0.1)
        assert watch.done
        leaves.append(watch.seconds)
    print(f"seed {seed}: join {joins} s, leave {leaves} s")
    assert max(joins) <= JOIN_ROUNDS * CONFIG.period, joins
    assert max(leaves) <= LEAVE_ROUNDS * CONFIG.period, leaves


def plant(peer: SimPeer, record: Record, data: bytes) -> None:
    """A compromised ``peer``: ``data`` enters its table unchecked, and it gossips it as news."""
    peer.table._put(SignedRecord(record, data))
    peer.gossiper.learned([record.key])


def test_forged_records_never_enter_a_table():
    sim = swarm(seed=5)
    rng = random.Random(11)
    fps = sim.model_fps
    honest_to = sim.pick()
    compromised = sim.pick(exclude=[honest_to])
    victim = sim.pick(exclude=[honest_to, compromised])
    old = victim.signed
    sim.run_while(lambda: victim.signed is old, 2 * CONFIG.refresh, step=0.1)  # the victim re-signs
    sim.run_for(3 * CONFIG.period)
    latest = victim.signed
    assert latest is not old and all(holds(latest.key, latest.timestamp)(p) for p in sim.alive())

    now = sim.clock()
    a, b, c, d, e, f = (keypair(rng) for _ in range(6))
    forged: dict[str, tuple[Record, bytes, str]] = {}  # name -> (record, data, reason at the first peer)

    fresh = server_record(a[1], fps[0:4], (0, 4), now)
    forged["new peer, signed by another key"] = (fresh, sign_with(fresh, b[0]), "bad_signature")
    usurped = server_record(victim.id, victim.signed.record.fingerprints, (victim.start, victim.end), now + 0.5)
    forged["victim's record, signed by another key"] = (usurped, sign_with(usurped, b[0]), "bad_signature")
    alien = server_record(c[1], fps[0:4], (0, 4), now, swarm="another-swarm")
    forged["valid signature, wrong swarm"] = (alien, sign(alien, c[0]).data, "wrong_swarm")
    valid = server_record(d[1], fps[4:8], (4, 8), now)
    tampered = with_field(sign(valid, d[0]).data, THROUGHPUT_FIELD, 1e6)
    forged["tampered throughput"] = (valid, tampered, "bad_signature")
    forged["victim's record replayed"] = (old.record, old.data, "stale")
    wrong = server_record(e[1], tuple(rng.randbytes(32) for _ in range(4)), (0, 4), now)
    forged["fingerprints not the model's"] = (wrong, sign(wrong, e[0]).data, "fingerprint_mismatch")
    # dated ahead (within the allowed skew) so that it is newer than the model record held
    remodel = ModelRecord(SWARM, e[1], MODEL, len(fps), tuple(reversed(fps)), now + 4.0, now + CONFIG.expiry)
    forged["model record with other fingerprints"] = (remodel, sign(remodel, e[0]).data, "fingerprint_mismatch")
    fresh_keys = {fresh.key, alien.key, valid.key, wrong.key}

    control = sign(server_record(f[1], fps[8:12], (8, 12), now), f[0])
    g = keypair(rng)
    planted_control = sign(server_record(g[1], fps[12:16], (12, 16), now), g[0])

    # A forger pushes everything (and the control record) to one honest peer; a compromised peer
    # holds everything (and another control record) in its table and gossips it.
    # (a push merges at most max_unasked_per_push records nobody asked for: the forger sends several)
    pushed, per_push = [data for _, data, _ in forged.values()] + [control.data], RegistryLimits().max_unasked_per_push
    for i in range(0, len(pushed), per_push):
        sim.inject(honest_to, "push", PushRequest(records=pushed[i : i + per_push]))
    for record, data, _ in forged.values():
        plant(compromised, record, data)
    plant(compromised, planted_control.record, planted_control.data)
    honest = [p for p in sim.alive() if p is not compromised]
    forged_data = {data for _, data, _ in forged.values()}

    def clean() -> None:
        for peer in honest:
            for key in fresh_keys:
                assert peer.table.get(key) is None, (peer.index, key)
            for signed in peer.table.records():
                assert signed.data not in forged_data, (peer.index, signed.key)
            assert peer.table.get(latest.key).timestamp >= latest.timestamp
            assert peer.table.model(MODEL).fingerprints == fps

    spread = [sim.watch(holds(s.key, s.timestamp), honest) for s in (control, planted_control)]
    started = sim.now
    while sim.now - started < SPREAD_ROUNDS * CONFIG.period + 5.0:
        sim.run_for(0.1)
        clean()
    assert all(w.done for w in spread), [len(w.left) for w in spread]
    assert max(w.seconds for w in spread) <= SPREAD_ROUNDS * CONFIG.period, [w.seconds for w in spread]

    expected = {}
    for _, _, reason in forged.values():
        expected[reason] = expected.get(reason, 0) + 1
    got = {reason: honest_to.table.rejected[reason] for reason in expected}
    assert all(got[r] >= n for r, n in expected.items()), (got, expected)
    # The compromised peer's gossip is refused by the peers it reaches, for the same reasons.
    elsewhere = sum((p.table.rejected for p in honest if p is not honest_to), start=Counter())
    for reason in ("bad_signature", "wrong_swarm", "fingerprint_mismatch"):
        assert elsewhere[reason] > 0, dict(elsewhere)
