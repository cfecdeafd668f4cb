"""The payloads of the swarm protocol (``shoal/swarm/2``), as frozen msgspec structs.

A ``gossip`` message's metadata names the op (:class:`shoal.wire.schema.Gossip`); its payload, the
bytes of its one u8 tensor, is one of these structs as msgpack. Payloads come from strangers, so
each is validated once, where it enters (:func:`decode_payload`): a wrong type, a missing or
unknown field, a length past its bound becomes ``RecordError("malformed", ...)`` whose text names
the field (``... - at `$.digest[3][1]```), which the receiver counts like any rejected record. The
signed records inside stay opaque bytes here: :func:`shoal.swarm.records.decode` checks each one
(a bad record is counted by its own reason, and the rest of its payload still counts).

    op      request                     reply
    offer   OfferRequest(digest)        OfferReply(wanted)
    push    PushRequest(records)        PushReply()
    sync    SyncRequest(digest)         SyncReply(records, wanted)
    table   (empty payload)             TableReply(records, rejected, unreachable, unprobed)
    ping    (empty payload)             (empty payload)              "do you answer?" (liveness)
    suspect SuspectRequest(peers)       SuspectReply()               "these did not answer me"

A digest is one bytes string of 16-byte entries (:data:`ENTRY`: a key id, the first
:data:`ID_BYTES` bytes of blake2b of the record's key, and the record's timestamp as a big-endian
float64), or a list ``[[key, timestamp], ...]``; ``wanted`` answers it in kind: the concatenated key
ids, or a list of keys. Fields at their default (empty) are left out of the encoding.
"""

from __future__ import annotations

import struct
from typing import Annotated, TypeVar

import msgspec

from shoal.swarm.fields import MAX_FIELD_LEN, RecordError
from shoal.swarm.liveness import MAX_REPORTED

ENTRY = struct.Struct(">8sd")  # key id, timestamp
ID_BYTES = 8
MAX_OFFER = 4096  # entries of an offer digest
MAX_PUSH = 4096  # records of a push
MAX_SYNC = 1 << 16  # entries of a sync digest, records of a sync or table reply
MAX_RECORD_WIRE = 1 << 16  # bytes of one record as carried; decode counts any over MAX_RECORD_BYTES as too_large
MAX_REASONS = 64  # distinct rejection reasons in a table reply

Key = Annotated[str, msgspec.Meta(max_length=MAX_FIELD_LEN + 2)]  # "s:" + peer id, "m:" + model name
Entries = tuple[tuple[Key, float], ...]  # [[key, timestamp], ...]
OfferDigest = (
    Annotated[bytes, msgspec.Meta(max_length=MAX_OFFER * ENTRY.size)]
    | Annotated[Entries, msgspec.Meta(max_length=MAX_OFFER)]
)
SyncDigest = (
    Annotated[bytes, msgspec.Meta(max_length=MAX_SYNC * ENTRY.size)]
    | Annotated[Entries, msgspec.Meta(max_length=MAX_SYNC)]
)
OfferWanted = (
    Annotated[bytes, msgspec.Meta(max_length=MAX_OFFER * ID_BYTES)]
    | Annotated[tuple[Key, ...], msgspec.Meta(max_length=MAX_OFFER)]
)
SyncWanted = (
    Annotated[bytes, msgspec.Meta(max_length=MAX_SYNC * ID_BYTES)]
    | Annotated[tuple[Key, ...], msgspec.Meta(max_length=MAX_SYNC)]
)
RecordData = Annotated[bytes, msgspec.Meta(max_length=MAX_RECORD_WIRE)]
PushRecords = Annotated[tuple[RecordData, ...], msgspec.Meta(max_length=MAX_PUSH)]
SyncRecords = Annotated[tuple[RecordData, ...], msgspec.Meta(max_length=MAX_SYNC)]
PeerIdText = Annotated[str, msgspec.Meta(max_length=MAX_FIELD_LEN)]
Reported = Annotated[tuple[PeerIdText, ...], msgspec.Meta(max_length=MAX_REPORTED)]
PeerList = Annotated[tuple[PeerIdText, ...], msgspec.Meta(max_length=MAX_SYNC)]
Rejected = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[int, msgspec.Meta(ge=0)]],
    msgspec.Meta(max_length=MAX_REASONS),
]


def _whole(field: str, value: object, size: int) -> None:
    """msgspec bounds lengths, not their divisors: a packed digest or id list must hold whole entries."""
    if isinstance(value, bytes) and len(value) % size:
        raise ValueError(f"`$.{field}` holds {len(value)} bytes, not whole {size}-byte entries")


class Payload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Base of every swarm payload."""


class OfferRequest(Payload):
    """A rumour: the keys (and versions) of records the sender learned lately."""

    digest: OfferDigest

    def __post_init__(self) -> None:
        _whole("digest", self.digest, ENTRY.size)


class OfferReply(Payload):
    """The offered keys the receiver lacks or holds older (in the digest's form)."""

    wanted: OfferWanted = b""

    def __post_init__(self) -> None:
        _whole("wanted", self.wanted, ID_BYTES)


class PushRequest(Payload):
    """Signed records, as :func:`shoal.swarm.records.sign` made them."""

    records: PushRecords = ()


class PushReply(Payload):
    pass


class SyncRequest(Payload):
    """Anti-entropy: the sender's whole table as a digest."""

    digest: SyncDigest

    def __post_init__(self) -> None:
        _whole("digest", self.digest, ENTRY.size)


class SyncReply(Payload):
    """The records the sender of the digest lacks or holds older, and the keys the receiver wants."""

    records: SyncRecords = ()
    wanted: SyncWanted = b""

    def __post_init__(self) -> None:
        _whole("wanted", self.wanted, ID_BYTES)


class TableReply(Payload):
    """A peer's whole table, for clients and status tools: its records, its rejection counts, and the
    servers (peer ids) it found ``unreachable`` or has not reached yet (``unprobed``)."""

    records: SyncRecords
    rejected: Rejected
    unreachable: PeerList = ()
    unprobed: PeerList = ()


class SuspectRequest(Payload):
    """Servers that did not answer the sender (see :mod:`shoal.swarm.liveness`)."""

    peers: Reported


class SuspectReply(Payload):
    pass


P = TypeVar("P", bound=Payload)
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}


def encode_payload(payload: Payload) -> bytes:
    return _ENCODER.encode(payload)


def decode_payload(data: bytes, type_: type[P]) -> P:
    """``data`` as a ``type_``, validated; ``RecordError("malformed", ...)`` naming the field if not."""
    decoder = _DECODERS.get(type_)
    if decoder is None:
        decoder = _DECODERS[type_] = msgspec.msgpack.Decoder(type_)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: first
        raise RecordError("malformed", f"invalid {type_.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise RecordError("malformed", f"{type_.__name__} is not msgpack: {exc}") from None
