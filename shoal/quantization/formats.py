"""The formats a server may hold its blocks' weights in, and the quality order clients choose by.

Full precision (the serving dtype, fp32, bf16 or fp16, as loaded) ranks above gguf (a GGUF
file's own quantised tensors, served as they are: the checkpoint *is* that grid, so nothing is
re-quantised; its kernel rounds activations to bf16), which ranks above int8, above nf4. A server
announces its format in its swarm record and its ``info`` next to the fingerprints of the checkpoint
tensors it quantised (gguf: of the file's tensors as stored), so replicas of a block agree on *what*
they serve and say *how*; a client routes only over servers at or above its ``min_quality``
(:data:`DEFAULT_MIN_QUALITY`: int8 and better). Pure: no torch, no quantisation library.
"""

from __future__ import annotations

import enum

from shoal.errors import UsageError


class Quantization(enum.StrEnum):
    """How a server holds the weight matrices of its blocks (norms, biases and the KV cache stay in
    the serving dtype)."""

    NONE = "none"  # full precision: the serving dtype (fp32 = bf16 = fp16 in quality)
    GGUF = "gguf"  # a GGUF file's quantised tensors as stored (shoal.quantization.gguf)
    INT8 = "int8"  # 8-bit integers, one scale per output row
    NF4 = "nf4"  # 4-bit NormalFloat, one scale per block of 64 weights

    @property
    def quality(self) -> int:
        """Higher is better; equal ranks are interchangeable."""
        return _QUALITY[self]

    def satisfies(self, minimum: Quantization) -> bool:
        """Whether weights in this format are good enough for a client asking for ``minimum``."""
        return self.quality >= minimum.quality


_QUALITY = {Quantization.NONE: 3, Quantization.GGUF: 2, Quantization.INT8: 1, Quantization.NF4: 0}

#: What a client accepts unless told otherwise: int8 and better (never nf4's re-quantised 4 bits).
DEFAULT_MIN_QUALITY = Quantization.INT8

#: Names ``min_quality`` takes for full precision (the serving dtypes rank equal).
_FULL_PRECISION = ("none", "full", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16")


def parse_quantization(name: str | Quantization) -> Quantization:
    """A server's format (``--quant``): ``none``, ``gguf``, ``int8`` or ``nf4``."""
    try:
        return Quantization(str(name).lower())
    except ValueError:
        choices = ", ".join(q.value for q in Quantization)
        raise UsageError(f"unknown quantisation {name!r}; choose one of {choices}") from None


def parse_min_quality(name: str | Quantization) -> Quantization:
    """The lowest format a client accepts: a format, or a full-precision dtype name (``fp32``,
    ``bf16``, ``fp16``: all mean full precision only)."""
    if isinstance(name, Quantization):
        return name
    text = str(name).lower()
    if text in _FULL_PRECISION:
        return Quantization.NONE
    try:
        return Quantization(text)
    except ValueError:
        choices = ", ".join(["fp32", "bf16", "fp16", *(q.value for q in Quantization if q is not Quantization.NONE)])
        raise UsageError(f"unknown min_quality {name!r}; choose one of {choices}") from None
