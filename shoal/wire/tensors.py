"""Tensor <-> bytes, with the dtype table of wire version 1. No I/O here."""

from __future__ import annotations

import math

import numpy as np
import torch

from shoal.errors import WireError

#: Wire name -> torch dtype. The names are part of the protocol: never rename one.
DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f64": torch.float64,
    "i64": torch.int64,
    "i32": torch.int32,
    "i8": torch.int8,
    "u8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}
MAX_RANK = 8
_NO_NUMPY = frozenset({torch.bfloat16})  # dtypes numpy cannot view: sent as their bytes
#: Wire name -> the numpy dtype a received buffer is viewed as (bf16 as int16, then viewed by torch).
_NUMPY_VIEW: dict[str, np.dtype] = {
    name: np.dtype(np.int16) if dt is torch.bfloat16 else torch.empty((), dtype=dt).numpy().dtype
    for name, dt in DTYPES.items()
}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise WireError("unknown_dtype", f"{dtype} cannot be sent; supported: {sorted(DTYPES)}") from None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` (CPU, contiguous), without copying when already so. This runs
    for every tensor sent, so the common case (a contiguous CPU tensor numpy can view) takes the
    fewest torch calls."""
    if tensor.requires_grad or not tensor.is_cpu or not tensor.is_contiguous():
        tensor = tensor.detach().to("cpu").contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    if tensor.dtype not in _NO_NUMPY:
        return memoryview(tensor.numpy()).cast("B")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def describe(tensor: torch.Tensor) -> list:
    """Header entry of one tensor: ``[dtype name, shape]``."""
    return [dtype_name(tensor.dtype), list(tensor.shape)]


def validate_descriptor(entry: object) -> tuple[str, tuple[int, ...], int]:
    """Check one ``[dtype, shape]`` header entry; return it with its byte count."""
    if not isinstance(entry, list | tuple) or len(entry) != 2:
        raise WireError("bad_tensor", f"tensor descriptor must be [dtype, shape], got {entry!r:.80}")
    name, shape = entry
    if not isinstance(name, str) or name not in DTYPES:
        raise WireError("unknown_dtype", f"{name!r:.40} (supported: {', '.join(sorted(DTYPES))})")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_RANK:
        raise WireError("bad_shape", f"shape must be a list of at most {MAX_RANK} dims, got {shape!r:.80}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape):
        raise WireError("bad_shape", f"dims must be non-negative ints, got {shape!r:.80}")
    return name, tuple(shape), math.prod(shape) * ITEMSIZE[name]


def tensor_from_buffer(buffer: bytearray, offset: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing ``buffer[offset:]`` (no copy). Through numpy: fewer torch calls than
    ``torch.frombuffer(...).view(shape)``, and this runs for every tensor received."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=DTYPES[name])
    array = np.frombuffer(buffer, dtype=_NUMPY_VIEW[name], count=count, offset=offset).reshape(shape)
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if name == "bf16" else tensor
