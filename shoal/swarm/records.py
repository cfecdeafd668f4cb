"""Signed, expiring swarm records: what a server hosts, what a model is, and which server a judge
found lying (a verdict, :class:`VerdictRecord`; who is convicted: :mod:`shoal.swarm.verdicts`).

A record travels as ``msgpack([body, signature])``, or ``msgpack([body, signature, certificate])``
in a private swarm (its signer's member certificate, :mod:`shoal.swarm.members`, which tables check).
``body`` is the canonical msgpack list of the record's fields; the signature is ed25519 over
``b"shoal/record/1\\0" + body`` by the key of the peer the record names (a server signs its own
record; a model record is signed by its publisher, a verdict by its judge, a revocation of a
private swarm's member by the swarm's owner).
Peer ids are ed25519 public keys in hex (the same keys iroh uses for node ids).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from msgspec import DecodeError, ValidationError
from msgspec.msgpack import Decoder

from shoal.ids import BlockRange, OnBlocks
from shoal.quantization.formats import Quantization
from shoal.swarm.fields import (
    RecordError,
    as_peer,
    as_str,
    as_swarm,
    as_times,
    expect,
    is_adapter,
    is_int,
    is_num,
    is_peer,
    is_str,
)
from shoal.swarm.members import MAX_CERTIFICATE_BYTES
from shoal.verify.receipts import COMPUTE_LABELS, signed_by
from shoal.wire.schema import Receipt

SIGNING_CONTEXT = b"shoal/record/1\0"
MAX_RECORD_BYTES = 8192
MAX_QUEUED = 1 << 16  # a server record's queued steps (a deeper queue is announced as this many)
FINGERPRINT_BYTES = 32
MANIFEST_DIGEST_BYTES = 32  # BLAKE3
EVIDENCE_DIGEST_BYTES = 32  # a verdict names its evidence by sha256
MAX_RECEIPT_BYTES = 1024  # a receipt is about 150 bytes


class State(enum.StrEnum):
    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"


@dataclass(frozen=True)
class ServerRecord(OnBlocks):
    swarm: str
    peer: str
    addrs: tuple[str, ...]
    relay: str | None
    model: str
    blocks: BlockRange
    fingerprints: tuple[bytes, ...]  # one per block of the span
    state: State
    throughput: float  # tokens/s the server can sustain per block (given or measured; placement weighs by it)
    cache_tokens_free: int
    rtts: tuple[tuple[str, float], ...]  # (peer id, ms) to servers next in the chain, sorted
    version: str
    timestamp: float  # clock time of signing: a newer record supersedes an older one
    expires: float
    step_ms: float = 0.0  # measured latency of a one-token step through one block (0: unknown); routing uses it
    capabilities: tuple[str, ...] = ()  # what the server's protocol supports (shoal.wire.schema), sorted
    # how the server holds the weights the fingerprints name (those of the checkpoint it quantised);
    # sent only when quantised, so a full-precision record reads as before and a peer that predates
    # the field refuses a quantised one rather than route over it unaware
    quantization: Quantization = Quantization.NONE
    # LoRA adapters the server runs its span with, (name, sha256 hex of the whole adapter's tensors),
    # sorted by name; sent only when there are any (field 19, after quantization, then always sent)
    adapters: tuple[tuple[str, str], ...] = ()
    # how it computes, as its receipts sign it ("bf16/cuda": shoal.verify.receipts.COMPUTE_LABELS); sent
    # only when known (field 20, after quantization and adapters, then always sent): clients refuse a
    # receipt signing another label, judges hold the server to this one
    compute: str = ""
    # steps waiting in its batcher's queue when the record was signed (at most MAX_QUEUED): demand
    # placement reads a model's queued work; sent only when nonzero (field 21, after compute, then
    # always sent, compute "" when unknown)
    queued: int = 0

    TAG = "srv"

    @property
    def key(self) -> str:
        return f"s:{self.peer}"

    @property
    def signer(self) -> str:
        return self.peer

    def fields(self) -> list:
        return [
            self.swarm, self.peer, list(self.addrs), self.relay, self.model, self.blocks.start, self.blocks.end,
            list(self.fingerprints), str(self.state), self.throughput, self.cache_tokens_free,
            [list(r) for r in self.rtts], self.version, self.timestamp, self.expires, self.step_ms,
            list(self.capabilities),
            *([] if self.quantization is Quantization.NONE and not self.adapters and not self.compute
              and not self.queued else [str(self.quantization)]),
            *([[list(a) for a in self.adapters]] if self.adapters or self.compute or self.queued else []),
            *([self.compute] if self.compute or self.queued else []),
            *([self.queued] if self.queued else []),
        ]  # fmt: skip

    @classmethod
    def from_fields(cls, f: list) -> ServerRecord:
        # 15: before step_ms existed, 16: before capabilities, 17: full precision (or before quantization),
        # 18: no adapters (or before them), 19: no compute label (or before it), 20: nothing queued
        expect(len(f) in (15, 16, 17, 18, 19, 20, 21), "field count")
        swarm, peer, addrs, relay, model, start, end, fps, state, tput, free, rtts, version, ts, exp = f[:15]
        step_ms = f[15] if len(f) >= 16 else 0.0
        capabilities = f[16] if len(f) >= 17 else []
        quantization = f[17] if len(f) >= 18 else str(Quantization.NONE)
        adapters = f[18] if len(f) >= 19 else []
        compute = f[19] if len(f) >= 20 else ""
        queued = f[20] if len(f) == 21 else 0
        known = is_str(compute) and compute in COMPUTE_LABELS
        expect(len(f) < 20 or known or (len(f) == 21 and compute == ""), "compute")
        expect(is_int(queued) and 0 <= queued <= MAX_QUEUED and (len(f) != 21 or queued), "queued")
        expect(is_str(quantization) and quantization in Quantization.__members__.values(), "quantization")
        expect(len(f) != 18 or quantization != Quantization.NONE, "quantization")  # "none": only before adapters
        expect(isinstance(adapters, list) and len(adapters) <= 64 and (len(f) != 19 or adapters), "adapters")
        expect(all(is_adapter(a) for a in adapters), "adapters")
        expect(len({a[0] for a in adapters}) == len(adapters), "adapters")
        expect(is_num(step_ms) and 0 <= step_ms < 1e7, "step_ms")
        expect(isinstance(capabilities, list) and len(capabilities) <= 64, "capabilities")
        expect(all(is_str(c) and len(c) <= 64 for c in capabilities), "capabilities")
        expect(isinstance(addrs, list) and len(addrs) <= 16 and all(is_str(a) for a in addrs), "addrs")
        expect(relay is None or is_str(relay), "relay")
        expect(is_int(start) and is_int(end) and 0 <= start < end <= 1 << 20, "span")
        expect(isinstance(fps, list) and len(fps) == end - start, "fingerprints")
        expect(all(isinstance(x, bytes) and len(x) == FINGERPRINT_BYTES for x in fps), "fingerprints")
        expect(state in State.__members__.values(), "state")
        expect(is_num(tput) and tput >= 0 and is_int(free) and free >= 0, "throughput/cache")
        expect(isinstance(rtts, list) and len(rtts) <= 64, "rtts")
        expect(all(isinstance(r, list) and len(r) == 2 and is_peer(r[0]) and is_num(r[1]) for r in rtts), "rtts")
        expect(is_str(version), "version")
        return cls(
            as_swarm(swarm), as_peer(peer), tuple(addrs), relay, as_str(model), BlockRange(start, end), tuple(fps),
            State(state), float(tput), free, tuple((p, float(ms)) for p, ms in rtts), version, *as_times(ts, exp),
            float(step_ms), tuple(sorted(set(capabilities))), Quantization(quantization),
            tuple(sorted((name, digest) for name, digest in adapters)), compute, queued,
        )  # fmt: skip


@dataclass(frozen=True)
class ModelRecord:
    swarm: str
    publisher: str
    name: str
    num_blocks: int
    fingerprints: tuple[bytes, ...]  # one per block of the whole model
    timestamp: float
    expires: float
    # BLAKE3 of the model's chunk manifest (shoal.checkpoints.manifest), when its publisher holds every
    # file: members fetch the manifest from peers and check it against this; sent only when known
    manifest: bytes = b""

    TAG = "mdl"

    @property
    def key(self) -> str:
        return f"m:{self.name}"

    @property
    def signer(self) -> str:
        return self.publisher

    def fields(self) -> list:
        return [
            self.swarm,
            self.publisher,
            self.name,
            self.num_blocks,
            list(self.fingerprints),
            self.timestamp,
            self.expires,
            *([self.manifest] if self.manifest else []),
        ]

    @classmethod
    def from_fields(cls, f: list) -> ModelRecord:
        expect(len(f) in (7, 8), "field count")  # 7: no manifest (or before manifests)
        swarm, publisher, name, num_blocks, fps, ts, exp = f[:7]
        manifest = f[7] if len(f) == 8 else b""
        expect(is_int(num_blocks) and 0 < num_blocks <= 4096, "num_blocks")
        expect(isinstance(fps, list) and len(fps) == num_blocks, "fingerprints")
        expect(all(isinstance(x, bytes) and len(x) == FINGERPRINT_BYTES for x in fps), "fingerprints")
        expect(len(f) == 7 or (isinstance(manifest, bytes) and len(manifest) == MANIFEST_DIGEST_BYTES), "manifest")
        return cls(
            as_swarm(swarm), as_peer(publisher), as_str(name), num_blocks, tuple(fps), *as_times(ts, exp), manifest
        )


@dataclass(frozen=True)
class VerdictRecord(OnBlocks):
    """``judge`` (a server of ``model``) recomputed evidence that ``accused`` answered wrong outputs
    on ``blocks`` and found it lied. ``receipt``: the accused's signed receipt of the disputed step,
    msgpack as on the wire, so any peer can check that the accused really computed exactly those
    blocks (decoding checks its signature and its blocks: a verdict cannot name a server over a step
    it never signed, nor over blocks other than the step's).
    ``evidence``: sha256 of the evidence the judge recomputed. One per (judge, accused): a newer
    verdict of the same judge supersedes the older one."""

    swarm: str
    judge: str
    accused: str
    model: str
    blocks: BlockRange
    evidence: bytes
    receipt: bytes
    timestamp: float
    expires: float

    TAG = "vrd"

    @property
    def key(self) -> str:
        return f"v:{self.judge}:{self.accused}"

    @property
    def signer(self) -> str:
        return self.judge

    def fields(self) -> list:
        return [
            self.swarm, self.judge, self.accused, self.model, self.blocks.start, self.blocks.end, self.evidence,
            self.receipt, self.timestamp, self.expires,
        ]  # fmt: skip

    @classmethod
    def from_fields(cls, f: list) -> VerdictRecord:
        expect(len(f) == 10, "field count")
        swarm, judge, accused, model, start, end, evidence, receipt, ts, exp = f
        expect(is_int(start) and is_int(end) and 0 <= start < end <= 1 << 20, "span")
        expect(isinstance(evidence, bytes) and len(evidence) == EVIDENCE_DIGEST_BYTES, "evidence")
        expect(isinstance(receipt, bytes) and 0 < len(receipt) <= MAX_RECEIPT_BYTES, "receipt")
        record = cls(
            as_swarm(swarm), as_peer(judge), as_peer(accused), as_str(model), BlockRange(start, end), evidence, receipt,
            *as_times(ts, exp),
        )  # fmt: skip
        expect(record.judge != record.accused, "a judge cannot convict itself")
        disputed = record.disputed  # raises bad_receipt if it does not decode
        if (disputed.start, disputed.end) != (record.blocks.start, record.blocks.end):
            # pinned: a judge choosing other blocks could choose ones whose electorate it alone fills
            raise RecordError("bad_receipt", f"the receipt is of blocks {disputed.start}:{disputed.end}")
        return record

    @property
    def disputed(self) -> Receipt:
        """The accused's receipt, decoded (:class:`RecordError` ``bad_receipt`` if it does not)."""
        try:
            return _RECEIPT.decode(self.receipt)
        except (DecodeError, ValidationError) as exc:
            raise RecordError("bad_receipt", f"not a receipt: {exc}") from None

    def check_signed(self) -> None:
        """After the record's own signature: the receipt must carry the accused's (checked second,
        so a forged record costs one signature check, not two)."""
        if not _receipt_signed(self.receipt, self.accused):
            raise RecordError("bad_receipt", f"the receipt is not signed by the accused {self.accused[:10]}")


_RECEIPT = Decoder(Receipt)


@functools.lru_cache(maxsize=4096)
def _receipt_signed(receipt: bytes, accused: str) -> bool:
    """Memoised: a verdict arrives several times through gossip, and is re-signed while it stands."""
    return signed_by(_RECEIPT.decode(receipt), accused)


@dataclass(frozen=True)
class RevocationRecord:
    """The owner of a private swarm revokes the membership of ``member`` (until ``expires``: make it
    outlive the member's certificate)."""

    swarm: str
    owner: str  # the owner's public key: the signer, checked against the swarm id by tables
    member: str
    timestamp: float
    expires: float

    TAG = "rev"

    @property
    def key(self) -> str:
        return f"r:{self.member}"

    @property
    def signer(self) -> str:
        return self.owner

    def fields(self) -> list:
        return [self.swarm, self.owner, self.member, self.timestamp, self.expires]

    @classmethod
    def from_fields(cls, f: list) -> RevocationRecord:
        expect(len(f) == 5, "field count")
        swarm, owner, member, ts, exp = f
        return cls(as_swarm(swarm), as_peer(owner), as_peer(member), *as_times(ts, exp))


Record = ServerRecord | ModelRecord | VerdictRecord | RevocationRecord
_KINDS: dict[str, type] = {
    ServerRecord.TAG: ServerRecord,
    ModelRecord.TAG: ModelRecord,
    VerdictRecord.TAG: VerdictRecord,
    RevocationRecord.TAG: RevocationRecord,
}


@dataclass(frozen=True)
class SignedRecord:
    """A decoded, signature-checked record with the exact bytes it came as."""

    record: Record
    data: bytes  # msgpack([body, signature(, certificate)]): what gossip forwards unchanged
    cert: bytes | None = None  # the signer's member certificate (private swarms), not yet checked

    @property
    def key(self) -> str:
        return self.record.key

    @property
    def timestamp(self) -> float:
        return self.record.timestamp


def sign(record: Record, secret_key: bytes, cert: bytes | None = None) -> SignedRecord:
    """Sign ``record`` with the 32-byte ed25519 secret key of its signer; ``cert``: the signer's
    member certificate, carried along (private swarms)."""
    private = Ed25519PrivateKey.from_private_bytes(secret_key)
    if private.public_key().public_bytes_raw().hex() != record.signer:
        raise ValueError("the key does not belong to the peer the record names")
    body = msgpack.packb([record.TAG, 1, *record.fields()], use_bin_type=True)
    parts = [body, private.sign(SIGNING_CONTEXT + body), *([cert] if cert is not None else [])]
    return SignedRecord(record, msgpack.packb(parts, use_bin_type=True), cert)


MAX_VERIFIED = 65536  # signature checks remembered (about 10 MB: a digest each, not the record)
_verified_memo: OrderedDict[bytes, bool] = OrderedDict()
_verified_lock = threading.Lock()


def _verified(signer: str, body: bytes, signature: bytes) -> bool:
    """Signature check, memoised: gossip delivers the same record several times. Remembered by a
    digest of what was checked, so that a flood of distinct records (each up to MAX_RECORD_BYTES)
    does not stay in memory through this memo."""
    memo = hashlib.blake2b(signature + body, digest_size=16, key=bytes.fromhex(signer)).digest()
    with _verified_lock:
        hit = _verified_memo.get(memo)
        if hit is not None:
            _verified_memo.move_to_end(memo)
            return hit
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(signer)).verify(signature, SIGNING_CONTEXT + body)
        ok = True
    except (InvalidSignature, ValueError):
        ok = False
    with _verified_lock:
        _verified_memo[memo] = ok
        if len(_verified_memo) > MAX_VERIFIED:
            _verified_memo.popitem(last=False)
    return ok


def decode(data: bytes) -> SignedRecord:
    """Parse and verify one record, or raise :class:`RecordError` (``too_large``, ``malformed``,
    ``bad_signature``, ``bad_receipt``)."""
    if not isinstance(data, bytes) or len(data) > MAX_RECORD_BYTES:
        raise RecordError("too_large", f"{len(data) if isinstance(data, bytes) else '?'} > {MAX_RECORD_BYTES} bytes")
    try:
        body, signature, *cert = msgpack.unpackb(data, raw=False)
        fields = msgpack.unpackb(body, raw=False)
    except Exception:  # msgpack raises many types; any of them means garbage
        raise RecordError("malformed", "not msgpack [body, signature]") from None
    expect(isinstance(signature, bytes) and len(signature) == 64, "signature")
    expect(len(cert) <= 1 and all(isinstance(c, bytes) and len(c) <= MAX_CERTIFICATE_BYTES for c in cert), "cert")
    expect(isinstance(fields, list) and len(fields) >= 2 and fields[0] in _KINDS and fields[1] == 1, "kind/version")
    try:
        record = _KINDS[fields[0]].from_fields(fields[2:])
    except (TypeError, ValueError) as exc:
        raise RecordError("malformed", str(exc)) from None
    if not _verified(record.signer, body, signature):
        raise RecordError("bad_signature", f"record {record.key} is not signed by {record.signer[:10]}")
    if isinstance(record, VerdictRecord):
        record.check_signed()
    return SignedRecord(record, data, cert[0] if cert else None)
