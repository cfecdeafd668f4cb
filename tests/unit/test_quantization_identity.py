"""A quantised server's identity and who routes over it (pure: no weights, no network): the quality
order, the record's optional 18th field, ``SpanInfo``, and the route planner's ``min_quality``."""

from __future__ import annotations

import time

import msgpack
import msgspec
import pytest

from shoal.errors import UsageError
from shoal.ids import BlockRange, PeerId
from shoal.quantization import DEFAULT_MIN_QUALITY, Quantization, parse_min_quality, parse_quantization
from shoal.routing import BanList, NoRouteError, RouteInfo, ServerSpan, route_with_bans
from shoal.swarm.records import SIGNING_CONTEXT, RecordError, ServerRecord, State, decode, sign
from shoal.transport.identity import generate_key
from shoal.wire.schema import SpanInfo

NONE, INT8, NF4 = Quantization.NONE, Quantization.INT8, Quantization.NF4


def test_quality_order_and_names():
    assert [q for q in Quantization if q.satisfies(DEFAULT_MIN_QUALITY)] == [NONE, Quantization.GGUF, INT8]
    assert NONE.satisfies(NONE) and not INT8.satisfies(NONE) and NF4.satisfies(NF4) and not NF4.satisfies(INT8)
    for name in ("fp32", "bf16", "FP16", "float32", "none"):
        assert parse_min_quality(name) is NONE  # the serving dtypes rank equal
    assert parse_min_quality("int8") is INT8 and parse_min_quality(NF4) is NF4
    assert parse_quantization("INT8") is INT8
    with pytest.raises(UsageError, match="unknown min_quality 'int3'; choose one of fp32, bf16, fp16, gguf, int8, nf4"):
        parse_min_quality("int3")
    with pytest.raises(UsageError, match="unknown quantisation 'fp32'; choose one of none, gguf, int8, nf4"):
        parse_quantization("fp32")


# ---- the record ----------------------------------------------------------------------------------


def _record(key: bytes, quantization: Quantization) -> ServerRecord:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    peer = Ed25519PrivateKey.from_private_bytes(key).public_key().public_bytes_raw().hex()
    now = time.time()
    return ServerRecord(
        swarm="s1", peer=peer, addrs=("127.0.0.1:1",), relay=None, model="m", blocks=BlockRange(0, 2),
        fingerprints=(b"\1" * 32, b"\2" * 32), state=State.ONLINE, throughput=5.0, cache_tokens_free=100,
        rtts=(), version="0.1.0", timestamp=now, expires=now + 60, step_ms=1.5, capabilities=("push",),
        quantization=quantization,
    )  # fmt: skip


def _signed_fields(key: bytes, fields: list) -> bytes:
    """A record body as a peer of another version would sign it: ``fields`` after the tag."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    body = msgpack.packb([ServerRecord.TAG, 1, *fields], use_bin_type=True)
    signature = Ed25519PrivateKey.from_private_bytes(key).sign(SIGNING_CONTEXT + body)
    return msgpack.packb([body, signature], use_bin_type=True)


def test_a_quantised_record_round_trips_and_a_full_precision_one_keeps_17_fields():
    key = generate_key()
    for quantization in Quantization:
        record = _record(key, quantization)
        assert decode(sign(record, key).data).record == record
    assert len(_record(key, NONE).fields()) == 17  # what every earlier peer reads
    assert _record(key, NF4).fields()[17] == "nf4"


def test_records_of_earlier_peers_read_as_full_precision_and_bad_formats_are_refused():
    key = generate_key()
    fields = _record(key, NONE).fields()
    for count in (15, 16, 17):  # before step_ms, before capabilities, before quantization
        assert decode(_signed_fields(key, fields[:count])).record.quantization is NONE
    assert decode(_signed_fields(key, [*fields, "int8"])).record.quantization is INT8
    for bad in ("int3", "none", 8, None):  # "none" is never sent: a full-precision record has 17 fields
        with pytest.raises(RecordError, match="malformed: quantization"):
            decode(_signed_fields(key, [*fields, bad]))


def test_span_info_says_its_quantization_only_when_quantised():
    info = SpanInfo(
        model="m", num_blocks=4, blocks=BlockRange(0, 2), fingerprints=["a", "b"], dtype="float32",
        hidden_size=64, version="0.1.0",
    )  # fmt: skip
    assert b"quantization" not in msgspec.msgpack.encode(info)
    quantised = msgspec.structs.replace(info, quantization=NF4)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(quantised), type=SpanInfo).quantization is NF4
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({**msgspec.structs.asdict(info), "quantization": "q2"}), type=SpanInfo
        )


# ---- routing -------------------------------------------------------------------------------------


def span(peer: str, start: int, end: int, quantization: Quantization = NONE) -> ServerSpan:
    return ServerSpan(PeerId(peer), BlockRange(start, end), None, RouteInfo(quantization=quantization))


def cheapest_first(order: list[str]):
    return lambda s, previous: 1.0 + order.index(s.peer_id)


def test_the_default_route_avoids_nf4_even_when_it_is_cheaper():
    spans = [span("nf4", 0, 4, NF4), span("fp32", 0, 4), span("int8", 4, 8, INT8), span("nf4-b", 4, 8, NF4)]
    cost = cheapest_first(["nf4", "nf4-b", "int8", "fp32"])
    route = route_with_bans(spans, 0, 8, cost, BanList())
    assert [s.peer_id for s in route] == ["fp32", "int8"]
    assert [s.peer_id for s in route_with_bans(spans, 0, 8, cost, BanList(), min_quality=NF4)] == ["nf4", "nf4-b"]
    with pytest.raises(NoRouteError, match="blocks 4-7 are served only in int8, nf4, below min_quality none"):
        route_with_bans(spans, 0, 8, cost, BanList(), min_quality=NONE)


def test_bans_never_lift_the_quality_bar():
    bans = BanList()
    bans.ban("fp32")
    spans = [span("fp32", 0, 4), span("nf4", 0, 4, NF4)]
    route = route_with_bans(spans, 0, 4, cheapest_first(["nf4", "fp32"]), bans)  # banned, but the only one good enough
    assert [s.peer_id for s in route] == ["fp32"]
    with pytest.raises(NoRouteError, match=r"served only in nf4, below min_quality int8 \(min_quality='nf4' accepts"):
        route_with_bans(spans, 0, 4, cheapest_first(["nf4", "fp32"]), bans, exclude={"fp32"})
