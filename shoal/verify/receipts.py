"""Signed step receipts: a server's signed statement of what it computed, and the client's checks.

A :class:`~shoal.wire.schema.Receipt` names the weights (a digest of the span's fingerprints and
quantization), the blocks, the session ("" for a stateless forward), the cache positions
``[position, position + n)``, the step id, digests of the inputs the server decoded and of the
output its receiver decodes, the LoRA adapter by its digest (:func:`adapter_tag`), the state of the
cache the step ran on (:mod:`shoal.verify.state`) and how the server computed (:func:`compute_label`:
dtype and device type). The server signs it with its node key: ed25519 over
``b"shoal/receipt/1\\0" + msgpack(every field but the signature)``, so a peer id (the hex public
key, as in :mod:`shoal.swarm.records`) is all a verifier needs, and a receipt cannot pass for a
record or anything else signed with the same key.

Digests (:func:`tensor_digest`): sha256 over each tensor's dtype, shape and raw bytes, truncated to
16 bytes (collisions need ~2^64 work; a server gains nothing from a second preimage of its own
output). sha256 rather than blake2b/blake3: this machine's CPUs hash sha256 in hardware (1.3 GB/s
against 0.6-0.9 GB/s for blake2b, measured), and it needs no extra dependency. A decode step of a
576-wide model digests 2.3 KB (about 2 us); signing costs about 33 us, verifying about 110 us.

The output digest is over the decoded tensor (the codec's round trip of the output, see
:func:`shoal.wire.tensors.roundtrip`), so the client recomputes it from the tensor it received, and
the next server of a push chain, which decodes the very same bytes, digests the same input: a
server that pushes one tensor onward and answers another (equivocation) is caught when the next
server's receipt of its inputs disagrees with the reply the client got (:class:`Equivocation`).
Which of the two lied is not decided here: the earlier server is the suspect (a later one could
frame it by signing a false input digest; recomputing on a third replica settles that).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import NewType

import msgspec
import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from torch import Tensor

from shoal.errors import ShoalError
from shoal.verify.state import EMPTY_STATE
from shoal.wire import Codec, Message
from shoal.wire.schema import Receipt, SpanInfo
from shoal.wire.tensors import dtype_name, roundtrip, tensor_bytes

SIGNING_CONTEXT = b"shoal/receipt/1\0"
DIGEST_CONTEXT = b"shoal/tensors/1\0"
WEIGHTS_CONTEXT = b"shoal/weights/1\0"
DIGEST_BYTES = 16
#: how long a server caught lying by its receipts stays out of this client's routes
LIAR_BAN_SECONDS = 3600.0
#: every field a receipt states (all but the signature), in wire order
FIELDS = tuple(f for f in Receipt.__struct_fields__ if f != "signature")
_encoder = msgspec.msgpack.Encoder()


class ReceiptError(ShoalError):
    """A server's receipt does not vouch for what it answered: a missing receipt, a bad signature,
    or a field that differs from what was asked or received. ``hop``: the chain index of the
    server held responsible (None outside a chain), ``peer``: its peer id, ``what``: the fields."""

    def __init__(self, message: str, *, peer: str, hop: int | None = None, what: Sequence[str] = ()):
        where = f"hop {hop} " if hop is not None else ""
        super().__init__(f"{where}server {peer[:10]}: {message}")
        self.peer = peer
        self.hop = hop
        self.what = tuple(what)


class MissingReceipt(ReceiptError):
    """Asked for a receipt, the reply carried none."""


class BadSignature(ReceiptError):
    """The receipt is not signed by the server's key."""


class ReceiptMismatch(ReceiptError):
    """The receipt states another computation than the one asked, or another output than the one
    received."""


class Equivocation(ReceiptError):
    """A pushed hop's inputs differ from what the server before it answered the client: that server
    (``peer``, at ``hop``) is the suspect of pushing one tensor and answering another; ``witness``
    is the pushed server whose receipt shows it."""

    def __init__(self, message: str, *, peer: str, hop: int | None, witness: str):
        super().__init__(message, peer=peer, hop=hop, what=("inputs",))
        self.witness = witness


def tensor_digest(tensors: Sequence[Tensor]) -> bytes:
    """16 bytes naming ``tensors`` exactly: their count, each one's dtype, shape and raw bytes."""
    hasher = hashlib.sha256(DIGEST_CONTEXT)
    hasher.update(len(tensors).to_bytes(2, "little"))
    for tensor in tensors:
        hasher.update(_encoder.encode((dtype_name(tensor.dtype), tuple(tensor.shape))))  # self-delimiting
        hasher.update(tensor_bytes(tensor))
    return hasher.digest()[:DIGEST_BYTES]


@functools.lru_cache(maxsize=1024)
def weights_digest(fingerprints: tuple[str, ...], quantization: str) -> bytes:
    """What a receipt's ``weights`` must be for a span with these block fingerprints and weight format."""
    body = _encoder.encode((list(fingerprints), quantization))
    return hashlib.sha256(WEIGHTS_CONTEXT + body).digest()[:DIGEST_BYTES]


def adapter_tag(digest: str | None) -> bytes:
    """What a receipt's ``adapter`` is for the adapter whose sha256 (hex, as ``AdapterInfo.digest``
    announces it) is ``digest``: its first 16 bytes; b"" for the base weights."""
    return bytes.fromhex(digest)[:DIGEST_BYTES] if digest else b""


#: how a receipt names a compute dtype, short (a receipt rides on every step): float32 is "f32"
SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_LONG_DTYPES = {short: name for name, short in SHORT_DTYPES.items()}
#: the device types a server may compute on, as torch names them: a receipt names one of these (the
#: tolerance knows each, :mod:`shoal.verify.compare`; a server on another type cannot be verified)
COMPUTE_DEVICES = ("cpu", "cuda", "mps", "xpu", "hpu", "npu")
#: a compute label: "f32/cpu", "bf16/cuda" (a member of :data:`COMPUTE_LABELS`)
ComputeLabel = NewType("ComputeLabel", str)
#: every label a receipt's ``compute`` (and a server's announcement) may say, the one fixed list:
#: a dtype servers compute in over a device type. Anything else is refused by clients and judges
#: (a liar would pick its own tolerance); a listed label other than the one the server announced
#: is refused too (:func:`verify_receipt`), so no label buys a wider tolerance.
COMPUTE_LABELS: frozenset[ComputeLabel] = frozenset(
    ComputeLabel(f"{short}/{device}") for short in _LONG_DTYPES for device in COMPUTE_DEVICES
)


def compute_label(dtype: str, device: str | torch.device) -> ComputeLabel:
    """What a receipt's ``compute`` is for a span computing in ``dtype`` ("float32", as SpanInfo says)
    on ``device`` ("cpu", "cuda:1": only its type counts): "f32/cpu", "bf16/cuda". ``ValueError``
    for a pair outside :data:`COMPUTE_LABELS` (a server there could not be verified)."""
    label = f"{SHORT_DTYPES.get(dtype, dtype)}/{torch.device(device).type}"
    if label not in COMPUTE_LABELS:
        raise ValueError(f"no compute label for {dtype} on {device}: receipts name one of {sorted(COMPUTE_LABELS)}")
    return ComputeLabel(label)


def announced_compute(dtype: str, device: str | torch.device) -> str:
    """What a server announces and signs as its ``compute``: :func:`compute_label`, or "" where that
    pair has no label (clients and judges then refuse its receipts: it cannot be verified)."""
    try:
        return compute_label(dtype, device)
    except ValueError:
        return ""


def known_compute(compute: str) -> bool:
    """Whether ``compute`` is on the fixed list (:data:`COMPUTE_LABELS`): a label judges can hold a
    server to; anything else a client refuses and a judge finds forged."""
    return compute in COMPUTE_LABELS


def compute_dtype(compute: str) -> str:
    """The dtype a receipt's ``compute`` names, as SpanInfo says it ("bfloat16" of "bf16/cuda")."""
    short = compute.partition("/")[0]
    return _LONG_DTYPES.get(short, short)


def receipt_body(receipt: Receipt) -> bytes:
    """The bytes a receipt's signature covers (after :data:`SIGNING_CONTEXT`)."""
    return _encoder.encode(tuple(getattr(receipt, name) for name in FIELDS))


class ReceiptSigner:
    """A server's node key, signing receipts (ed25519; the peer id is the public key)."""

    def __init__(self, secret_key: bytes):
        self._key = Ed25519PrivateKey.from_private_bytes(secret_key)
        self.peer_id = self._key.public_key().public_bytes_raw().hex()

    def sign(self, receipt: Receipt) -> Receipt:
        """``receipt`` (its signature field ignored) signed."""
        signature = self._key.sign(SIGNING_CONTEXT + receipt_body(receipt))
        return msgspec.structs.replace(receipt, signature=signature)


def sign_receipt(
    signer: ReceiptSigner,
    *,
    weights: bytes,
    start: int,
    end: int,
    session: str,
    position: int,
    step: int,
    inputs: Sequence[Tensor],
    output: Tensor,
    codec: Codec = Codec.RAW,
    adapter: bytes = b"",
    prompts: bool = False,
    state: bytes = EMPTY_STATE,
    compute: str = "",
) -> Receipt:
    """The signed receipt of one computation: ``inputs`` as the server decoded them (hidden first),
    ``output`` as its receiver decodes it (travelling in ``codec``), with ``adapter`` (its
    :func:`adapter_tag`) and deep ``prompts`` or without, on a cache in ``state`` (the chain digest
    at ``position``), computed as ``compute`` (:func:`compute_label`)."""
    unsigned = _unsigned(weights, start, end, session, position, step, inputs, output, codec, adapter, prompts,
                         state, compute)  # fmt: skip
    return signer.sign(unsigned)


def _unsigned(
    weights: bytes, start: int, end: int, session: str, position: int, step: int, inputs: Sequence[Tensor],
    output: Tensor, codec: Codec, adapter: bytes, prompts: bool, state: bytes, compute: str,
) -> Receipt:  # fmt: skip
    """The receipt of blocks ``[start, end)`` computing ``output`` from ``inputs`` (hidden first), unsigned:
    what a server signs and what a client expects are built the same way."""
    return Receipt(
        weights=weights,
        start=start,
        end=end,
        session=session,
        position=position,
        n=inputs[0].shape[1],
        step=step,
        inputs=tensor_digest(inputs),
        outputs=tensor_digest([output]),
        codec=codec,
        adapter=adapter,
        prompts=prompts,
        state=state,
        compute=compute,
        signature=b"",
    )


def expected_receipt(
    *,
    start: int,
    end: int,
    fingerprints: Sequence[str],
    quantization: str,
    session: str,
    position: int,
    step: int,
    sent: Sequence[Tensor],
    output: Tensor,
    codec: Codec = Codec.RAW,
    adapter: bytes = b"",
    prompts: bool = False,
    dtype: str | None = None,
    state: bytes | None = None,
    compute: str | None = None,
) -> Receipt:
    """The receipt a client expects of blocks ``[start, end)`` given ``sent`` (the tensors the
    server decodes, hidden first) when it received ``output`` in ``codec``, asking for ``adapter``
    (the :func:`adapter_tag` of the digest that server announced for it) and deep ``prompts`` or
    not, on a cache in ``state`` (the chain of what the client sent that session before
    ``position``, :class:`~shoal.verify.state.StateChain`), from a server announcing it computes in
    ``dtype`` whose earlier receipts of the session signed ``compute``; unsigned. Left empty, so not
    compared (see :func:`verify_receipt`): ``weights`` unless ``fingerprints`` covers the span,
    ``state`` when None; ``compute`` is the earlier one, else ``dtype``, else empty."""
    known = len(fingerprints) == end - start
    weights = weights_digest(tuple(fingerprints), quantization) if known else b""
    return _unsigned(weights, start, end, session, position, step, sent, output, codec, adapter, prompts,
                     state or b"", compute or dtype or "")  # fmt: skip


def server_receipt(
    signer: ReceiptSigner | None,
    info: SpanInfo,
    request: Message,
    out: Tensor,
    session: str = "",
    position: int = 0,
    *,
    adapter: str | None = None,
    prompts: bool = False,
    state: bytes = EMPTY_STATE,
    device: str | torch.device = "cpu",
) -> Receipt | None:
    """What a server signs for ``request`` (a step, push or forward; ``session`` "" for a forward)
    whose output is ``out``: its span, the inputs it decoded, and ``out`` as the receiver decodes it
    (the codec's round trip: call after checking the codec carries it), run with ``adapter`` (a
    name of ``info.adapters``: the receipt signs its digest) and deep ``prompts`` or without, on a
    cache in ``state`` (a forward: the empty cache's), in ``info.dtype`` on ``device``. None without
    a key (such a server does not announce RECEIPTS)."""
    if signer is None:
        return None
    codec = request.codec_of(0)
    digest = next((a.digest for a in info.adapters if a.name == adapter), None) if adapter else None
    return sign_receipt(
        signer,
        weights=weights_digest(tuple(info.fingerprints), info.quantization.value),
        start=info.blocks.start,
        end=info.blocks.end,
        session=session,
        position=position,
        step=request.id,
        inputs=request.tensors,
        output=roundtrip(out, codec),
        codec=codec,
        adapter=adapter_tag(digest),
        prompts=prompts,
        state=state,
        compute=info.compute or announced_compute(info.dtype, device),
    )


@functools.lru_cache(maxsize=4096)
def _public_key(peer_id: str) -> Ed25519PublicKey | None:
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(peer_id))
    except ValueError:
        return None


def signed_by(receipt: Receipt, peer_id: str) -> bool:
    """Whether ``receipt`` carries ``peer_id``'s signature over its fields."""
    key = _public_key(peer_id)
    if key is None:
        return False
    try:
        key.verify(receipt.signature, SIGNING_CONTEXT + receipt_body(receipt))
    except InvalidSignature:
        return False
    return True


def verify_receipt(
    receipt: Receipt | None, peer_id: str, expected: Receipt, *, hop: int | None = None, previous: str | None = None
) -> Receipt:
    """Check ``receipt`` from ``peer_id`` against ``expected`` (what was asked and received, as
    :func:`expected_receipt` builds it). The rules: the signature must be ``peer_id``'s; ``state``
    exactly when expected states it (the client's chain of what it sent the session: a server that
    signs another state would make every piece of evidence against it look forged to judges,
    :mod:`shoal.verify.evidence`); ``weights`` only when expected states it; ``compute`` must be a
    label judges know (:func:`known_compute`), and equal expected's exactly when that is a label
    (the session's first receipt's: a server computes one way for the whole session), else on its
    dtype part when expected names one (servers announce their dtype, not their device);
    ``adapter`` exactly (the digest the server announced for the adapter asked for); every other
    field exactly. ``previous``: the peer id of the server that pushed this hop its inputs (at
    ``hop - 1``): a differing input digest is then its :class:`Equivocation`. Returns the receipt;
    raises a :class:`ReceiptError`."""
    if receipt is None:
        raise MissingReceipt("asked for a receipt, got none", peer=peer_id, hop=hop)
    if not signed_by(receipt, peer_id):
        raise BadSignature("the receipt is not signed by the server's key", peer=peer_id, hop=hop, what=("signature",))
    wrong = [name for name in FIELDS if not _agrees(name, getattr(receipt, name), getattr(expected, name))]
    if wrong == ["inputs"] and previous is not None:
        suspect = None if hop is None else hop - 1
        raise Equivocation(
            f"pushed hop {hop}'s server {peer_id[:10]} signed other inputs than this server answered",
            peer=previous,
            hop=suspect,
            witness=peer_id,
        )
    if wrong:
        stated = ", ".join(f"{name} {_shown(getattr(receipt, name))} (expected {_shown(getattr(expected, name))})"
                           for name in wrong)  # fmt: skip
        raise ReceiptMismatch(f"the receipt states {stated}", peer=peer_id, hop=hop, what=wrong)
    return receipt


def _agrees(name: str, stated: object, expected: object) -> bool:
    """Whether a receipt's field ``name`` says what the client expected (see :func:`verify_receipt`)."""
    if name in ("state", "weights") and not expected:
        return True
    if name == "compute":
        return _computes_as(str(stated), str(expected))
    return stated == expected


def _computes_as(stated: str, expected: str) -> bool:
    """Whether a receipt's ``compute`` is a known label saying what expected does: exactly, when that is
    a label (the session's first receipt's), else its dtype (the announced one; "": any)."""
    if not known_compute(stated):
        return False
    if "/" in expected:
        return stated == expected
    return not expected or compute_dtype(stated) == compute_dtype(expected)


def _shown(value: object) -> str:
    return value.hex() if isinstance(value, bytes) else repr(value)


__all__ = [
    "COMPUTE_DEVICES",
    "COMPUTE_LABELS",
    "LIAR_BAN_SECONDS",
    "SIGNING_CONTEXT",
    "BadSignature",
    "ComputeLabel",
    "Equivocation",
    "MissingReceipt",
    "Receipt",
    "ReceiptError",
    "ReceiptMismatch",
    "ReceiptSigner",
    "adapter_tag",
    "announced_compute",
    "compute_dtype",
    "compute_label",
    "expected_receipt",
    "known_compute",
    "receipt_body",
    "server_receipt",
    "sign_receipt",
    "signed_by",
    "tensor_digest",
    "verify_receipt",
    "weights_digest",
]
