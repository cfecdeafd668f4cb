"""Wire format v2: exact round trips of tensors and of every kind's typed metadata, every rejection
reason of a frame, and metadata that fails validation (a request error, not a broken stream); in
memory, no I/O."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import torch

from shoal.errors import MessageTooLarge, WireError
from shoal.ids import BlockRange
from shoal.wire import (
    CAPABILITIES,
    CODECS,
    DTYPES,
    FRAME_HEAD,
    FRAME_PREFIX,
    KINDS,
    MAX_FRAME_PAYLOAD,
    WIRE_VERSION,
    Assembler,
    Codec,
    Limits,
    Message,
    encode,
    error_message,
    parse_prefix,
)
from shoal.wire.schema import (
    KIND_META,
    BackwardRequest,
    ChunkRequest,
    Empty,
    ErrorReply,
    EvidenceReply,
    EvidenceRequest,
    ForwardReply,
    ForwardRequest,
    Gossip,
    HeldRequest,
    Hello,
    HelloReply,
    InfoReply,
    ManifestRequest,
    Meta,
    MigratedReply,
    MigrateRequest,
    OpenReply,
    OpenRequest,
    PagesRequest,
    Ping,
    PushHop,
    PushRequest,
    Receipt,
    ServerCounters,
    SpanInfo,
    StepReply,
    StepRequest,
)
from shoal.wire.tensors import tensor_bytes

pytestmark = pytest.mark.timeout(60)

SHAPES = [(), (0,), (0, 3), (1,), (7,), (2, 3, 4), (1, 1, 1, 1, 5)]
HOP = PushHop(ticket="shoal1ticket", session="next-session", token="t0ken")
RECEIPT = Receipt(
    weights=b"w" * 16, start=2, end=4, session="s-1", position=17, n=1, step=9, inputs=b"i" * 16, outputs=b"o" * 16,
    codec=Codec.BF16, adapter=b"a" * 16, prompts=False, state=b"c" * 16, compute="bf16/cuda", signature=b"s" * 64,
)  # fmt: skip

#: One metadata value of every kind a peer sends (``result`` carries a reply struct: see REPLIES).
REQUESTS: dict[str, Meta] = {
    "hello": Hello(),
    "ping": Ping(echo=False),
    "info": Empty(),
    "forward": ForwardRequest(prompts=True, adapter="style-v1", receipt=True),
    "backward": BackwardRequest(adapter="a.b_c-2"),
    "open": OpenRequest(max_length=128, batch_size=3, prompts=True, adapter="style-v1"),
    "step": StepRequest(session="s-1", position=17, push=(HOP, PushHop("t2", "s2", "k2")), receipt=True),
    "push": PushRequest(session="s-2", token="k", position=4, step=9, push=(HOP,), receipt=True),
    "close": Empty(),
    "evidence": EvidenceRequest(model="m", accused="ab" * 32, start=2, end=4, steps=3),
    "migrate": MigrateRequest(session="s-1", position=40, step=12, to=HOP),
    "pages": PagesRequest(
        session="s-2",
        token="k",
        position=40,
        step=12,
        model="m",
        blocks=BlockRange(2, 4),
        weights=bytes(16),
        dtype="float32",
        adapter="style-v1",
    ),
    "gossip": Gossip(op="table"),
    "manifest": ManifestRequest(model="m"),
    "chunk": ChunkRequest(manifest="cd" * 32, item=7, chunk=2),
    "held": HeldRequest(manifest="ef" * 32),
    "error": ErrorReply(code="wire", message="bad frame", reason="bad_frame"),
}
REPLIES: list[Meta] = [
    HelloReply(protocols=["shoal/meta/1", "shoal/blocks/2"], capabilities=CAPABILITIES),
    InfoReply(
        span=SpanInfo(
            model="tiny",
            num_blocks=4,
            blocks=BlockRange(1, 3),
            fingerprints=["ab", "cd"],
            dtype="float32",
            hidden_size=64,
            version="0.1",
        ),
        free_cache_tokens=256,
        draining=True,
        counters=ServerCounters(steps=5, step_seconds=0.25),
    ),
    OpenReply(session="s-1", token="k", max_length=128),
    StepReply(position=18, pushed=True),
    StepReply(position=18, receipt=RECEIPT),
    ForwardReply(receipt=msgspec.structs.replace(RECEIPT, session="", position=0)),
    ForwardReply(),
    EvidenceReply(confirmed=True),
    EvidenceReply(confirmed=False, reason="framing", detail="recomputed outputs agree"),
    MigratedReply(position=40, state=bytes(range(16))),
    Empty(),
]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g, dtype=torch.int64).to(
        dtype
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(tensor_bytes(a)) == bytes(tensor_bytes(b))


def roundtrip(message: Message, limits: Limits = Limits()) -> Message:
    assembler, result = Assembler(limits), None
    for frame in encode(message, limits):
        frame_type, size = parse_prefix(frame[: FRAME_PREFIX.size], limits)
        assert size == len(frame) - FRAME_PREFIX.size
        assert size <= limits.max_frame_bytes
        out = assembler.feed(frame_type, frame[FRAME_PREFIX.size :])
        if out is not None:
            assert result is None
            result = out
    assert result is not None and not assembler.mid_message
    return result


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_dtype_and_shape_survives_bit_for_bit(dtype):
    tensors = [sample(dtype, s, i) for i, s in enumerate(SHAPES)]
    if dtype.is_floating_point:
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0]).to(dtype)
        tensors.append(special)
    out = roundtrip(Message("step", 42, REQUESTS["step"], tensors))
    assert out.kind == "step" and out.id == 42
    assert out.meta == REQUESTS["step"] and isinstance(out.meta, StepRequest)
    assert all(same_bits(a, b) for a, b in zip(tensors, out.tensors, strict=True))


def test_the_samples_cover_every_kind():
    """A new kind needs a sample here (and so a round trip below)."""
    assert set(REQUESTS) | {"result"} == KINDS == set(KIND_META)
    assert all(type(meta) is KIND_META[kind] for kind, meta in REQUESTS.items())


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_every_kinds_metadata_arrives_as_its_struct(kind):
    carries = Limits().max_bytes_of(kind) > 0  # hello, info, close and error carry no tensors
    out = roundtrip(Message(kind, 7, REQUESTS[kind], [torch.arange(3)] if carries else []))
    assert (out.kind, out.id, out.meta) == (kind, 7, REQUESTS[kind])
    assert type(out.meta) is KIND_META[kind]
    assert torch.equal(out.tensors[0], torch.arange(3)) if carries else out.tensors == []


@pytest.mark.parametrize("kind", ["hello", "info", "close", "error"])
def test_a_kind_without_tensors_that_declares_some_is_refused_at_its_header(kind):
    """Per-kind limits: a control message cannot be a vehicle for a large body."""
    first = encode(Message(kind, 7, REQUESTS[kind], [torch.arange(3)]))[0]
    with pytest.raises(MessageTooLarge, match=rf"a {kind} message of 24 > 0 bytes"):
        Assembler().feed(FRAME_HEAD, first[FRAME_PREFIX.size :])


def test_a_ping_or_gossip_is_capped_below_the_message_limit():
    limits = Limits(max_ping_bytes=1000, max_gossip_bytes=2000)
    assert (limits.max_bytes_of("ping"), limits.max_bytes_of("gossip")) == (1000, 2000)
    assert limits.max_bytes_of("step") == limits.max_message_bytes
    first = encode(Message("ping", 1, REQUESTS["ping"], [torch.zeros(1001, dtype=torch.uint8)]))[0]
    with pytest.raises(MessageTooLarge, match="a ping message of 1001 > 1000 bytes"):
        Assembler(limits).feed(FRAME_HEAD, first[FRAME_PREFIX.size :])


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_a_result_stays_raw_until_the_requester_decodes_it(reply):
    out = roundtrip(Message("result", 5, reply))
    assert isinstance(out.meta, msgspec.Raw)
    assert out.reply(type(reply)) == reply
    assert out.reply(type(reply)) is out.meta  # decoded once, then kept


def test_a_result_that_does_not_fit_the_request_is_the_peers_fault():
    out = roundtrip(Message("result", 5, StepReply(position=3)))
    with pytest.raises(WireError, match="OpenReply: Object contains unknown field `position`") as caught:
        out.reply(OpenReply)
    assert caught.value.reason == "bad_reply"
    bad = roundtrip(Message("result", 6, msgspec.Raw(msgpack.packb({"position": -1}))))
    with pytest.raises(WireError, match=r"StepReply: .*`\$\.position`") as caught:
        bad.reply(StepReply)
    assert caught.value.reason == "bad_reply"
    typed = Message("result", 7, StepReply(position=1))  # never went over the wire: already typed
    with pytest.raises(WireError, match="expected OpenReply metadata, got StepReply"):
        typed.reply(OpenReply)


def test_error_replies_carry_code_message_and_reason():
    out = roundtrip(error_message(9, "wire", "x" * 5000, reason="bad_frame"))
    assert out.meta == ErrorReply(code="wire", message="x" * 2000, reason="bad_frame")  # message capped
    assert out.error_info() == ("wire", "x" * 2000)
    assert roundtrip(error_message(1, "busy", "full")).error_info() == ("busy", "full")
    assert Message("error", 1, msgspec.Raw(msgpack.packb({"code": 1}))).error_info() == (
        "internal",
        "malformed error reply",
    )


def test_mixed_dtypes_at_unaligned_offsets_decode_to_usable_tensors():
    """Tensors follow each other in one buffer, so a float after 3 bools starts at an odd offset."""
    tensors = [
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.float32) + 0.5,
        torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        torch.arange(3, dtype=torch.int64),
        torch.tensor(7.0, dtype=torch.float16),
    ]
    received = roundtrip(Message("ping", 1, Ping(), tensors)).tensors
    assert all(same_bits(a, b) for a, b in zip(tensors, received, strict=True))
    assert received[1].data_ptr() % 4 != 0  # really unaligned, and still computes
    assert torch.equal(received[1] * 2, tensors[1] * 2) and torch.equal(received[2] + 1, tensors[2] + 1)


def test_tensor_larger_than_a_frame_is_chunked():
    big = sample(torch.float32, (MAX_FRAME_PAYLOAD // 4 * 2 + 123,))
    message = Message("step", 1, REQUESTS["step"], [sample(torch.int64, (3,)), big])
    assert len(encode(message)) == 4  # head + 3 data frames
    out = roundtrip(message)
    assert same_bits(out.tensors[1], big) and out.meta == REQUESTS["step"]


def test_non_contiguous_tensor_is_sent_as_its_values():
    t = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(roundtrip(Message("result", 0, Empty(), [t])).tensors[0], t)


def test_header_is_the_v2_map_with_dtype_shape_codec_descriptors():
    frame = encode(Message("ping", 3, Ping(echo=False), [torch.zeros(2, 3, dtype=torch.float16)]))[0]
    length, frame_type = FRAME_PREFIX.unpack(frame[:5])
    assert (length, frame_type) == (len(frame) - 4, FRAME_HEAD)
    header = msgpack.unpackb(frame[5:])
    assert header == {
        "v": WIRE_VERSION,
        "k": "ping",
        "id": 3,
        "m": {"echo": False},
        "t": [["f16", [2, 3], "raw"]],
        "n": 12,
    }
    assert WIRE_VERSION == 2 and set(CODECS) == {"raw", "bf16", "fp16", "q8"}


def test_oversized_message_refused_before_its_bytes_arrive():
    limits = Limits(max_message_bytes=1000)
    with pytest.raises(MessageTooLarge):
        roundtrip(Message("forward", 0, Empty(), [torch.zeros(1000)]), limits)
