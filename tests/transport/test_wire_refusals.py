"""What a wire-v2 receiver refuses (:mod:`shoal.wire.messages`): each rejection reason of a frame or
header, older and other versions told both versions, extra bytes, unknown codecs; metadata that
does not validate is a bad request naming the field and the stream goes on; a header holds no
memory until its data arrives, and a sender refuses what it cannot send. What arrives intact (and
an oversized message refused): ``test_wire.py``."""

from __future__ import annotations

import struct
import tracemalloc

import msgpack
import pytest
import torch

from shoal.errors import BadRequest, MessageTooLarge, WireError
from shoal.wire import (
    FRAME_DATA,
    FRAME_HEAD,
    FRAME_PREFIX,
    Assembler,
    InvalidMessage,
    Limits,
    Message,
    encode,
    parse_prefix,
)
from shoal.wire.schema import ErrorReply, Ping

pytestmark = pytest.mark.timeout(60)


# ---- what a receiver refuses ---------------------------------------------------------------------
def head_frame(header: dict | bytes) -> bytes:
    payload = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    return FRAME_PREFIX.pack(len(payload) + 1, FRAME_HEAD) + payload


def good_header(**changes) -> dict:
    header = {"v": 2, "k": "ping", "id": 1, "m": {}, "t": [["f32", [2], "raw"]], "n": 8}
    header.update(changes)
    return header


def v1_header() -> dict:
    """What a wire-version-1 peer sends: untyped metadata, ``[dtype, shape]`` descriptors."""
    return {"v": 1, "k": "ping", "id": 1, "m": {"x": 1}, "t": [["f32", [2]]], "n": 8}


def feed_frames(frames: list[bytes], limits: Limits = Limits()) -> list[Message]:
    assembler, out = Assembler(limits), []
    for frame in frames:
        frame_type, size = parse_prefix(frame[:5], limits)
        message = assembler.feed(frame_type, frame[5 : 5 + size])
        if message is not None:
            out.append(message)
    return out


DATA8 = struct.pack(">IB", 9, FRAME_DATA) + bytes(8)


BAD = {
    "frame_too_large": [struct.pack(">IB", 2**31, FRAME_DATA)],
    "bad_frame": [struct.pack(">IB", 0, FRAME_HEAD)],
    "bad_frame_type": [struct.pack(">IB", 1, 9)],
    "unexpected_frame": [struct.pack(">IB", 3, FRAME_DATA) + b"ab"],
    "bad_header": [head_frame(b"\xc1\xc1")],
    "bad_version": [head_frame(v1_header())],
    "unknown_kind": [head_frame(good_header(k="teleport"))],
    "bad_tensor": [head_frame(good_header(t=[["f32"]]))],
    "unknown_dtype": [head_frame(good_header(t=[["complex64", [2], "raw"]]))],
    "unknown_codec": [head_frame(good_header(t=[["f32", [2], "zstd"]]))],
    "bad_shape": [head_frame(good_header(t=[["f32", [-1], "raw"]]))],
    "size_mismatch": [head_frame(good_header(n=9))],
    "message_too_large": [head_frame(good_header(t=[["f32", [2**30], "raw"]], n=2**32))],
    "header_too_large": [head_frame(good_header(m={"x": "y" * 70000}))],
}


@pytest.mark.parametrize("reason", sorted(BAD))
def test_each_rejection_reason(reason):
    with pytest.raises(WireError) as info:
        feed_frames(BAD[reason])
    assert info.value.reason == reason


def test_a_v1_peer_is_told_both_versions():
    for header in (v1_header(), {"v": 1, "k": "info", "id": 1, "m": {}, "t": [], "n": 0}):
        with pytest.raises(WireError, match="peer speaks wire version 1, this peer speaks 2") as caught:
            feed_frames([head_frame(header)])
        assert caught.value.reason == "bad_version"
    with pytest.raises(WireError, match="wire version 3, this peer speaks 2"):
        feed_frames([head_frame(good_header(v=3))])


def test_a_header_of_another_shape_is_still_told_its_version():
    with pytest.raises(WireError, match="peer speaks wire version 1, this peer speaks 2") as caught:
        feed_frames([head_frame({"v": 1, "k": "info", "id": "one"})])
    assert caught.value.reason == "bad_version"


def test_unknown_codec_names_what_this_peer_knows():
    with pytest.raises(WireError, match=r"tensor codec 'zstd' \(this peer knows: bf16, fp16, q8, raw\)"):
        feed_frames([head_frame(good_header(t=[["f32", [2], "zstd"]]))])


def test_extra_data_bytes_are_rejected():
    frames = [head_frame(good_header()), struct.pack(">IB", 13, FRAME_DATA) + bytes(12)]
    with pytest.raises(WireError, match="size_mismatch"):
        feed_frames(frames)


@pytest.mark.parametrize(
    "header, reason",
    [
        (good_header(id=-1), "bad_header"),
        (good_header(id=True), "bad_header"),
        (good_header(id=2**63), "bad_header"),
        ([1, 2, 3], "bad_header"),
        ({"v": 2}, "bad_header"),
        (good_header(extra=1), "bad_header"),
        (good_header(t=[["f32", [2]]]), "bad_tensor"),  # a v1 descriptor in a v2 header
        (good_header(t=[["f32", [1.5], "raw"]]), "bad_tensor"),
        (good_header(t=[["f32", [1] * 9, "raw"]], n=4), "bad_shape"),
        (good_header(t=[["f32", [0], "raw"]] * 65, n=0), "bad_tensor"),
    ],
)
def test_more_checks_of_header_fields(header, reason):
    with pytest.raises(WireError) as caught:
        feed_frames([head_frame(header)])
    assert caught.value.reason == reason


# ---- metadata that does not validate: a bad request, the stream goes on --------------------------
INVALID = [
    ("ping", {"echo": "yes"}, "Expected `bool`, got `str` - at `$.echo`"),
    ("ping", {"echo": True, "x": 1}, "unknown field `x`"),
    ("ping", [1], "Expected `object`, got `array`"),
    ("info", {"a": {"b": {"c": 1}}}, "unknown field `a`"),
    ("open", {"batch_size": 2}, "missing required field `max_length`"),
    ("open", {"max_length": 0}, "Expected `int` >= 1 - at `$.max_length`"),
    ("step", {"session": "s", "position": -1}, "Expected `int` >= 0 - at `$.position`"),
    ("step", {"session": "s", "position": 0, "push": [["t", 5, "k"]]}, "at `$.push[0][1]`"),
    ("push", {"session": "s", "token": "k", "position": 0, "step": 2**32}, "at `$.step`"),
    ("gossip", {"op": "x" * 33}, "Expected `str` of length <= 32 - at `$.op`"),
    ("error", {"code": "busy"}, "missing required field `message`"),
]


@pytest.mark.parametrize("kind, meta, names", INVALID, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(INVALID)])
def test_invalid_metadata_is_a_bad_request_naming_the_field(kind, meta, names):
    carries = Limits().max_bytes_of(kind) > 0
    frames = (
        [head_frame(good_header(k=kind, id=77, m=meta)), DATA8]
        if carries
        else [head_frame(good_header(k=kind, id=77, m=meta, t=[], n=0))]
    )
    with pytest.raises(InvalidMessage) as caught:
        feed_frames(frames)
    error = caught.value
    assert isinstance(error, BadRequest) and not isinstance(error, WireError)
    assert (error.request_id, error.kind, error.code) == (77, kind, "bad_request")
    assert error.remote_message.startswith(f"invalid {kind} metadata: ") and names in error.remote_message


@pytest.mark.parametrize("tensors", [[], [["f32", [2], "raw"]]], ids=["no-data", "with-data"])
def test_after_invalid_metadata_the_assembler_takes_the_next_message(tensors):
    assembler = Assembler()
    bad = [head_frame(good_header(m={"echo": 1}, t=tensors, n=8 * len(tensors)))] + [DATA8] * len(tensors)
    with pytest.raises(InvalidMessage):
        for frame in bad:
            assembler.feed(frame[4], frame[5:])
    assert not assembler.mid_message
    good = encode(Message("ping", 2, Ping(), [torch.arange(2.0)]))
    out = [assembler.feed(f[4], f[5:]) for f in good][-1]
    assert out is not None and (out.id, out.meta) == (2, Ping()) and torch.equal(out.tensors[0], torch.arange(2.0))


def test_a_header_holds_no_memory_until_its_data_arrives():
    """64 assemblers each take a header declaring 64 MiB (and no data): they hold almost nothing
    (a reservation up front held 4 GiB); the data, in uneven frames, still makes the message."""
    declared = 64 << 20
    header = head_frame(good_header(t=[["f32", [declared // 4], "raw"]], n=declared))
    tracemalloc.start()
    try:
        assemblers = [Assembler(Limits(max_ping_bytes=declared)) for _ in range(64)]
        for assembler in assemblers:
            assert assembler.feed(header[4], header[5:]) is None and assembler.mid_message
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 1 << 20, f"64 headers hold {held} bytes"
    values = torch.arange(6.0)
    frames = encode(Message("ping", 3, Ping(), [values]))
    data = frames[1][5:]
    assembler = Assembler()
    assert assembler.feed(frames[0][4], frames[0][5:]) is None
    assert assembler.feed(FRAME_DATA, data[:5]) is None and assembler.mid_message
    out = assembler.feed(FRAME_DATA, data[5:])
    assert out is not None and torch.equal(out.tensors[0], values) and not assembler.mid_message


def test_sender_refuses_unknown_kind_dtype_and_oversized_header():
    with pytest.raises(WireError, match="unknown_kind"):
        encode(Message("nope"))
    with pytest.raises(WireError, match="unknown_dtype"):
        encode(Message("ping", 0, Ping(), [torch.zeros(2, dtype=torch.complex64)]))
    with pytest.raises(MessageTooLarge, match="header_too_large"):
        encode(Message("error", 0, ErrorReply(code="internal", message="y" * 70_000)))
