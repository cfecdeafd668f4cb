"""Malformed input for a live peer: the fuzz material of ``tests/transport/test_fuzz.py``,
``tests/attacks/test_fuzz_short.py`` and ``python -m bench.fuzz`` (:mod:`testkit.fuzzing`).

* Frames: :data:`MUTATIONS`, a valid message mutated field by field (header, sizes, kinds, codecs,
  frame order, truncation), each with the wire ``reason`` (or ``bad_request``) it must be answered
  with; :func:`random_case`, truncated, bit-flipped or random bytes (any outcome but a crash or a
  hang is fine).
* Metadata: :func:`meta_mutations`, every typed field of every request kind's metadata mutated
  (wrong type, missing, an unknown field next to it, out of range), each answered ``bad_request``
  naming the field on a stream that stays usable. The mutations come from the metadata structs
  themselves, so a new field is fuzzed without a change here (a new field *type* makes
  :func:`field_mutations` raise until it is taught it).
* :func:`send_raw_case` sends bytes on a fresh stream and reports the :class:`Outcome`.
"""

from __future__ import annotations

import random
import re
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import msgpack
import msgspec
import msgspec.inspect as mi
import torch

from shoal.errors import ClosedError, RequestTimeout, WireError
from shoal.ids import BlockRange
from shoal.protocols import WEIGHTS
from shoal.swarm.service import SWARM, blob
from shoal.transport import META, BaseNode, MessageStream, Protocol, Ticket
from shoal.wire import FRAME_DATA, FRAME_HEAD, FRAME_PREFIX, Message, encode
from shoal.wire.schema import (
    BackwardRequest,
    ChunkRequest,
    Empty,
    EvidenceRequest,
    ForwardRequest,
    Gossip,
    HeldRequest,
    Hello,
    ManifestRequest,
    Meta,
    MigrateRequest,
    OpenRequest,
    PagesRequest,
    Ping,
    PushHop,
    PushRequest,
    StepRequest,
)
from testkit.tiny import inputs

HIDDEN = 64  # testkit.tiny's hidden size
BAD_REQUEST = "bad_request"  # not a frame problem: metadata that fails validation (the stream goes on)


# ---- frames ------------------------------------------------------------------------------------
def frame(frame_type: int, payload: bytes) -> bytes:
    return struct.pack(">IB", len(payload) + 1, frame_type) + payload


def head(**changes) -> bytes:
    """A ping's HEAD frame declaring one f32 tensor of 16 bytes, with ``changes`` to its header."""
    header = {"v": 2, "k": "ping", "id": 7, "m": {"echo": True}, "t": [["f32", [4], "raw"]], "n": 16}
    header.update(changes)
    return frame(FRAME_HEAD, msgpack.packb(header, use_bin_type=True))


def raw(message: Message) -> bytes:
    """``message`` as the bytes a peer writes."""
    return b"".join(encode(message))


def count_frames(data: bytes) -> int:
    """Frames begun in ``data`` (as a receiver would delimit them; a cut or garbled one counts)."""
    count = at = 0
    while at < len(data):
        count += 1
        if len(data) - at < 5:
            break
        at += 4 + max(1, struct.unpack_from(">I", data, at)[0])
    return count


DATA16 = frame(FRAME_DATA, bytes(16))

#: Field-by-field mutations of a valid message, each with the rejection reason it must produce.
MUTATIONS: list[tuple[str, bytes]] = [
    ("frame_too_large", struct.pack(">IB", 1 << 30, FRAME_HEAD)),
    ("bad_frame", struct.pack(">IB", 0, FRAME_HEAD)),
    ("bad_frame_type", struct.pack(">IB", 5, 7) + b"abcd"),
    ("unexpected_frame", DATA16),
    ("unexpected_frame", head() + head()),
    ("bad_header", frame(FRAME_HEAD, b"\xc1not msgpack")),
    ("bad_header", frame(FRAME_HEAD, msgpack.packb([1, 2]))),
    ("bad_header", head(id=-5) + DATA16),
    ("bad_header", frame(FRAME_HEAD, msgpack.packb({"v": 2, "k": "ping"}))),
    ("bad_header", head(extra=1) + DATA16),
    ("bad_version", head(v=99) + DATA16),
    ("bad_version", head(v=1, m={"x": 1}, t=[["f32", [4]]]) + DATA16),  # what a v1 peer sends
    ("unknown_kind", head(k="launch") + DATA16),
    (BAD_REQUEST, head(m={"echo": "yes"}) + DATA16),
    (BAD_REQUEST, head(m={"a": [[[[[[1]]]]]]}) + DATA16),
    (BAD_REQUEST, head(m=[1, 2]) + DATA16),
    ("bad_tensor", head(t="f32") + DATA16),
    ("bad_tensor", head(t=[["f32", [4]]]) + DATA16),  # a v1 descriptor
    ("bad_tensor", head(t=[["f32", [0], "raw"]] * 65, n=0)),
    ("unknown_dtype", head(t=[["f128", [4], "raw"]]) + DATA16),
    ("unknown_codec", head(t=[["f32", [4], "zstd"]]) + DATA16),
    ("bad_shape", head(t=[["f32", [-4], "raw"]]) + DATA16),
    ("bad_shape", head(t=[["f32", [1] * 9, "raw"]], n=4) + DATA16),
    ("bad_tensor", head(t=[["f32", ["4"], "raw"]]) + DATA16),
    ("size_mismatch", head(n=15) + DATA16),
    ("size_mismatch", head() + frame(FRAME_DATA, bytes(17))),
    ("message_too_large", head(t=[["u8", [1 << 30], "raw"]], n=1 << 30)),
    ("header_too_large", head(m={"pad": "z" * 70_000}) + DATA16),
    ("truncated", head() + frame(FRAME_DATA, bytes(16))[:12]),
    ("truncated", head()[:9]),
]


def random_case(rng: random.Random) -> bytes:
    """Truncated, bit-flipped or random bytes: any outcome but a crash or a hang is fine."""
    valid = raw(Message("ping", 3, Ping(), [torch.arange(4.0)]))
    choice = rng.randrange(3)
    if choice == 0:
        return valid[: rng.randrange(1, len(valid))]
    if choice == 1:
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    return rng.randbytes(rng.randint(1, 300))


# ---- outcomes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """How a peer answered what was sent: ``kind`` is ``error`` (then ``code``, and ``reason`` for a
    wire error), another reply kind (``result``), ``closed`` (the stream ended without a reply),
    ``reset`` (the peer stopped reading while we sent), ``timeout`` (no reply in time) or
    ``bad_reply`` (the peer's reply is malformed)."""

    kind: str
    code: str | None = None
    reason: str | None = None
    reply: Message | None = dataclass_field(default=None, compare=False, repr=False)  # a reply that is not an error

    @property
    def label(self) -> str:
        """An error's wire reason, else its code; any other outcome's kind."""
        return (self.reason or self.code or "error") if self.kind == "error" else self.kind

    def problem(self, expected: str | None) -> str | None:
        """What is wrong with this outcome for a case that must be answered ``expected`` (None: any
        answer is fine but a malformed error or no answer in time), or None."""
        if self.kind in ("timeout", "bad_reply"):
            return f"{expected}: {self.kind} {self.reason or ''}".rstrip()
        if self.kind == "error" and not ((self.code == "wire" and self.reason) or self.reason is None):
            return f"{expected}: a {self.code} error with a wire reason {self.reason!r}"
        if expected is not None and self.label != expected:
            return f"{expected}: answered {self.label}"
        return None


async def read_outcome(stream: MessageStream, timeout: float = 10.0, drain: bool = True) -> Outcome:
    """The next reply on ``stream`` as an :class:`Outcome`; with ``drain``, then wait for the peer
    to end the stream (what it does after a wire error or once we finished)."""
    try:
        reply = await stream.recv(timeout)
    except RequestTimeout:
        return Outcome("timeout")
    except ClosedError:
        return Outcome("closed")
    except WireError as exc:  # what the peer sent us is malformed
        return Outcome("bad_reply", reason=exc.reason)
    if reply.kind == "error":
        code, _ = reply.error_info()
        outcome = Outcome("error", code, reply.meta.reason)
    else:
        outcome = Outcome(reply.kind, reply=reply)
    if drain:
        try:
            await stream.recv(timeout)
        except (ClosedError, WireError, RequestTimeout):
            pass
    return outcome


async def send_raw_case(
    node: BaseNode, ticket: Ticket, protocol: Protocol, data: bytes, timeout: float = 10.0
) -> Outcome:
    """``data`` on a fresh stream of ``protocol``, then the end of our side; how the peer answered."""
    stream = await node.open_stream(ticket, protocol)
    try:
        await stream.send_raw(data)
        await stream.finish()
    except (ClosedError, WireError):
        return Outcome("reset")
    try:
        return await read_outcome(stream, timeout)
    finally:
        await stream.stop()


# ---- every typed metadata field of every request kind --------------------------------------------
UNKNOWN_FIELD = "zz_not_a_field"
PROTOCOL_OF: dict[str, Protocol] = {"hello": META, "ping": META, "gossip": SWARM, "manifest": WEIGHTS, "chunk": WEIGHTS,
                                   "held": WEIGHTS}  # fmt: skip
# others: BLOCKS
ON_SESSION_STREAM = {"step", "close"}  # push arrives on a stream of its own, as from the previous server


@dataclass(frozen=True)
class MetaMutation:
    kind: str
    field: str  # the field's path as msgspec names it in errors, e.g. "$.push[0][1]"
    how: str
    meta: Any  # the metadata sent, as msgpack builtins
    names: str  # what the error message must contain

    def message(self, request_id: int) -> Message:
        """The mutated request, with valid tensors: only its metadata is wrong."""
        meta = msgspec.Raw(msgspec.msgpack.encode(self.meta))
        return Message(self.kind, request_id, meta, tensors_for(self.kind, request_id))


def _bare(type_: mi.Type) -> mi.Type:
    """The type without metadata, and an optional one (``X | None``) as ``X``: None is a valid value,
    so the mutations are those of ``X``."""
    while True:
        if isinstance(type_, mi.Metadata):
            type_ = type_.type
            continue
        if isinstance(type_, mi.UnionType):
            types = [t for t in type_.types if not isinstance(t, mi.NoneType)]
            if len(types) == 1:
                type_ = types[0]
                continue
        return type_


def _wrong_type(type_: mi.Type) -> Any:
    """A value of another msgpack type than ``type_`` accepts."""
    if isinstance(type_, (mi.IntType, mi.FloatType)):
        return "7"
    if isinstance(type_, (mi.StrType, mi.BytesType)) or (isinstance(type_, mi.EnumType) and issubclass(type_.cls, str)):
        return 7
    if isinstance(type_, mi.BoolType):
        return 1
    if isinstance(type_, (mi.CollectionType, mi.StructType, mi.DictType)):
        return 7
    raise TypeError(f"no wrong-type value for {type_!r}: teach testkit.mutations the new field type")


def _out_of_range(type_: mi.Type, valid: Any) -> Iterator[tuple[str, Any]]:
    """Values just outside each bound ``type_`` declares (none if it declares none)."""
    if isinstance(type_, mi.IntType):
        if type_.ge is not None:
            yield "below range", type_.ge - 1
        if type_.gt is not None:
            yield "below range", type_.gt
        if type_.le is not None:
            yield "above range", type_.le + 1
        if type_.lt is not None:
            yield "above range", type_.lt
    elif isinstance(type_, mi.StrType):
        if type_.max_length is not None:
            yield "too long", "x" * (type_.max_length + 1)
        if type_.min_length:
            yield "too short", "x" * (type_.min_length - 1)
        if type_.pattern is not None:
            candidates = ("-x", " x", "x y", "x/y", "")
            yield "off pattern", next(c for c in candidates if not re.search(type_.pattern, c))
    elif isinstance(type_, mi.EnumType):
        yield "not a member", "x-no-such-member"
    elif isinstance(type_, mi.CollectionType) and (type_.max_length is not None or type_.min_length):
        assert valid, "a sample with at least one item is needed to build a collection out of range"
        if type_.max_length is not None:
            yield "too many", [valid[0]] * (type_.max_length + 1)
        if type_.min_length:
            yield "too few", [valid[0]] * (type_.min_length - 1)


def field_mutations(struct: type, valid: Any, path: str = "$") -> Iterator[tuple[str, str, Any, str]]:
    """``(field path, how, mutated value, text the error must contain)`` for every field of
    ``struct`` and of the structs inside it, from msgspec's type information. ``valid`` is a valid
    value in msgpack builtins, holding a sample of every nested struct."""
    info = mi.type_info(struct)
    for index, field in enumerate(info.fields):
        key = index if info.array_like else field.encode_name
        at = f"{path}[{index}]" if info.array_like else f"{path}.{field.encode_name}"
        type_ = _bare(field.type)

        def put(value: Any, key: int | str = key) -> Any:
            copy = list(valid) if info.array_like else dict(valid)
            copy[key] = value
            return copy

        yield at, "wrong type", put(_wrong_type(type_)), f"`{at}`"
        if field.required and info.array_like:
            names = f"at least length {len(info.fields)}, got {index} - at `{path}`"
            yield at, "missing", list(valid[:index]), names
        elif field.required:
            yield at, "missing", {k: v for k, v in valid.items() if k != key}, f"missing required field `{key}`"
        current = valid[key] if info.array_like or key in valid else None
        for how, value in _out_of_range(type_, current):
            yield at, how, put(value), f"`{at}`"
        inner = _bare(type_.item_type) if isinstance(type_, mi.CollectionType) else type_
        if isinstance(inner, mi.StructType):
            assert current, f"the sample of {at} must hold a {inner.cls.__name__} to fuzz inside it"
            if inner is type_:
                for sub in field_mutations(inner.cls, current, at):
                    yield sub[0], sub[1], put(sub[2]), sub[3]
            else:  # a collection of structs: mutate the first item
                for sub in field_mutations(inner.cls, current[0], f"{at}[0]"):
                    yield sub[0], sub[1], put([sub[2], *current[1:]]), sub[3]
    if info.array_like:
        yield f"{path}[{len(info.fields)}]", "unknown field", [*valid, "extra"], f"at most length {len(info.fields)}"
    else:
        yield (
            f"{path}.{UNKNOWN_FIELD}",
            "unknown field",
            {**valid, UNKNOWN_FIELD: 1},
            f"unknown field `{UNKNOWN_FIELD}`",
        )


def valid_requests(session: str, token: str, hop: PushHop) -> dict[str, Meta]:
    """Valid metadata of every request kind, every optional field set (so each is present to be
    mutated, and every nested struct has a sample)."""
    return {
        "hello": Hello(),
        "ping": Ping(echo=False),
        "info": Empty(),
        "forward": ForwardRequest(prompts=True, adapter="lora-1", receipt=True, blocks=BlockRange(0, 1)),
        "backward": BackwardRequest(prompts=True, adapter="lora-1"),
        "open": OpenRequest(max_length=16, batch_size=2, prompts=True, adapter="lora-1"),
        "step": StepRequest(session=session, position=0, push=(hop,), receipt=True),
        "push": PushRequest(session=session, token=token, position=0, step=1, push=(hop,), receipt=True),
        "close": Empty(),
        "evidence": EvidenceRequest(model="m", accused="ab" * 32, start=0, end=2, steps=3),
        "gossip": Gossip(op="table"),
        "manifest": ManifestRequest(model="m"),
        "chunk": ChunkRequest(manifest="ab" * 32, item=3, chunk=1),
        "held": HeldRequest(manifest="ab" * 32),
        "migrate": MigrateRequest(session=session, position=1, step=1, to=hop),
        "pages": PagesRequest(
            session=session,
            token=token,
            position=1,
            step=1,
            model="m",
            blocks=BlockRange(0, 1),
            weights=bytes(16),
            dtype="float32",
            adapter="lora-1",
            prompts=True,
        ),
    }


def meta_mutations(samples: dict[str, Meta]) -> list[MetaMutation]:
    out = []
    for kind, sample in samples.items():
        valid = msgspec.to_builtins(sample, builtin_types=(bytes,))  # bytes stay bytes (msgpack bin)
        for field, how, meta, names in field_mutations(type(sample), valid):
            out.append(MetaMutation(kind, field, how, meta, names))
    return out


def tensors_for(kind: str, seed: int) -> list[torch.Tensor]:
    """Valid tensors for a ``kind`` request to a span of a tiny model."""
    if kind in ("step", "push", "forward"):
        return inputs(HIDDEN, 1, seed=seed)
    if kind == "backward":
        return [*inputs(HIDDEN, 1, seed=seed), torch.ones(1, 1, HIDDEN)]
    if kind == "ping":
        return [torch.arange(4.0)]
    if kind == "gossip":
        return [blob(b"")]
    return []


#: Every error the server may answer a hostile peer with (wire reasons and error codes), and the ends
#: of streams it gives no reply on.
EXPECTED_ERRORS = frozenset(
    {reason for reason, _ in MUTATIONS}
    | {"bad_request", "not_found", "busy", "over_limit", "data_timeout", "truncated", "closed", "reset"}
)


@dataclass
class Stats:
    frames: int = 0
    cases: Counter[str] = dataclass_field(default_factory=Counter)
    errors: Counter[str] = dataclass_field(default_factory=Counter)
    valid_served: int = 0
    problems: list[str] = dataclass_field(default_factory=list)

    def outcome(self, outcome: Outcome, expected: str | None = None, case: str = "") -> None:
        """Count how a case was answered; a problem if not ``expected`` (None: any answer in time)."""
        if outcome.kind != "result":
            self.errors[outcome.label] += 1
        problem = outcome.problem(expected)
        if problem is None and outcome.kind == "error" and outcome.label not in EXPECTED_ERRORS:
            problem = f"unexpected error {outcome.label}"
        if problem is not None:
            self.problems.append(f"{case}: {problem}")


def frame_data(payload: bytes, declare: int) -> bytes:
    """A DATA frame that declares ``declare`` payload bytes and carries ``payload``."""
    return FRAME_PREFIX.pack(declare + 1, FRAME_DATA) + payload


__all__ = [
    "BAD_REQUEST",
    "DATA16",
    "EXPECTED_ERRORS",
    "HIDDEN",
    "MUTATIONS",
    "ON_SESSION_STREAM",
    "PROTOCOL_OF",
    "UNKNOWN_FIELD",
    "MetaMutation",
    "Outcome",
    "Stats",
    "count_frames",
    "field_mutations",
    "frame",
    "frame_data",
    "head",
    "meta_mutations",
    "random_case",
    "raw",
    "read_outcome",
    "send_raw_case",
    "tensors_for",
    "valid_requests",
]
