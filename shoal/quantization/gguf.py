"""GGUF's quantised matrices held as they are, run through torch's CPU int4 kernel.

Every GGUF integer type with one scale per 32 weights is affine on its group: ``w = s * u + b``
with ``u`` an unsigned code of at most 8 bits (:func:`affine_codes`). torch's CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``) computes with ``w = (c - 8) * scale + zero`` per group of 32
(or 64, 128, 256) along the input, so a 4-bit code (Q4_0, Q4_1, Q4_K) maps onto it exactly with
``scale = s`` and ``zero = b + 8 s``. A wider code (Q5_0, Q5_1, Q8_0) is split into its low and
high nibble, two 4-bit planes side by side along the input (``u = l + 16 h``: the high plane has
scale ``16 s``), and the activations are fed twice: one call, 1 byte per weight.

Chosen by measurement (torch 2.13, one thread of this Xeon with AVX512-bf16 and AMX, a ``[1, 896]
x [896, 4864]`` decode matmul): fp32 ``F.linear`` 630 to 670 us; the int4 kernel 220 us on bf16
activations but 6.9 ms on fp32 and 11 ms on fp16 ones (no vector path); ``_weight_int8pack_mm``
265 us on bf16, 2.7 ms on fp32. So the kernel runs on bf16 activations and bf16 scales whatever the
server's dtype: the codes are the GGUF's own, the group's scale and zero are rounded to bf16
(relative 2^-9), and each product's output is rounded to bf16 before it returns to the server's
dtype (relative error of one matmul about 0.3% against fp32, measured on random inputs). Q6_K and
Q2_K/Q3_K/Q5_K have groups of 16 or codes the kernel cannot split this way: their matrices are
dequantised to the server's dtype, as are norms and biases (on Qwen2.5-Coder's Q4_K_M, Q6_K matrices
held in bf16 instead saved 105 MB of 24 blocks' 559 MB but raised perplexity's delta against fp32
from +0.13% to +0.23%).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

GROUP = 32  # weights per GGUF scale (Q4_K: per sub-block); the kernel's group size
KERNEL_DTYPE = torch.bfloat16  # the only activation dtype the CPU int4 kernel runs fast on

#: GGUF types held as int4 planes: bits of their code (4: one plane, 5 or 8: two).
PACKED_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}


@dataclass(frozen=True)
class AffineCodes:
    """A matrix ``[rows, cols]`` as ``w = scale * codes + offset``, one scale and offset per 32 columns."""

    codes: np.ndarray  # uint8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols / group]
    offset: np.ndarray  # float32 [rows, cols / group]
    bits: int
    group: int = GROUP  # 32, 64, 128 or 256: what the kernel takes

    def dequantize(self) -> np.ndarray:
        rows, cols = self.codes.shape
        w = self.codes.reshape(rows, -1, self.group).astype(np.float32) * self.scale[..., None] + self.offset[..., None]
        return w.reshape(rows, cols)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` codes: low nibbles are weights 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def affine_codes(raw: np.ndarray, type_name: str, cols: int) -> AffineCodes:
    """The codes, scales and offsets of a GGUF matrix stored as ``raw`` bytes ``[rows, row_bytes]``
    of type ``type_name`` (one of :data:`PACKED_TYPES`); the byte layouts are gguf-py's
    ``gguf.quants`` (llama.cpp's ``ggml-quants.c``)."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    groups = cols // GROUP
    if type_name == "Q4_K":  # 256 weights: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of codes
        blocks = raw.reshape(rows * cols // 256, 144)
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(rows, cols)
        scale = (d * sc.astype(np.float32)).reshape(rows, groups)
        offset = -(dmin * mn.astype(np.float32)).reshape(rows, groups)
        return AffineCodes(codes, scale, offset, 4)
    size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[type_name]
    blocks = raw.reshape(rows * groups, size)
    d = _f16(blocks[:, 0:2])
    if type_name == "Q8_0":  # d, 32 signed bytes: w = d * q
        codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return AffineCodes(codes.reshape(rows, cols), d.reshape(rows, groups), (-128 * d).reshape(rows, groups), 8)
    with_min = type_name in ("Q4_1", "Q5_1")
    body = blocks[:, 4:] if with_min else blocks[:, 2:]
    offset = _f16(blocks[:, 2:4]) if with_min else None
    if type_name.startswith("Q5"):  # 4 bytes of fifth bits (bit i: weight i), then the nibbles
        high = body[:, :4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
        codes = _nibbles(body[:, 4:]) | (((high & 1).astype(np.uint8)) << 4)
        centre = 16
    else:
        codes = _nibbles(body)
        centre = 8
    if offset is None:  # symmetric: w = d * (q - centre)
        offset = -centre * d
    bits = PACKED_TYPES[type_name]
    return AffineCodes(codes.reshape(rows, cols), d.reshape(rows, groups), offset.reshape(rows, groups), bits)


def int4_grid(weight: torch.Tensor) -> AffineCodes:
    """``weight`` ``[out, in]`` rounded to 16 levels between each group's minimum and maximum (Q4_1's
    grid, in fp32)."""
    rows, cols = weight.shape
    groups = weight.detach().float().reshape(rows, cols // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - low[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    return AffineCodes(codes.reshape(rows, cols).numpy(), scale.numpy(), low.numpy(), 4)


def int8_groups(weight: torch.Tensor, group: int) -> AffineCodes:
    """``weight`` ``[out, in]`` as symmetric int8 with one scale per ``group`` weights (Q8_0's grid
    when ``group`` is 32), each scale rounded up to bf16 first so the codes are exact for it."""
    rows, cols = weight.shape
    groups = weight.detach().float().reshape(rows, cols // group, group)
    scale = groups.abs().amax(-1).clamp_min(1e-12) / 127
    rounded = scale.to(torch.bfloat16)
    up = torch.nextafter(rounded, torch.tensor(float("inf"), dtype=torch.bfloat16))
    scale = torch.where(rounded.float() < scale, up, rounded).float()
    codes = torch.round(groups / scale[..., None]).clamp(-127, 127) + 128
    codes = codes.to(torch.uint8).reshape(rows, cols).numpy()
    return AffineCodes(codes, scale.numpy(), (-128 * scale).numpy(), 8, group)


class Int4Linear(nn.Module):
    """A linear layer whose weight is int4 codes in planes side by side along the input (1 plane:
    4-bit codes; 2: low and high nibbles of wider ones), through ``_weight_int4pack_mm_for_cpu`` on
    bf16 activations; the bias and the output stay in the server's dtype."""

    def __init__(self, codes: AffineCodes, bias: torch.Tensor | None = None):
        super().__init__()
        rows, cols = codes.codes.shape
        self.in_features, self.out_features = cols, rows
        planes = [(codes.codes, codes.scale, codes.offset + 8 * codes.scale)]
        if codes.bits > 4:  # u = l + 16 h: (l - 8) s + z_l plus (h - 8) 16 s + z_h, z_l + z_h = b + 136 s
            # zeros that bf16 holds as exactly as the scale: 128 s, or 0 with Q8_0's z_l = 8 s
            high_zero = 0 * codes.scale if codes.bits == 8 else 128 * codes.scale
            planes = [(codes.codes & 0x0F, codes.scale, codes.offset + 136 * codes.scale - high_zero),
                      (codes.codes >> 4, 16 * codes.scale, high_zero)]  # fmt: skip
        self.planes, self.group = len(planes), codes.group
        packed = np.concatenate([c for c, _, _ in planes], axis=1)  # [rows, planes * cols]
        scale = np.concatenate([s for _, s, _ in planes], axis=1)  # [rows, planes * groups]
        zero = np.concatenate([z for _, _, z in planes], axis=1)
        q = torch.from_numpy(packed.astype(np.int32))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        sz = torch.stack([torch.from_numpy(scale).t(), torch.from_numpy(zero).t()], dim=-1)  # [groups, rows, 2]
        self.register_buffer("scales_and_zeros", sz.to(KERNEL_DTYPE).contiguous())
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        if self.planes > 1:
            flat = flat.repeat(1, self.planes)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat.contiguous(), self.packed, self.group, self.scales_and_zeros
        )
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    def dequantized(self) -> torch.Tensor:
        """The weight ``[out, in]`` as served (bf16 scales), in fp32: for tests and audits."""
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        flat = eye.repeat(1, self.planes)
        return (
            torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros).float().t()
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, planes={self.planes}"
