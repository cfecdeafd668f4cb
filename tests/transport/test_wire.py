"""Wire format: exact round trips and every rejection reason, in memory."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from shoal.errors import MessageTooLarge, WireError
from shoal.wire import (
    DTYPES,
    FRAME_DATA,
    FRAME_HEAD,
    FRAME_PREFIX,
    MAX_FRAME_PAYLOAD,
    Assembler,
    Limits,
    Message,
    encode,
    parse_prefix,
)
from shoal.wire.tensors import tensor_bytes

pytestmark = pytest.mark.timeout(60)

SHAPES = [(), (0,), (0, 3), (1,), (7,), (2, 3, 4), (1, 1, 1, 1, 5)]


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
    out = roundtrip(Message("forward", 42, {"session": "abc", "n": [1, 2.5, None, True]}, tensors))
    assert out.kind == "forward" and out.id == 42
    assert out.meta == {"session": "abc", "n": [1, 2.5, None, True]}
    assert all(same_bits(a, b) for a, b in zip(tensors, out.tensors, strict=True))


def test_mixed_dtypes_at_unaligned_offsets_decode_to_usable_tensors():
    """Tensors follow each other in one buffer, so a float after 3 bools starts at an odd offset."""
    tensors = [
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.float32) + 0.5,
        torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        torch.arange(3, dtype=torch.int64),
        torch.tensor(7.0, dtype=torch.float16),
    ]
    received = roundtrip(Message("ping", 1, {}, tensors)).tensors
    assert all(same_bits(a, b) for a, b in zip(tensors, received, strict=True))
    assert received[1].data_ptr() % 4 != 0  # really unaligned, and still computes
    assert torch.equal(received[1] * 2, tensors[1] * 2) and torch.equal(received[2] + 1, tensors[2] + 1)


def test_tensor_larger_than_a_frame_is_chunked():
    big = sample(torch.float32, (MAX_FRAME_PAYLOAD // 4 * 2 + 123,))
    frames = list(encode(Message("step", 1, {}, [sample(torch.int64, (3,)), big])))
    assert len(frames) == 4  # head + 3 data frames
    out = roundtrip(Message("step", 1, {}, [sample(torch.int64, (3,)), big]))
    assert same_bits(out.tensors[1], big)


def test_non_contiguous_tensor_is_sent_as_its_values():
    t = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(roundtrip(Message("result", 0, {}, [t])).tensors[0], t)


def head_frame(header: dict | bytes) -> bytes:
    payload = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    return FRAME_PREFIX.pack(len(payload) + 1, FRAME_HEAD) + payload


def good_header(**changes) -> dict:
    header = {"v": 1, "k": "ping", "id": 1, "m": {}, "t": [["f32", [2]]], "n": 8}
    header.update(changes)
    return header


def feed_frames(frames: list[bytes], limits: Limits = Limits()) -> None:
    assembler = Assembler(limits)
    for frame in frames:
        frame_type, size = parse_prefix(frame[:5], limits)
        assembler.feed(frame_type, frame[5 : 5 + size])


BAD = {
    "frame_too_large": [struct.pack(">IB", 2**31, FRAME_DATA)],
    "bad_frame": [struct.pack(">IB", 0, FRAME_HEAD)],
    "bad_frame_type": [struct.pack(">IB", 1, 9)],
    "unexpected_frame": [struct.pack(">IB", 3, FRAME_DATA) + b"ab"],
    "bad_header": [head_frame(b"\xc1\xc1")],
    "bad_version": [head_frame(good_header(v=2))],
    "unknown_kind": [head_frame(good_header(k="teleport"))],
    "bad_meta": [head_frame(good_header(m={"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}))],
    "bad_tensor": [head_frame(good_header(t=[["f32"]]))],
    "unknown_dtype": [head_frame(good_header(t=[["complex64", [2]]]))],
    "bad_shape": [head_frame(good_header(t=[["f32", [-1]]]))],
    "size_mismatch": [head_frame(good_header(n=9))],
    "message_too_large": [head_frame(good_header(t=[["f32", [2**30]]], n=2**32))],
    "header_too_large": [head_frame(good_header(m={"x": "y" * 70000}))],
}


@pytest.mark.parametrize("reason", sorted(BAD))
def test_each_rejection_reason(reason):
    with pytest.raises(WireError) as info:
        feed_frames(BAD[reason])
    assert info.value.reason == reason


def test_extra_data_bytes_are_rejected():
    frames = [head_frame(good_header()), struct.pack(">IB", 13, FRAME_DATA) + bytes(12)]
    with pytest.raises(WireError, match="size_mismatch"):
        feed_frames(frames)


def test_more_checks_of_header_fields():
    for header in (
        good_header(id=-1),
        good_header(id=True),
        [1, 2, 3],
        {"v": 1},
        good_header(m=[1]),
        good_header(t=[["f32", [1.5]]]),
        good_header(t=[["f32", [1] * 9]]),
        good_header(t=[["f32", [0]]] * 65, n=0),
    ):
        with pytest.raises(WireError):
            feed_frames([head_frame(header)])


def test_oversized_message_refused_before_its_bytes_arrive():
    limits = Limits(max_message_bytes=1000)
    with pytest.raises(MessageTooLarge):
        roundtrip(Message("forward", 0, {}, [torch.zeros(1000)]), limits)


def test_sender_refuses_unknown_kind_and_dtype():
    with pytest.raises(WireError, match="unknown_kind"):
        list(encode(Message("nope")))
    with pytest.raises(WireError, match="unknown_dtype"):
        list(encode(Message("ping", 0, {}, [torch.zeros(2, dtype=torch.complex64)])))
