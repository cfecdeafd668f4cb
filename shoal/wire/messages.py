"""Messages and frames of wire version 1. Pure functions and a sans-I/O assembler: no sockets here.

A message travels as frames. Every frame is ``u32 length (big endian) | u8 type | payload``:

    HEAD  (type 1)  msgpack map {"v": 1, "k": kind, "id": request id, "m": metadata, "t": tensors,
                    "n": total tensor bytes}; tensors are ``[dtype, shape]`` entries
    DATA  (type 2)  the next bytes of the tensors, concatenated in order

A HEAD is followed by DATA frames until ``n`` bytes arrived (none when ``n == 0``). Frames carry at
most :data:`MAX_FRAME_PAYLOAD` bytes, so large tensors are chunked and the frame limit never limits
batch size or sequence length; only the receiver's ``max_message_bytes`` does.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from shoal.errors import MessageTooLarge, WireError
from shoal.wire import tensors as tw

WIRE_VERSION = 1
FRAME_HEAD = 1
FRAME_DATA = 2
FRAME_PREFIX = struct.Struct(">IB")  # payload length (type byte included), frame type
_PACK_PREFIX = FRAME_PREFIX.pack
MAX_FRAME_PAYLOAD = 4 * 1024 * 1024  # data bytes per DATA frame; a protocol constant
MAX_META_DEPTH = 4
_HEADER_KEYS = frozenset({"v", "k", "id", "m", "t", "n"})

#: Every message kind the wire knows. A frame naming another kind is rejected.
KINDS = frozenset(
    {
        "hello",  # which protocols a peer speaks (meta protocol)
        "ping",  # echo for liveness and round-trip measurement; tensors are echoed back
        "info",  # what a server hosts
        "forward",  # stateless forward through a span
        "open",  # open an inference session
        "step",  # one inference step of a session
        "push",  # a server hands its step output to the next server of the session's chain
        "close",  # close a session
        "gossip",  # swarm record exchange: meta {"op"}, payload as one u8 tensor
        "result",  # a successful reply
        "error",  # an error reply: meta {"code", "message"}
    }
)


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts. Larger messages are refused before their bytes are read."""

    max_message_bytes: int = 1 << 30
    max_header_bytes: int = 64 * 1024
    max_tensors: int = 64

    @functools.cached_property
    def max_frame_bytes(self) -> int:
        return max(MAX_FRAME_PAYLOAD, self.max_header_bytes) + 1


@dataclass
class Message:
    kind: str
    id: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)

    def error_info(self) -> tuple[str, str]:
        return str(self.meta.get("code", "internal")), str(self.meta.get("message", ""))


def error_message(request_id: int, code: str, message: str, **extra: Any) -> Message:
    return Message("error", request_id, {"code": code, "message": message[:2000], **extra})


def frames(message: Message, limits: Limits = Limits()) -> list[list[bytes | memoryview]]:
    """The frames of ``message``, each as the pieces that concatenate to it. Tensor data comes as
    memoryviews of the tensors themselves, so a sender can write it without copying."""
    if message.kind not in KINDS:
        raise WireError("unknown_kind", message.kind)
    buffers = [tw.tensor_bytes(t) for t in message.tensors]
    total = sum(b.nbytes for b in buffers)
    header = msgpack.packb(
        {
            "v": WIRE_VERSION,
            "k": message.kind,
            "id": message.id,
            "m": message.meta,
            "t": [tw.describe(t) for t in message.tensors],
            "n": total,
        },
        use_bin_type=True,
    )
    if len(header) > limits.max_header_bytes:
        raise MessageTooLarge("header_too_large", f"{len(header)} > {limits.max_header_bytes} bytes")
    out: list[list[bytes | memoryview]] = [[_PACK_PREFIX(len(header) + 1, FRAME_HEAD), header]]
    parts: list[bytes | memoryview] = []  # pieces of the next DATA frame
    size = 0
    for buf in buffers:
        offset = 0
        while offset < buf.nbytes:
            take = min(MAX_FRAME_PAYLOAD - size, buf.nbytes - offset)
            parts.append(buf[offset : offset + take])
            size += take
            offset += take
            if size == MAX_FRAME_PAYLOAD:
                out.append([_PACK_PREFIX(size + 1, FRAME_DATA), *parts])
                parts, size = [], 0
    if parts:
        out.append([_PACK_PREFIX(size + 1, FRAME_DATA), *parts])
    return out


def writes(message: Message, limits: Limits = Limits(), join_below: int = 64 * 1024) -> list[bytes | memoryview]:
    """The buffers a sender writes for ``message``, in order: consecutive pieces smaller than
    ``join_below`` are joined into one ``bytes`` (a small message is a single write); larger tensor
    pieces stay views of the tensor, written without a copy."""
    out: list[bytes | memoryview] = []
    pending: list[bytes | memoryview] = []
    for pieces in frames(message, limits):
        for piece in pieces:
            if len(piece) < join_below:
                pending.append(piece)
                continue
            if pending:
                out.append(b"".join(pending))
                pending = []
            out.append(piece)
    if pending:
        out.append(b"".join(pending))
    return out


def encode(message: Message, limits: Limits = Limits()) -> list[bytes]:
    """Frames of ``message``, each one ``bytes`` (prefix included)."""
    return [b"".join(pieces) for pieces in frames(message, limits)]


def _check_meta(value: Any, depth: int = 0) -> None:
    if depth > MAX_META_DEPTH:
        raise WireError("bad_meta", f"metadata nested deeper than {MAX_META_DEPTH}")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise WireError("bad_meta", f"metadata keys must be strings, got {type(k).__name__}")
            _check_meta(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_meta(v, depth + 1)
    elif not isinstance(value, str | int | float | bool | bytes | None):
        raise WireError("bad_meta", f"unsupported metadata value {type(value).__name__}")


def parse_prefix(prefix: bytes, limits: Limits) -> tuple[int, int]:
    """Return ``(frame type, payload bytes to read)`` for a 5-byte frame prefix, or raise."""
    length, frame_type = FRAME_PREFIX.unpack(prefix)
    if length < 1:
        raise WireError("bad_frame", "zero-length frame")
    if length > limits.max_frame_bytes:
        raise MessageTooLarge("frame_too_large", f"{length} > {limits.max_frame_bytes} bytes")
    if frame_type not in (FRAME_HEAD, FRAME_DATA):
        raise WireError("bad_frame_type", str(frame_type))
    return frame_type, length - 1


class Assembler:
    """Turns a sequence of frames back into messages, validating everything on the way."""

    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self._pending: dict | None = None
        self._body = bytearray()
        self._filled = 0

    @property
    def mid_message(self) -> bool:
        return self._pending is not None

    def feed(self, frame_type: int, payload: bytes) -> Message | None:
        """Take one frame; return a message when it is complete."""
        if frame_type == FRAME_HEAD:
            if self._pending is not None:
                raise WireError("unexpected_frame", "HEAD frame before the previous message's data ended")
            header = self._parse_header(payload)
            if header["n"] == 0:
                return self._finish(header, bytearray())
            self._pending, self._body, self._filled = header, bytearray(header["n"]), 0
            return None
        if self._pending is None:
            raise WireError("unexpected_frame", "DATA frame without a HEAD")
        end = self._filled + len(payload)
        if end > len(self._body):
            raise WireError("size_mismatch", f"{end - len(self._body)} data bytes more than the header declared")
        self._body[self._filled : end] = payload
        self._filled = end
        if end < len(self._body):
            return None
        header, body = self._pending, self._body
        self._pending, self._body = None, bytearray()
        return self._finish(header, body)

    def _parse_header(self, payload: bytes) -> dict:
        if len(payload) > self.limits.max_header_bytes:
            raise MessageTooLarge("header_too_large", f"{len(payload)} > {self.limits.max_header_bytes}")
        try:
            header = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_str_len=1 << 16)
        except Exception as exc:  # msgpack raises several unrelated types
            raise WireError("bad_header", f"not msgpack: {type(exc).__name__}") from None
        if not isinstance(header, dict) or header.keys() != _HEADER_KEYS:
            raise WireError("bad_header", "header must be a map with keys v, k, id, m, t, n")
        if header["v"] != WIRE_VERSION:
            raise WireError("bad_version", f"wire version {header['v']!r:.20}, expected {WIRE_VERSION}")
        if header["k"] not in KINDS:
            raise WireError("unknown_kind", f"{header['k']!r:.40}")
        if not isinstance(header["id"], int) or isinstance(header["id"], bool) or not 0 <= header["id"] < 2**63:
            raise WireError("bad_header", "id must be a non-negative int")
        if not isinstance(header["m"], dict):
            raise WireError("bad_meta", "metadata must be a map")
        _check_meta(header["m"])
        if not isinstance(header["t"], list) or len(header["t"]) > self.limits.max_tensors:
            raise WireError("bad_tensor", f"tensors must be a list of at most {self.limits.max_tensors}")
        described = [tw.validate_descriptor(entry) for entry in header["t"]]
        total = sum(nbytes for _, _, nbytes in described)
        if header["n"] != total:
            raise WireError("size_mismatch", f"header says {header['n']!r:.20} bytes, tensors need {total}")
        if total > self.limits.max_message_bytes:
            raise MessageTooLarge("message_too_large", f"{total} > {self.limits.max_message_bytes} bytes")
        header["t"] = described
        return header

    @staticmethod
    def _finish(header: dict, body: bytearray) -> Message:
        tensors, offset = [], 0
        for name, shape, nbytes in header["t"]:
            tensors.append(tw.tensor_from_buffer(body, offset, name, shape))
            offset += nbytes
        return Message(header["k"], header["id"], header["m"], tensors)
