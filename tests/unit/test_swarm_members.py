"""Swarm ids that pin a model and name an owner (shoal.swarm.swarmid), member certificates and the
decision over them (shoal.swarm.members), and what a table of a pinned or private swarm admits
(shoal.swarm.table): pure, no network."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from shoal.errors import UsageError
from shoal.ids import BlockRange
from shoal.swarm.members import (
    MembershipError,
    certificate_text,
    issue,
    parse_certificate,
    public_key,
    read_certificate,
    refusal,
)
from shoal.swarm.records import ModelRecord, RevocationRecord, ServerRecord, State, decode, sign
from shoal.swarm.swarmid import SwarmId, model_digest, new_swarm_id, owner_tag, parse_swarm_id
from shoal.swarm.table import RecordTable

NOW = 1_000_000.0
OWNER = bytes(range(32))
ALICE, BOB, MALLORY = (bytes([i]) * 32 for i in (7, 8, 9))
MODEL, BLOCKS = "tiny", 4
FPS = tuple(bytes([i]) * 32 for i in range(BLOCKS))
PIN = model_digest(MODEL, BLOCKS, FPS)
PRIVATE = str(SwarmId("abc", pin=PIN, owner=owner_tag(public_key(OWNER))))


def cert(key: bytes, **kwargs) -> bytes:
    return issue(OWNER, public_key(key), now=NOW, **kwargs)


def model_record(swarm: str, key: bytes, fps=FPS, at: float = NOW) -> ModelRecord:
    return ModelRecord(swarm, public_key(key), MODEL, len(fps), tuple(fps), at, at + 60)


def server_record(swarm: str, key: bytes, fps=FPS[:2], at: float = NOW) -> ServerRecord:
    return ServerRecord(
        swarm, public_key(key), ("127.0.0.1:1",), None, MODEL, BlockRange(0, len(fps)), tuple(fps), State.ONLINE,
        10.0, 100, (), "test", at, at + 60,
    )  # fmt: skip


def table(swarm: str) -> RecordTable:
    return RecordTable(swarm, clock=lambda: NOW + 1)


# ---- swarm ids -----------------------------------------------------------------------------------
def test_swarm_ids_round_trip_and_old_ids_stay_public_and_unpinned():
    assert parse_swarm_id("verdict-spread") == SwarmId("verdict-spread")
    assert parse_swarm_id("0123456789abcdef") == SwarmId("0123456789abcdef")
    swarm = parse_swarm_id(PRIVATE)
    assert (swarm.pin, swarm.owner, swarm.private, str(swarm)) == (PIN, owner_tag(public_key(OWNER)), True, PRIVATE)
    fresh = new_swarm_id(PIN, swarm.owner)
    assert len(fresh) <= 64 and parse_swarm_id(fresh).pin == PIN and parse_swarm_id(fresh).owner == swarm.owner
    for bad in ("x~mnothex", f"x~m{PIN}~m{PIN}", "~m" + PIN, f"x~q{PIN}"):
        with pytest.raises(UsageError):
            parse_swarm_id(bad)


def test_the_digest_covers_name_block_count_and_every_fingerprint():
    assert model_digest("other", BLOCKS, FPS) != PIN
    assert model_digest(MODEL, BLOCKS, (*FPS[:3], bytes(32))) != PIN
    assert model_digest(MODEL, BLOCKS, list(FPS)) == PIN and len(PIN) == 24


# ---- the pin -------------------------------------------------------------------------------------
@pytest.mark.parametrize("honest_first", [False, True])
def test_a_pinned_table_refuses_any_other_model_record_whenever_it_comes(honest_first):
    swarm = str(SwarmId("pinned", pin=PIN))
    t = table(swarm)
    forged = sign(model_record(swarm, MALLORY, fps=[os.urandom(32) for _ in FPS]), MALLORY)
    honest = sign(model_record(swarm, ALICE), ALICE)
    order = [honest, forged] if honest_first else [forged, honest]
    assert [t.merge(s.data) for s in order] == ([True, False] if honest_first else [False, True])
    assert t.model(MODEL).fingerprints == FPS
    reason = "fingerprint_mismatch" if honest_first else "model_pin"
    assert t.rejected[reason] == 1, t.rejected
    # another name is refused too: the pin names a digest, not a model
    renamed = ModelRecord(swarm, public_key(MALLORY), "tiny-2", BLOCKS, FPS, NOW, NOW + 60)
    assert not t.merge(sign(renamed, MALLORY).data) and t.rejected["model_pin"] == 1 + (not honest_first)


@pytest.mark.parametrize("first", ["forged", "honest"])
def test_a_pin_with_the_manifest_takes_that_manifest_alone_whenever_a_record_comes(first):
    """The founder's chunk manifest is pinned with its fingerprints: a record with the right
    fingerprints and another manifest (other config or tokenizer files) never defines the model, even
    where it comes first (a new member's table, or after the founder's record expired)."""
    manifest, other = bytes([1]) * 32, bytes([2]) * 32
    swarm = str(SwarmId("pinned", pin=model_digest(MODEL, BLOCKS, FPS, manifest)))
    assert model_digest(MODEL, BLOCKS, FPS, manifest) not in (PIN, model_digest(MODEL, BLOCKS, FPS, other))
    t = table(swarm)
    forged = sign(replace(model_record(swarm, MALLORY), manifest=other), MALLORY)
    bare = sign(model_record(swarm, BOB), BOB)  # no manifest: the pin names one
    honest = sign(replace(model_record(swarm, ALICE), manifest=manifest), ALICE)
    order = [forged, bare, honest] if first == "forged" else [honest, forged, bare]
    assert [t.merge(s.data) for s in order] == ([False, False, True] if first == "forged" else [True, False, False])
    assert t.model(MODEL).manifest == manifest
    assert t.rejected["model_pin"] == (2 if first == "forged" else 0), t.rejected
    # a pin without a manifest (as before manifests) takes any: the first record's stands
    loose = str(SwarmId("loose", pin=PIN))
    t = table(loose)
    assert t.merge(sign(replace(model_record(loose, MALLORY), manifest=other), MALLORY).data)
    assert not t.merge(sign(replace(model_record(loose, ALICE, at=NOW + 0.5), manifest=manifest), ALICE).data)
    assert t.model(MODEL).manifest == other and t.rejected["manifest_mismatch"] == 1


def test_squatting_servers_are_dropped_once_the_pinned_record_comes_and_refused_after():
    swarm = str(SwarmId("pinned", pin=PIN))
    t = table(swarm)
    forged_fps = [os.urandom(32) for _ in FPS]
    assert not t.merge(sign(model_record(swarm, MALLORY, fps=forged_fps), MALLORY).data)
    assert t.merge(sign(server_record(swarm, MALLORY, fps=forged_fps[:2]), MALLORY).data)  # nothing to check yet
    assert t.merge(sign(server_record(swarm, BOB), BOB).data)
    assert t.merge(sign(model_record(swarm, ALICE), ALICE).data)
    assert [r.peer for r in t.servers(MODEL)] == [public_key(BOB)]
    later = sign(server_record(swarm, MALLORY, fps=forged_fps[:2], at=NOW + 0.5), MALLORY)
    assert not t.merge(later.data) and t.rejected["fingerprint_mismatch"] == 2


def test_an_unpinned_table_is_still_first_come():
    """What the pin fixes: without it, the first model record defines the model."""
    t = table("old-swarm")
    assert t.merge(sign(model_record("old-swarm", MALLORY, fps=[os.urandom(32) for _ in FPS]), MALLORY).data)
    assert not t.merge(sign(model_record("old-swarm", ALICE), ALICE).data)
    assert not t.merge(sign(server_record("old-swarm", BOB), BOB).data)


# ---- certificates ----------------------------------------------------------------------------------
def test_a_certificate_round_trips_as_text_and_tampering_is_caught():
    data = cert(ALICE, expires=NOW + 100, servers_only=True)
    assert parse_certificate(certificate_text(data)) == data
    c = read_certificate(data)
    assert (c.owner, c.member, c.servers_only, c.expires) == (public_key(OWNER), public_key(ALICE), True, NOW + 100)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    with pytest.raises(MembershipError, match="not signed by the owner"):
        read_certificate(bytes(flipped))
    with pytest.raises(MembershipError, match="not a shoal member certificate"):
        parse_certificate("shoal1abc")
    with pytest.raises(MembershipError, match="peer id"):
        issue(OWNER, "alice", now=NOW)


def test_refusal_is_none_for_members_and_says_why_for_everyone_else():
    swarm = parse_swarm_id(PRIVATE)
    alice = public_key(ALICE)
    assert refusal(cert(ALICE), alice, swarm, NOW) is None
    assert refusal(None, alice, SwarmId("public"), NOW) is None  # public: anyone
    assert refusal(None, public_key(OWNER), swarm, NOW) is None  # the owner's own node
    other_owner = issue(MALLORY, alice, now=NOW)
    cases = {
        "presented no certificate": refusal(None, alice, swarm, NOW),
        "bad certificate": refusal(b"junk", alice, swarm, NOW),
        "for another swarm": refusal(other_owner, alice, swarm, NOW),
        f"certificate of peer {public_key(BOB)[:10]}": refusal(cert(BOB), alice, swarm, NOW),
        "expired 1 s ago": refusal(cert(ALICE, expires=NOW - 1), alice, swarm, NOW),
        "revoked": refusal(cert(ALICE), alice, swarm, NOW, {alice}),
        "may only serve": refusal(cert(ALICE, servers_only=True), alice, swarm, NOW, serving=False),
    }
    for expected, got in cases.items():
        assert got is not None and expected in got, (expected, got)
    assert refusal(cert(ALICE, servers_only=True), alice, swarm, NOW, serving=True) is None
    assert refusal(cert(ALICE, expires=NOW + 1), alice, swarm, NOW) is None


# ---- a private swarm's table -----------------------------------------------------------------------
def test_a_private_table_admits_only_members_records():
    t = table(PRIVATE)
    assert not t.merge(sign(server_record(PRIVATE, MALLORY), MALLORY).data)
    assert not t.merge(sign(server_record(PRIVATE, MALLORY), MALLORY, cert(ALICE)).data)  # someone else's
    assert not t.merge(sign(server_record(PRIVATE, BOB), BOB, cert(BOB, expires=NOW - 5)).data)
    assert t.rejected["not_member"] == 3
    signed = sign(model_record(PRIVATE, ALICE), ALICE, cert(ALICE))
    assert decode(signed.data).cert == cert(ALICE)  # the certificate travels with the record
    assert t.merge(signed.data) and t.merge(sign(server_record(PRIVATE, BOB), BOB, cert(BOB)).data)
    # a member's model record is still held to the pin
    forged = model_record(PRIVATE, BOB, fps=[os.urandom(32) for _ in FPS], at=NOW + 0.5)
    assert not t.merge(sign(forged, BOB, cert(BOB)).data)


def test_only_the_owner_revokes_and_a_revocation_drops_the_members_records():
    t = table(PRIVATE)
    assert t.merge(sign(server_record(PRIVATE, BOB), BOB, cert(BOB)).data)
    bob = public_key(BOB)
    by_mallory = RevocationRecord(PRIVATE, public_key(MALLORY), bob, NOW, NOW + 86400 * 30)
    assert not t.merge(sign(by_mallory, MALLORY).data) and t.rejected["not_owner"] == 1
    public = RevocationRecord("public", public_key(OWNER), bob, NOW, NOW + 60)
    assert not RecordTable("public", clock=lambda: NOW).merge(sign(public, OWNER).data)
    revocation = sign(RevocationRecord(PRIVATE, public_key(OWNER), bob, NOW, NOW + 86400 * 30), OWNER)
    assert t.merge(revocation.data)  # a long life: it must outlive the certificate
    assert t.servers() == [] and bob in t.revoked
    assert not t.merge(sign(server_record(PRIVATE, BOB, at=NOW + 0.5), BOB, cert(BOB)).data)
    assert "revoked" in refusal(cert(BOB), bob, t.id, NOW, t.revoked)


def test_in_a_private_swarm_the_owner_adds_models_beside_the_pinned_one():
    t = table(PRIVATE)
    other = tuple(bytes([9 - i]) * 32 for i in range(6))
    by_member = ModelRecord(PRIVATE, public_key(BOB), "second", 6, other, NOW, NOW + 60)
    assert not t.merge(sign(by_member, BOB, cert(BOB)).data) and t.rejected["model_pin"] == 1
    long_lived = ModelRecord(PRIVATE, public_key(OWNER), "second", 6, other, NOW, NOW + 86400 * 90)
    assert t.merge(sign(long_lived, OWNER).data)  # the owner's: no pin, no certificate, a long life
    second = replace(server_record(PRIVATE, BOB, fps=other[:2]), model="second")
    assert t.merge(sign(second, BOB, cert(BOB)).data)  # checked against the owner's record
    wrong = replace(server_record(PRIVATE, ALICE, fps=FPS[:2]), model="second")
    assert not t.merge(sign(wrong, ALICE, cert(ALICE)).data) and t.rejected["fingerprint_mismatch"] == 1
    assert [(r.model, r.peer) for r in t.servers()] == [("second", public_key(BOB))]
    public = str(SwarmId("pub", pin=PIN))
    assert not table(public).merge(sign(ModelRecord(public, public_key(OWNER), "second", 6, other, NOW, NOW + 60),
                                        OWNER).data)  # fmt: skip
