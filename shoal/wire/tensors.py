"""Tensor <-> bytes: the dtype table and tensor codecs of wire version 2. No I/O here.

A tensor's header entry is ``[dtype, shape, codec]``. ``dtype`` and ``shape`` are what the receiver
gets; the codec says how its bytes travel. Wire version 2 defines ``raw`` (the tensor's own bytes,
little endian, C order); a codec a receiver does not know is refused (``unknown_codec``), and a
sender uses another codec only with a peer that announced it (capability ``codec/<name>``).
"""

from __future__ import annotations

import math

import msgspec
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
RAW = "raw"
#: Codec name -> bytes per element of each dtype (None: the codec cannot carry that dtype).
CODECS: dict[str, dict[str, int]] = {RAW: ITEMSIZE}
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


def describe(tensor: torch.Tensor, codec: str = RAW) -> tuple[str, list[int], str]:
    """Header entry of one tensor: ``[dtype name, shape, codec]``."""
    return (dtype_name(tensor.dtype), list(tensor.shape), codec)


class TensorDesc(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One validated header entry, with the bytes it takes on the wire."""

    dtype: str
    shape: tuple[int, ...]
    codec: str
    nbytes: int = 0


_DESCRIPTORS = msgspec.msgpack.Decoder(list[tuple[str, list[int], str]])


def validate_descriptors(raw: bytes | msgspec.Raw, max_tensors: int) -> list[TensorDesc]:
    """Check a header's tensor entries; return them with their byte counts."""
    try:
        entries = _DESCRIPTORS.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise WireError("bad_tensor", f"tensor descriptors must be [dtype, shape, codec] entries: {exc}") from None
    if len(entries) > max_tensors:
        raise WireError("bad_tensor", f"at most {max_tensors} tensors, got {len(entries)}")
    return [validate_descriptor(entry) for entry in entries]


def validate_descriptor(entry: tuple[str, list[int], str]) -> TensorDesc:
    name, shape, codec = entry
    if name not in DTYPES:
        raise WireError("unknown_dtype", f"{name!r:.40} (supported: {', '.join(sorted(DTYPES))})")
    if codec not in CODECS:
        raise WireError("unknown_codec", f"tensor codec {codec!r:.40} (this peer knows: {', '.join(sorted(CODECS))})")
    if len(shape) > MAX_RANK:
        raise WireError("bad_shape", f"shape must be a list of at most {MAX_RANK} dims, got {shape!r:.80}")
    if not all(0 <= d < 2**40 for d in shape):
        raise WireError("bad_shape", f"dims must be non-negative ints, got {shape!r:.80}")
    return TensorDesc(name, tuple(shape), codec, math.prod(shape) * CODECS[codec][name])


def decode_tensor(buffer: bytearray, offset: int, desc: TensorDesc) -> torch.Tensor:
    """The tensor ``desc`` describes, from ``buffer[offset:]`` (raw: a view, no copy)."""
    return tensor_from_buffer(buffer, offset, desc.dtype, desc.shape)


def tensor_from_buffer(buffer: bytearray, offset: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing ``buffer[offset:]`` (no copy). Through numpy: fewer torch calls than
    ``torch.frombuffer(...).view(shape)``, and this runs for every tensor received."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=DTYPES[name])
    array = np.frombuffer(buffer, dtype=_NUMPY_VIEW[name], count=count, offset=offset).reshape(shape)
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if name == "bf16" else tensor
