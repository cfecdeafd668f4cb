"""Tensor <-> bytes: the dtype table and tensor codecs of wire version 2. No I/O here.

A tensor's header entry is ``[dtype, shape, codec]``. ``dtype`` and ``shape`` are what the receiver
gets; the codec says how its bytes travel: ``raw`` (the tensor's own bytes, little endian, C order)
or one of the lossy float32 codecs of :mod:`shoal.wire.codecs` (``bf16``, ``fp16``, ``q8``). A codec
a receiver does not know is refused (``unknown_codec``), and a sender uses a codec other than raw
only with a peer that announced it (capability ``codec/<name>``).
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

from shoal.errors import WireError
from shoal.wire import codecs
from shoal.wire.codecs import Codec

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
RAW = Codec.RAW
#: Wire name -> codec: every codec this peer decodes.
CODECS: dict[str, Codec] = {codec.value: codec for codec in Codec}
_NO_NUMPY = frozenset({torch.bfloat16})  # dtypes numpy cannot view: sent as their bytes
#: Wire name -> the numpy dtype a received buffer is viewed as (bf16 as int16, then viewed by torch).
_NUMPY_VIEW: dict[str, np.dtype] = {
    name: np.dtype(np.int16) if dt is torch.bfloat16 else torch.empty((), dtype=dt).numpy().dtype
    for name, dt in DTYPES.items()
}


#: an element size -> the integer dtype of that size: any tensor (bf16, bool too) viewed as numpy can hold
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor of any dtype (bf16 and bool as same-size integers: numpy lacks
    bf16). No copy and no torch kernel, so the calling thread opens no OpenMP region: a thread that
    does gets a libgomp pool of its own, more threads than CPUs (see :func:`serial_copy`)."""
    return tensor.detach().view(_SAME_SIZE_INT[tensor.element_size()]).numpy()


def serial_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor made by numpy, not torch: for threads that must never
    run a parallel torch kernel (the client's event loop, its evidence worker), where a torch copy
    large enough to go parallel would give the thread an OpenMP pool of its own."""
    return torch.from_numpy(as_numpy(tensor).copy()).view(tensor.dtype)


def cat_serial(chunks: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat`` of CPU tensors without OpenMP. A client's histories and a server's chunked
    steps are joined on event loop threads, and the first parallel region a thread opens gives it a
    libgomp pool of its own: with the model thread's pool that is more threads than CPUs, and from
    then on every parallel region of the process sleeps at its barriers (the LM head gets ~1.8x
    slower). numpy joins serially."""
    joined = np.concatenate([as_numpy(chunk) for chunk in chunks], axis=dim)  # bf16 as same-size ints
    return torch.from_numpy(joined).view(chunks[0].dtype)


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


def describe(tensor: torch.Tensor, codec: Codec = RAW) -> tuple[str, list[int], str]:
    """Header entry of one tensor: ``[dtype name, shape, codec]`` (a codec is its name: a str)."""
    return (dtype_name(tensor.dtype), list(tensor.shape), codec)


def encode_tensor(tensor: torch.Tensor, codec: Codec) -> tuple[tuple[str, list[int], str], memoryview]:
    """Header entry and bytes of ``tensor`` sent in ``codec``; :class:`WireError` (``bad_tensor``)
    if the codec cannot carry it (see :func:`shoal.wire.codecs.check`)."""
    if codec is RAW:
        return describe(tensor), tensor_bytes(tensor)
    if tensor.dtype != torch.float32:
        raise WireError("bad_tensor", f"codec {codec} carries float32 tensors, not {tensor.dtype}")
    if tensor.requires_grad or not tensor.is_cpu or not tensor.is_contiguous():
        tensor = tensor.detach().to("cpu").contiguous()
    return describe(tensor, codec), memoryview(codecs.encode(codec, tensor).numpy()).cast("B")


def roundtrip(tensor: torch.Tensor, codec: Codec) -> torch.Tensor:
    """What a receiver decodes of ``tensor`` sent in ``codec`` (raw: ``tensor`` itself)."""
    if codec is RAW:
        return tensor
    _, data = encode_tensor(tensor, codec)
    return codecs.decode(codec, np.frombuffer(data, dtype=np.uint8), tuple(tensor.shape))


class TensorDesc(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One validated header entry, with the bytes it takes on the wire."""

    dtype: str
    shape: tuple[int, ...]
    codec: Codec
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
    known = CODECS.get(codec)
    if known is None:
        raise WireError("unknown_codec", f"tensor codec {codec!r:.40} (this peer knows: {', '.join(sorted(CODECS))})")
    if len(shape) > MAX_RANK:
        raise WireError("bad_shape", f"shape must be a list of at most {MAX_RANK} dims, got {shape!r:.80}")
    if not all(0 <= d < 2**40 for d in shape):
        raise WireError("bad_shape", f"dims must be non-negative ints, got {shape!r:.80}")
    count = math.prod(shape)
    if known is RAW:
        return TensorDesc(name, tuple(shape), known, count * ITEMSIZE[name])
    if name != "f32":
        raise WireError("bad_tensor", f"codec {known} carries f32 tensors, not {name!r:.40}")
    return TensorDesc(name, tuple(shape), known, codecs.encoded_size(known, count))


def decode_tensor(buffer: bytearray, offset: int, desc: TensorDesc) -> torch.Tensor:
    """The tensor ``desc`` describes, from ``buffer[offset:]`` (raw: a view, no copy)."""
    if desc.codec is RAW:
        return tensor_from_buffer(buffer, offset, desc.dtype, desc.shape)
    data = np.frombuffer(buffer, dtype=np.uint8, count=desc.nbytes, offset=offset)
    return codecs.decode(desc.codec, data, desc.shape)


def tensor_from_buffer(buffer: bytearray, offset: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing ``buffer[offset:]`` (no copy). Through numpy: fewer torch calls than
    ``torch.frombuffer(...).view(shape)``, and this runs for every tensor received."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=DTYPES[name])
    array = np.frombuffer(buffer, dtype=_NUMPY_VIEW[name], count=count, offset=offset).reshape(shape)
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if name == "bf16" else tensor
