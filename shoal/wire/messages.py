"""Messages and frames of wire version 2. Pure functions and a sans-I/O assembler: no sockets here.

A message travels as frames. Every frame is ``u32 length (big endian) | u8 type | payload``:

    HEAD  (type 1)  msgpack map {"v": 2, "k": kind, "id": request id, "m": metadata, "t": tensors,
                    "n": total tensor bytes}; metadata is the kind's struct (:mod:`shoal.wire.schema`),
                    tensors are ``[dtype, shape, codec]`` entries (:mod:`shoal.wire.tensors`;
                    the codecs: :mod:`shoal.wire.codecs`)
    DATA  (type 2)  the next bytes of the tensors, concatenated in order

A HEAD is followed by DATA frames until ``n`` bytes arrived (none when ``n == 0``). Frames carry at
most :data:`MAX_FRAME_PAYLOAD` bytes, so large tensors are chunked and the frame limit never limits
batch size or sequence length; only the receiver's ``max_message_bytes`` does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import torch

from shoal.errors import BadRequest, MessageTooLarge, WireError
from shoal.limits import MAX_FRAME_PAYLOAD, Limits
from shoal.wire import tensors as tw
from shoal.wire.codecs import Codec
from shoal.wire.schema import KINDS, Empty, ErrorReply, Meta, decode_meta, decode_reply

M = TypeVar("M", bound=Meta)
EMPTY = Empty()
_RAW = Codec.RAW

WIRE_VERSION = 2
FRAME_HEAD = 1
FRAME_DATA = 2
FRAME_PREFIX = struct.Struct(">IB")  # payload length (type byte included), frame type
_PACK_PREFIX = FRAME_PREFIX.pack


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    """A HEAD frame's payload. ``m`` stays raw until its kind's struct decodes it; ``t`` until the
    version is known to be ours (a v1 header's descriptors have another shape)."""

    v: int
    k: str
    id: int
    m: msgspec.Raw
    t: msgspec.Raw
    n: int


_HEADER_DECODER = msgspec.msgpack.Decoder(_Header)
_VERSION_DECODER = msgspec.msgpack.Decoder(dict)
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class Message:
    """One message: a kind, the request id it belongs to, typed metadata and tensors.

    ``codecs``: how each tensor travels, in order; tensors past its end (all of them when it is
    empty) travel raw. A received message's tensors are decoded already; its ``codecs`` says what
    they came in (empty: all raw). A received ``result`` keeps its metadata as msgpack until the
    requester, which knows what it asked, decodes it with :meth:`reply`."""

    kind: str
    id: int = 0
    meta: Meta | msgspec.Raw = EMPTY
    tensors: list[torch.Tensor] = field(default_factory=list)
    codecs: tuple[Codec, ...] = ()

    def codec_of(self, index: int) -> Codec:
        """The codec tensor ``index`` travels (or came) in."""
        return self.codecs[index] if index < len(self.codecs) else _RAW

    def reply(self, type_: type[M]) -> M:
        """This result's metadata as ``type_``; a reply that does not fit is the peer's fault:
        :class:`WireError` ``bad_reply`` naming the field."""
        meta = self.meta
        if isinstance(meta, type_):
            return meta
        if not isinstance(meta, msgspec.Raw):
            raise WireError("bad_reply", f"expected {type_.__name__} metadata, got {type(meta).__name__}")
        try:
            decoded = decode_reply(meta, type_)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise WireError("bad_reply", f"{type_.__name__}: {exc}") from None
        self.meta = decoded
        return decoded

    def error_info(self) -> tuple[str, str]:
        meta = self.meta
        if isinstance(meta, msgspec.Raw):
            try:
                meta = self.meta = decode_meta("error", meta)
            except BadRequest:
                return "internal", "malformed error reply"
        if isinstance(meta, ErrorReply):
            return meta.code, meta.message
        return "internal", ""


def error_message(request_id: int, code: str, message: str, reason: str | None = None) -> Message:
    return Message("error", request_id, ErrorReply(code=code, message=message[:2000], reason=reason))


class InvalidMessage(BadRequest):
    """A whole, well-framed message whose metadata does not validate: the stream stays usable, and
    the receiver answers request ``request_id`` with this error."""

    def __init__(self, request_id: int, kind: str, cause: BadRequest):
        super().__init__(cause.remote_message)
        self.request_id = request_id
        self.kind = kind


def frames(message: Message, limits: Limits = Limits()) -> list[list[bytes | memoryview]]:
    """The frames of ``message``, each as the pieces that concatenate to it. Tensor data comes as
    memoryviews of the tensors themselves, so a sender can write it without copying."""
    if message.kind not in KINDS:
        raise WireError("unknown_kind", message.kind)
    if message.codecs and any(codec is not _RAW for codec in message.codecs):
        encoded = [tw.encode_tensor(t, message.codec_of(i)) for i, t in enumerate(message.tensors)]
        entries, buffers = [entry for entry, _ in encoded], [data for _, data in encoded]
    else:  # all raw: the common case, the fewest calls
        entries, buffers = [tw.describe(t) for t in message.tensors], [tw.tensor_bytes(t) for t in message.tensors]
    total = sum(b.nbytes for b in buffers)
    header = _ENCODER.encode(
        {"v": WIRE_VERSION, "k": message.kind, "id": message.id, "m": message.meta, "t": entries, "n": total}
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
    """Turns a sequence of frames back into messages, validating everything on the way.

    A message's buffer grows with the data that arrived, never sized from its header: a header
    declaring a large message (up to ``max_message_bytes``) and no data holds no memory. Growing
    costs no more than filling a buffer reserved up front (a reservation is zero-filled first)."""

    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self._pending: _Header | None = None
        self._body = bytearray()

    @property
    def mid_message(self) -> bool:
        return self._pending is not None

    @property
    def missing(self) -> int:
        """Data bytes the unfinished message still expects (0 between messages)."""
        return 0 if self._pending is None else self._pending.n - len(self._body)

    def feed(self, frame_type: int, payload: bytes) -> Message | None:
        """Take one frame; return a message when it is complete."""
        if frame_type == FRAME_HEAD:
            if self._pending is not None:
                raise WireError("unexpected_frame", "HEAD frame before the previous message's data ended")
            header = self._parse_header(payload)
            if header.n == 0:
                return self._finish(header, bytearray())
            self._pending, self._body = header, bytearray()
            return None
        if self._pending is None:
            raise WireError("unexpected_frame", "DATA frame without a HEAD")
        declared = self._pending.n
        end = len(self._body) + len(payload)
        if end > declared:
            raise WireError("size_mismatch", f"{end - declared} data bytes more than the header declared")
        self._body += payload
        if end < declared:
            return None
        header, body = self._pending, self._body
        self._pending, self._body = None, bytearray()
        return self._finish(header, body)

    def _parse_header(self, payload: bytes) -> _Header:
        if len(payload) > self.limits.max_header_bytes:
            raise MessageTooLarge("header_too_large", f"{len(payload)} > {self.limits.max_header_bytes}")
        try:
            header = _HEADER_DECODER.decode(payload)
        except msgspec.ValidationError as exc:  # a subclass of DecodeError: first
            raise _header_error(payload, exc) from None
        except msgspec.DecodeError as exc:
            raise WireError("bad_header", f"not a v{WIRE_VERSION} header: {exc}") from None
        if header.v != WIRE_VERSION:
            raise WireError("bad_version", f"peer speaks wire version {header.v}, this peer speaks {WIRE_VERSION}")
        if header.k not in KINDS:
            raise WireError("unknown_kind", f"{header.k!r:.40}")
        if not 0 <= header.id < 2**63:
            raise WireError("bad_header", "id must be a non-negative int")
        described = tw.validate_descriptors(header.t, self.limits.max_tensors)
        total = sum(d.nbytes for d in described)
        if header.n != total:
            raise WireError("size_mismatch", f"header says {header.n!r:.20} bytes, tensors need {total}")
        allowed = self.limits.max_bytes_of(header.k)
        if total > allowed:
            raise MessageTooLarge("message_too_large", f"a {header.k} message of {total} > {allowed} bytes")
        header.t = described
        return header

    @staticmethod
    def _finish(header: _Header, body: bytearray) -> Message:
        tensors, offset, lossy = [], 0, False
        for desc in header.t:
            tensors.append(tw.decode_tensor(body, offset, desc))
            offset += desc.nbytes
            lossy = lossy or desc.codec is not _RAW
        codecs = tuple(d.codec for d in header.t) if lossy else ()
        if header.k == "result":
            return Message("result", header.id, header.m, tensors, codecs)
        try:
            meta = decode_meta(header.k, header.m)
        except BadRequest as exc:
            raise InvalidMessage(header.id, header.k, exc) from None
        return Message(header.k, header.id, meta, tensors, codecs)


def _header_error(payload: bytes, exc: msgspec.ValidationError) -> WireError:
    """A header that does not fit v2: a version error if it says another version (a v1 peer's
    header has another shape), else what is wrong with it."""
    try:
        version = _VERSION_DECODER.decode(payload).get("v")
    except (msgspec.DecodeError, msgspec.ValidationError, AttributeError):
        version = None
    if version != WIRE_VERSION and isinstance(version, int):
        return WireError("bad_version", f"peer speaks wire version {version}, this peer speaks {WIRE_VERSION}")
    return WireError("bad_header", f"header: {exc}")
