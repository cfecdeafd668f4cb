"""The lossy tensor codecs of wire version 2: float32 values in fewer bytes. No I/O here.

========  ===========================================================================  ===============
codec     what travels                                                                 bytes per value
========  ===========================================================================  ===============
``raw``   the tensor's own bytes (any dtype; :mod:`shoal.wire.tensors`)                4 for float32
``bf16``  each value cast to bfloat16 (round to nearest even, as ``tensor.to``)        2
``fp16``  each value cast to float16; a finite value past float16's range is refused   2
          (it would arrive as infinity)
``q8``    blocks of :data:`Q8_BLOCK` values of the flattened tensor (the last one may  ~1.06
          be shorter): the blocks' float32 scales, then one int8 per value
========  ===========================================================================  ===============

``q8`` is absmax quantisation like GGUF's Q8_0 (which keeps 32 values and a float16 scale per
block): a block's scale is ``absmax / 127`` with its mantissa cut to 16 bits (toward zero), a value
travels as ``round(x / scale)`` and arrives as ``q * scale``; the error of every value is at most
``absmax / 127 / 2`` (plus float32 rounding). NaN and infinity have no int8 form: refused.

Every lossy codec here is a projection: a tensor it decoded encodes to the same bytes again (bf16 and
fp16: the cast back is exact; q8: ``q * scale`` is exact in float32 because the cut scale has 16
significant bits and ``|q| <= 127`` 7, and the block's absmax ``127 * scale`` gives the same scale
back). So a peer that keeps what a receiver decoded (the client's replay history) can send it on, to
any receiver and in any of these codecs, without drifting from what was computed on. They carry
float32 tensors only: bf16 and fp16 tensors already travel in two bytes (raw).
"""

from __future__ import annotations

import math
from enum import StrEnum

import numpy as np
import torch

from shoal.errors import WireError

Q8_BLOCK = 64  # values per q8 block: a protocol constant
_Q8_MAX = 127
_SCALE_MASK = -256  # 0xFFFFFF00 as an int32: keeps a float32's sign, exponent and top 15 mantissa bits
_FP16_MAX = float(torch.finfo(torch.float16).max)


class Codec(StrEnum):
    """How a tensor's values travel (the third field of its header entry). A sender uses a codec
    other than ``raw`` only with a peer that announced :attr:`capability`."""

    RAW = "raw"
    BF16 = "bf16"
    FP16 = "fp16"
    Q8 = "q8"

    @property
    def capability(self) -> str:
        return f"codec/{self.value}"


def carried(codec: Codec, dtype: torch.dtype) -> Codec:
    """The codec a tensor of ``dtype`` travels in when ``codec`` is asked for: the lossy codecs
    carry float32 only; anything else travels raw."""
    return codec if dtype == torch.float32 else Codec.RAW


def encoded_size(codec: Codec, count: int) -> int:
    """Bytes of ``count`` float32 values in lossy ``codec``."""
    if codec is Codec.Q8:
        return 4 * math.ceil(count / Q8_BLOCK) + count
    return 2 * count


def check(codec: Codec, values: torch.Tensor) -> None:
    """Raise :class:`WireError` (``bad_tensor``) if ``values`` (float32) cannot travel in lossy
    ``codec``: NaN or infinity in q8, finite values past float16's range in fp16."""
    if codec is Codec.Q8 and values.numel() and not bool(torch.isfinite(values).all()):
        raise WireError("bad_tensor", "q8 cannot carry NaN or infinity (raw can: find where they came from)")
    if codec is Codec.FP16 and values.numel() and not float(values.abs().amax()) <= _FP16_MAX:
        finite = values[torch.isfinite(values)]  # NaN and infinity travel as they are, as in a cast
        if finite.numel() and float(finite.abs().amax()) > _FP16_MAX:
            raise WireError("bad_tensor", f"fp16 cannot carry |x| > {_FP16_MAX:g} (use bf16: float32's range)")


def encode(codec: Codec, values: torch.Tensor) -> torch.Tensor:
    """``values`` (float32, CPU, contiguous) as the uint8 bytes lossy ``codec`` sends; raises
    what :func:`check` raises."""
    if codec is Codec.Q8:
        return _q8_encode(values.reshape(-1))  # checks the blocks' absmax: NaN and infinity show there
    check(codec, values)
    narrow = torch.bfloat16 if codec is Codec.BF16 else torch.float16
    return values.to(narrow).reshape(-1).view(torch.uint8)


def decode(codec: Codec, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of ``shape`` that lossy ``codec``'s bytes ``data`` (uint8, exactly
    :func:`encoded_size` of them) stand for."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=torch.float32)
    if codec is Codec.Q8:
        return _q8_decode(data, count).view(shape)
    narrow = torch.bfloat16 if codec is Codec.BF16 else torch.float16
    # a copy first: numpy cannot view 2-byte floats at an odd offset of the message body
    return torch.from_numpy(data.copy()).view(narrow).to(torch.float32).view(shape)


# q8 runs for every hop of every decoded token: few torch calls (each costs microseconds at the
# sizes of one token's hidden states), and no padding copy when the count fills whole blocks (a hidden
# size that is a multiple of 64, as in most models).


def _q8_encode(flat: torch.Tensor) -> torch.Tensor:
    count = flat.numel()
    nblocks = math.ceil(count / Q8_BLOCK)
    tail = nblocks * Q8_BLOCK - count
    blocks = (torch.nn.functional.pad(flat, (0, tail)) if tail else flat).view(nblocks, Q8_BLOCK)  # pad: zeros
    absmax = blocks.abs().amax(dim=1)  # NaN and infinity propagate here
    if nblocks and not bool(torch.isfinite(absmax).all()):
        raise WireError("bad_tensor", "q8 cannot carry NaN or infinity (raw can: find where they came from)")
    scales = ((absmax / _Q8_MAX).view(torch.int32) & _SCALE_MASK).view(torch.float32)  # mantissa cut to 16 bits
    divisors = torch.where(scales > 0, scales, 1.0).unsqueeze(1)  # an all-zero block stays zeros
    q = torch.div(blocks, divisors).round_().clamp_(-_Q8_MAX, _Q8_MAX).to(torch.int8).view(-1)
    return torch.cat([scales.view(torch.uint8), (q[:count] if tail else q).view(torch.uint8)])


def _q8_decode(data: np.ndarray, count: int) -> torch.Tensor:
    nblocks = math.ceil(count / Q8_BLOCK)
    tail = nblocks * Q8_BLOCK - count
    scales = torch.from_numpy(data[: 4 * nblocks].copy()).view(torch.float32)  # a copy: aligned
    if not bool(torch.isfinite(scales).all()):
        raise WireError("bad_tensor", "q8 block scales must be finite")
    q = torch.from_numpy(data[4 * nblocks :]).view(torch.int8)
    if tail:
        q = torch.nn.functional.pad(q, (0, tail))
    values = q.view(nblocks, Q8_BLOCK) * scales.unsqueeze(1)  # int8 * float32: float32, exact (see above)
    return values.view(-1)[:count] if tail else values.view(-1)


__all__ = ["Q8_BLOCK", "Codec", "carried", "check", "decode", "encode", "encoded_size"]
