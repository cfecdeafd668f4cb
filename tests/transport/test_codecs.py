"""The lossy tensor codecs (:mod:`shoal.wire.codecs`): bf16 and fp16 are exactly torch's casts, q8's
error stays within half a quantisation step of its block, each codec is a projection (what it
decoded encodes to the same bytes), values a codec cannot carry are refused, and a receiver refuses
payloads of the wrong size, codecs it does not know and dtypes a codec does not carry. In memory,
no I/O."""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import pytest
import torch

from shoal.errors import WireError
from shoal.wire import CAPABILITIES, FRAME_DATA, FRAME_HEAD, FRAME_PREFIX, Assembler, Codec, Limits, Message, encode
from shoal.wire.codecs import Q8_BLOCK, carried, encoded_size
from shoal.wire.schema import CODEC_BF16, CODEC_FP16, CODEC_Q8, CODEC_RAW, StepRequest
from shoal.wire.tensors import encode_tensor, roundtrip, tensor_bytes

pytestmark = pytest.mark.timeout(30)

LOSSY = [Codec.BF16, Codec.FP16, Codec.Q8]
#: Counts that end on a block boundary, one value short of it, one past it, and smaller than a block.
COUNTS = [1, 5, Q8_BLOCK - 1, Q8_BLOCK, Q8_BLOCK + 1, 3 * Q8_BLOCK + 17, 1000]


def hidden(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def bits(tensor: torch.Tensor) -> bytes:
    return bytes(tensor_bytes(tensor))


def payload(tensor: torch.Tensor, codec: Codec) -> bytes:
    return bytes(encode_tensor(tensor, codec)[1])


# ---- what each codec sends and decodes -------------------------------------------------------------


def test_every_codec_is_announced_as_a_capability():
    assert {CODEC_RAW, CODEC_BF16, CODEC_FP16, CODEC_Q8} <= CAPABILITIES
    assert [c.capability for c in Codec] == ["codec/raw", "codec/bf16", "codec/fp16", "codec/q8"]


@pytest.mark.parametrize(("codec", "narrow"), [(Codec.BF16, torch.bfloat16), (Codec.FP16, torch.float16)])
def test_bf16_and_fp16_are_exactly_the_torch_casts(codec, narrow):
    x = torch.cat(
        [hidden(1000), torch.tensor([0.0, -0.0, 1e-6, -3e-8, 1.0 + 2**-9, 65504.0, -1234.5678, 2**-24, 7e-45])]
    )
    assert payload(x, codec) == bits(x.to(narrow))
    assert bits(roundtrip(x, codec)) == bits(x.to(narrow).to(torch.float32))
    assert roundtrip(x, codec).dtype == torch.float32


def test_bf16_keeps_float32_range_and_passes_nan_and_infinity_like_the_cast():
    x = torch.tensor([1e30, -3e38, float("inf"), float("-inf"), float("nan")])
    assert bits(roundtrip(x, Codec.BF16)) == bits(x.to(torch.bfloat16).float())


def test_fp16_refuses_finite_values_past_its_range():
    with pytest.raises(WireError, match="fp16 cannot carry") as caught:
        encode_tensor(torch.tensor([1.0, 70000.0]), Codec.FP16)
    assert caught.value.reason == "bad_tensor"
    x = torch.tensor([1.0, float("inf"), float("nan")])  # not finite to begin with: travels as cast
    assert bits(roundtrip(x, Codec.FP16)) == bits(x.half().float())


@pytest.mark.parametrize("count", COUNTS)
def test_q8_error_is_at_most_half_a_step_of_its_block(count):
    x = hidden(count, seed=count)
    x[::7] *= 40.0  # blocks of very different absmax
    got = roundtrip(x, Codec.Q8)
    assert got.shape == x.shape and got.dtype == torch.float32
    blocks = math.ceil(count / Q8_BLOCK)
    pad = blocks * Q8_BLOCK - count
    error = torch.nn.functional.pad((got - x).abs(), (0, pad)).view(blocks, Q8_BLOCK).amax(dim=1)
    absmax = torch.nn.functional.pad(x.abs(), (0, pad)).view(blocks, Q8_BLOCK).amax(dim=1)
    bound = absmax / 127 / 2 * (1 + 1e-4)  # plus float32 rounding of x / scale
    assert bool((error <= bound).all()), float((error / bound).max())


def test_q8_layout_is_the_scales_then_one_int8_per_value():
    x = torch.arange(Q8_BLOCK + 3, dtype=torch.float32) - 10.0  # block 0: absmax 53; block 1 (3 values): 56
    data = payload(x, Codec.Q8)
    assert len(data) == 2 * 4 + Q8_BLOCK + 3 == encoded_size(Codec.Q8, x.numel())
    scales = np.frombuffer(data[:8], dtype="<f4")
    values = np.frombuffer(data[8:], dtype=np.int8)
    assert scales[0] <= 53 / 127 and scales[0] == pytest.approx(53 / 127, rel=2**-15)
    assert scales[1] <= 56 / 127 and scales[1] == pytest.approx(56 / 127, rel=2**-15)
    assert values[Q8_BLOCK - 1] == 127 and values[0] == round(-10 / scales[0]) and values[-1] == 127
    assert np.abs(values).max() <= 127


def test_q8_sends_an_all_zero_block_as_zeros():
    x = torch.cat([torch.zeros(Q8_BLOCK), hidden(10)])
    got = roundtrip(x, Codec.Q8)
    assert bits(got[:Q8_BLOCK]) == bits(torch.zeros(Q8_BLOCK))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_q8_refuses_nan_and_infinity(value):
    x = hidden(100)
    x[70] = value
    with pytest.raises(WireError, match="q8 cannot carry NaN or infinity") as caught:
        encode_tensor(x, Codec.Q8)
    assert caught.value.reason == "bad_tensor"


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 5, 48), (1, 3, 1024), (0, 4), ()])
def test_each_codec_is_a_projection(codec, shape):
    """What a codec decoded encodes to the same bytes: a peer can send a decoded tensor on."""
    once = roundtrip(hidden(*shape, seed=3) * 50, codec)
    assert payload(once, codec) == payload(hidden(*shape, seed=3) * 50, codec)
    assert bits(roundtrip(once, codec)) == bits(once)


@pytest.mark.parametrize("codec", LOSSY)
def test_sizes(codec):
    for count in COUNTS:
        expected = 4 * math.ceil(count / Q8_BLOCK) + count if codec is Codec.Q8 else 2 * count
        assert encoded_size(codec, count) == expected == len(payload(hidden(count), codec))


def test_lossy_codecs_carry_float32_only():
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.bool):
        assert carried(Codec.Q8, dtype) is Codec.RAW
        with pytest.raises(WireError, match="carries float32 tensors") as caught:
            encode_tensor(torch.zeros(3, dtype=dtype), Codec.Q8)
        assert caught.value.reason == "bad_tensor"
    assert carried(Codec.Q8, torch.float32) is Codec.Q8


# ---- messages ---------------------------------------------------------------------------------------


def feed(frames: list[bytes], limits: Limits = Limits()) -> list[Message]:
    assembler, out = Assembler(limits), []
    for frame in frames:
        message = assembler.feed(frame[4], frame[5:])
        if message is not None:
            out.append(message)
    return out


@pytest.mark.parametrize("codec", list(Codec))
def test_a_message_carries_each_tensor_in_its_codec(codec):
    x, positions = hidden(1, 7, 96, seed=4), torch.arange(7).view(1, 7)
    sent = Message("step", 5, StepRequest(session="s", position=0), [x, positions], (codec,))
    (got,) = feed(encode(sent))
    assert bits(got.tensors[0]) == bits(roundtrip(x, codec))
    assert torch.equal(got.tensors[1], positions)  # past the codecs' end: raw
    assert got.codecs == (() if codec is Codec.RAW else (codec, Codec.RAW))
    assert got.codec_of(0) is codec and got.codec_of(1) is Codec.RAW and got.codec_of(5) is Codec.RAW
    header = msgpack.unpackb(encode(sent)[0][5:])
    assert header["t"] == [["f32", [1, 7, 96], codec.value], ["i64", [1, 7], "raw"]]
    assert header["n"] == (encoded_size(codec, x.numel()) if codec is not Codec.RAW else x.numel() * 4) + 7 * 8


def head(tensors: list, n: int) -> bytes:
    header = msgpack.packb({"v": 2, "k": "ping", "id": 1, "m": {}, "t": tensors, "n": n}, use_bin_type=True)
    return FRAME_PREFIX.pack(len(header) + 1, FRAME_HEAD) + header


def data(payload: bytes) -> bytes:
    return struct.pack(">IB", len(payload) + 1, FRAME_DATA) + payload


@pytest.mark.parametrize(
    ("codec", "count", "n"),
    [
        ("q8", 100, 400),  # what raw float32 would take
        ("q8", 100, 100 + 4),  # one scale short: the payload has two blocks
        ("q8", 64, 64 + 4 + 4),
        ("bf16", 10, 40),
        ("fp16", 10, 21),
    ],
)
def test_a_payload_size_that_does_not_fit_the_codec_is_refused(codec, count, n):
    with pytest.raises(WireError) as caught:
        feed([head([["f32", [count], codec]], n), data(bytes(n))])
    assert caught.value.reason == "size_mismatch"


def test_more_data_than_the_codec_takes_is_refused():
    n = encoded_size(Codec.Q8, 100)
    with pytest.raises(WireError) as caught:
        feed([head([["f32", [100], "q8"]], n), data(bytes(n + 1))])
    assert caught.value.reason == "size_mismatch"


def test_q8_scales_that_are_not_finite_are_refused():
    scales = struct.pack("<ff", 0.5, float("inf"))
    with pytest.raises(WireError, match="q8 block scales must be finite") as caught:
        feed([head([["f32", [70], "q8"]], 8 + 70), data(scales + bytes(70))])
    assert caught.value.reason == "bad_tensor"


@pytest.mark.parametrize("dtype", ["bf16", "f16", "i64", "bool"])
def test_a_lossy_codec_on_another_dtype_is_refused(dtype):
    with pytest.raises(WireError, match="carries f32 tensors") as caught:
        feed([head([[dtype, [4], "q8"]], 8)])
    assert caught.value.reason == "bad_tensor"


def test_an_unknown_codec_is_refused_naming_every_codec_this_peer_knows():
    with pytest.raises(WireError, match=r"tensor codec 'q4' \(this peer knows: bf16, fp16, q8, raw\)") as caught:
        feed([head([["f32", [4], "q4"]], 16)])
    assert caught.value.reason == "unknown_codec"
