"""A server record's queued steps (field 21): round trip, older records read as nothing queued,
bounds refused."""

from __future__ import annotations

import time

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.ids import BlockRange
from shoal.swarm.records import (
    MAX_QUEUED,
    MAX_RECORD_BYTES,
    SIGNING_CONTEXT,
    RecordError,
    ServerRecord,
    State,
    decode,
    sign,
)
from shoal.transport.identity import generate_key


def _record(key: bytes, **fields) -> ServerRecord:
    peer = Ed25519PrivateKey.from_private_bytes(key).public_key().public_bytes_raw().hex()
    now = time.time()
    return ServerRecord(
        swarm="s1", peer=peer, addrs=("127.0.0.1:1",), relay=None, model="m", blocks=BlockRange(0, 2),
        fingerprints=(b"\1" * 32, b"\2" * 32), state=State.ONLINE, throughput=5.0, cache_tokens_free=100,
        rtts=(), version="0.1.0", timestamp=now, expires=now + 60, step_ms=1.5, capabilities=("push",), **fields,
    )  # fmt: skip


def _signed_fields(key: bytes, fields: list) -> bytes:
    body = msgpack.packb([ServerRecord.TAG, 1, *fields], use_bin_type=True)
    signature = Ed25519PrivateKey.from_private_bytes(key).sign(SIGNING_CONTEXT + body)
    return msgpack.packb([body, signature], use_bin_type=True)


def test_queued_round_trips_and_an_idle_server_sends_the_fields_it_sent_before():
    key = generate_key()
    assert len(_record(key).fields()) == 17  # nothing queued: what earlier peers read
    assert len(_record(key, compute="bf16/cpu").fields()) == 20
    for fields in ({"queued": 7}, {"queued": 7, "compute": "bf16/cpu"}, {"queued": MAX_QUEUED}):
        record = _record(key, **fields)
        assert len(record.fields()) == 21
        signed = sign(record, key)
        assert decode(signed.data).record == record and len(signed.data) <= MAX_RECORD_BYTES
    assert _record(key, queued=7).fields()[17:] == ["none", [], "", 7]


def test_records_without_the_field_read_as_nothing_queued_and_bad_counts_are_refused():
    key = generate_key()
    fields = _record(key, compute="bf16/cpu").fields()
    assert decode(_signed_fields(key, fields)).record.queued == 0
    assert decode(_signed_fields(key, [*fields, 3])).record.queued == 3
    for bad in (0, -1, MAX_QUEUED + 1, 2.5, True, "3", None):  # 0 is never sent: an idle record has fewer fields
        with pytest.raises(RecordError, match="malformed: queued"):
            decode(_signed_fields(key, [*fields, bad]))
    blank = _record(key, queued=1).fields()
    with pytest.raises(RecordError, match="malformed: compute"):
        decode(_signed_fields(key, [*blank[:19], "bf16/zz", 1]))
    with pytest.raises(RecordError, match="malformed: compute"):
        decode(_signed_fields(key, blank[:20]))  # "" names no compute without a queue after it
