"""Evidence of a settled lie: what a client sends the other servers of the liar's blocks, and what they check.

After a majority of replicas convicted a server of wrong outputs (:mod:`shoal.client.verification.audit`), the
client testifies (:mod:`shoal.client.verification.witness`) with what anyone serving those blocks can recompute
without trusting the client: the liar's own signed receipts of one session, from cache position 0
up to the end ``P`` of the *disputed* steps (the step that holds the first wrong position and the
later ones the client's audit compared, at most :data:`~shoal.wire.schema.MAX_DISPUTED_STEPS`: the
last receipts), the inputs of its first block at ``[0, P)`` (hidden states, position ids and mask,
as the liar decoded them: each receipt's ``inputs`` digest names its slice exactly) and the
disputed steps' outputs as their receiver decoded them (each slice its receipt's ``outputs``): the
judge's comparison sees what the audit's did, the window rule included. It is built on the
client's side by :mod:`shoal.verify.testimony`. So a judge needs no history of
its own, and a client cannot make up inputs or outputs the accused did not sign.

A rollback re-sends steps over positions already computed: the latest receipt covering a position
wins (the liar's cache holds what that step wrote). A re-sent step that splits an earlier one (it
starts inside it) leaves positions no receipt names alone, and then there is no evidence to send.

The judge (:mod:`shoal.server.judge`) runs :func:`check_evidence`, whose checks come in order, each
failing with its :class:`Reason`: ``malformed`` (the tensors are not what the kind says),
``not_judged`` (not this judge's model, blocks or weights, an adapter it lacks (by digest: another
adapter of the same name is not the one the accused ran), deep prompts, which evidence cannot show,
too large, or about the judge itself), ``forged`` (a receipt not signed by the accused, of other
blocks, digests the tensors do not match, positions not contiguous from 0, mixed sessions, an unknown
``compute`` (:func:`~shoal.verify.receipts.known_compute`), or a cache ``state`` other than the chain of
the evidence's inputs to its position (:mod:`shoal.verify.state`): no receipt before a rollback joins later ones); then
the judge's own ``replayed`` (:class:`Ledger`: the same receipts judged before) and, after
recomputing, ``framing`` (:func:`finding`: the accused's outputs agree with the recomputation within
the tolerance of the coarsest of the output's dtype, the judge's compute dtype, the accused's signed
``compute`` dtype and the signed codec, with the uncalibrated-device margin when the accused signed
another device type than the judge's: :func:`shoal.verify.compare.tolerance_of`). Evidence is
bounded: at most :data:`MAX_EVIDENCE_POSITIONS` positions and :data:`MAX_EVIDENCE_BYTES` of tensors;
a lie later in a longer session is not testified to.

Pure: no I/O; the client's history is read through :class:`History`.
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch
from torch import Tensor

from shoal.errors import ShoalError
from shoal.ids import BlockRange, PeerId
from shoal.verify.compare import Tolerance, first_disagreement
from shoal.verify.receipts import adapter_tag, known_compute, signed_by, tensor_digest, weights_digest
from shoal.verify.state import EMPTY_STATE, chain_states
from shoal.verify.testimony import (
    MAX_EVIDENCE_BYTES,
    MAX_EVIDENCE_POSITIONS,
    Evidence,
    History,
    NoEvidence,
    build_evidence,
    covering_receipts,
    disputed_receipts,
    outputs_named,
    step_tensors,
)
from shoal.wire.schema import MAX_BATCH, EvidenceRequest, Receipt, SpanInfo

EVIDENCE_CONTEXT = b"shoal/evidence/1\0"
_encode = msgspec.msgpack.Encoder().encode
_decode_receipts = msgspec.msgpack.Decoder(list[Receipt]).decode
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Reason(enum.StrEnum):
    """Why a judge rejected evidence (the :class:`~shoal.wire.schema.EvidenceReply`'s ``reason``)."""

    MALFORMED = "malformed"
    NOT_JUDGED = "not_judged"
    FORGED = "forged"
    REPLAYED = "replayed"
    FRAMING = "framing"


class Rejected(ShoalError):
    """The judge's finding against the evidence: ``reason`` and, in words, ``detail``."""

    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"evidence rejected ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


# ---- the judge's side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    """What a judge serves, as far as judging goes: its model, blocks, weights, adapters, width, key."""

    model: str
    blocks: BlockRange
    fingerprints: tuple[str, ...]
    quantization: str
    adapters: dict[bytes, str]  # the adapters it can run: a receipt's ``adapter`` (digest tag) -> name
    hidden_size: int
    peer_id: PeerId

    @classmethod
    def of(cls, info: SpanInfo, peer_id: PeerId) -> Bench:
        adapters = {adapter_tag(a.digest): a.name for a in info.adapters}
        return cls(info.model, info.blocks, tuple(info.fingerprints), info.quantization.value, adapters,
                   info.hidden_size, peer_id)  # fmt: skip

    def weights(self, blocks: BlockRange) -> bytes:
        """The weights digest a receipt of ``blocks`` (within this span) states when they are ours."""
        first = blocks.start - self.blocks.start
        return weights_digest(self.fingerprints[first : first + len(blocks)], self.quantization)


@dataclass(frozen=True)
class Announced:
    """What the swarm holds an accused to on the evidence's blocks (from the judge's table): the
    weights digest of the pinned model record's fingerprints in the quantization the accused
    announced, and the compute label it announced ("": none). Given, the judge trusts neither claim
    of the receipts: it recomputes with the pinned weights whatever ``weights`` they sign, and
    compares within the announced label's tolerance whatever ``compute`` they sign."""

    weights: bytes
    compute: str = ""


@dataclass(frozen=True)
class Case:
    """Evidence that passed :func:`check_evidence`: what to recompute and what to compare it with."""

    accused: PeerId
    model: str
    blocks: BlockRange
    receipts: tuple[Receipt, ...] = field(repr=False)
    output: Tensor = field(repr=False)  # [B, n, H]: the disputed step's answer
    hidden: Tensor = field(repr=False)  # [B, P, H]: the inputs of block blocks.start at [0, P)
    position_ids: Tensor = field(repr=False)
    mask: Tensor | None = field(repr=False)
    key: bytes  # names the evidence for replay checks: sha256 over the receipts' signatures
    digest: bytes  # sha256 of the evidence (a verdict names it)
    adapter: str | None = None  # the judge's name of the adapter the accused ran (by its digest)
    compute: str = ""  # how the accused computed, as the judge holds it to (its announcement, else its receipts)
    disputed_steps: int = 1  # the last receipts whose outputs ``output`` holds, end to end

    @property
    def disputed(self) -> Receipt:
        """The last disputed step's receipt (a verdict shows it)."""
        return self.receipts[-1]

    @property
    def first_disputed(self) -> Receipt:
        return self.receipts[-self.disputed_steps]


def _malformed(detail: str) -> Rejected:
    return Rejected(Reason.MALFORMED, detail)


def _tensors(tensors: Sequence[Tensor], bench: Bench) -> tuple[list[Receipt], Tensor, Tensor, Tensor, Tensor | None]:
    """The evidence's tensors, checked for shape and dtype: (receipts, output, hidden, positions, mask)."""
    if len(tensors) not in (4, 5):
        raise _malformed(f"expected [receipts, output, hidden, position_ids, mask?], got {len(tensors)} tensors")
    packed, output, hidden, position_ids = tensors[:4]
    mask = tensors[4] if len(tensors) == 5 else None
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise _malformed(f"receipts must be a uint8 vector, got {packed.dtype} {list(packed.shape)}")
    try:
        receipts = _decode_receipts(packed.numpy().tobytes())
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _malformed(f"receipts are not a msgpack list of receipts: {exc}") from None
    if hidden.dtype not in FLOAT_DTYPES or hidden.dim() != 3 or hidden.shape[-1] != bench.hidden_size:
        raise _malformed(f"hidden must be float [B, P, {bench.hidden_size}], got {hidden.dtype} {list(hidden.shape)}")
    batch, positions = hidden.shape[:2]
    if not 1 <= batch <= MAX_BATCH or positions == 0:
        raise _malformed(f"hidden must have 1 to {MAX_BATCH} rows and some positions, got {list(hidden.shape)}")
    if output.dtype not in FLOAT_DTYPES or output.dim() != 3 or output.shape[0] != batch:
        raise _malformed(f"output must be float [{batch}, n, H], got {output.dtype} {list(output.shape)}")
    if output.shape[-1] != bench.hidden_size or not 1 <= output.shape[1] <= positions:
        raise _malformed(f"output must be [{batch}, 1..{positions}, {bench.hidden_size}], got {list(output.shape)}")
    if position_ids.dtype != torch.int64 or list(position_ids.shape) != [batch, positions]:
        raise _malformed(f"position_ids must be int64 [{batch}, {positions}], got {list(position_ids.shape)}")
    if mask is not None and (mask.dtype != torch.bool or list(mask.shape) != [batch, positions]):
        raise _malformed(f"the mask must be bool [{batch}, {positions}], got {mask.dtype} {list(mask.shape)}")
    return receipts, output, hidden, position_ids, mask


def _judged_here(
    meta: EvidenceRequest, receipts: Sequence[Receipt], tensors: Sequence[Tensor], bench: Bench,
    announced: Announced | None = None,
) -> None:  # fmt: skip
    """Raises ``not_judged`` unless this judge can recompute the evidence as the accused did (with
    ``announced``: as the swarm pins it to compute, whatever weights its receipts sign)."""
    blocks = BlockRange(meta.start, meta.end)
    if meta.model != bench.model:
        raise Rejected(Reason.NOT_JUDGED, f"about model {meta.model!r}; this server serves {bench.model!r}")
    if not bench.blocks.start <= blocks.start < blocks.end <= bench.blocks.end:
        raise Rejected(Reason.NOT_JUDGED, f"about blocks {blocks}; this server serves {bench.blocks}")
    if meta.accused == bench.peer_id:
        raise Rejected(Reason.NOT_JUDGED, "about this server itself")
    positions, size = tensors[2].shape[1], sum(t.numel() * t.element_size() for t in tensors)
    if positions > MAX_EVIDENCE_POSITIONS or size > MAX_EVIDENCE_BYTES:
        raise Rejected(Reason.NOT_JUDGED, f"too large: {positions} positions, {size} bytes")
    ours = bench.weights(blocks)
    if announced is not None and announced.weights != ours:
        raise Rejected(Reason.NOT_JUDGED, "the accused announces another weight format than this server's")
    for receipt in receipts:
        if receipt.prompts:
            raise Rejected(Reason.NOT_JUDGED, "deep prompts joined the inputs (evidence cannot show them)")
        if receipt.adapter and receipt.adapter not in bench.adapters:
            detail = f"ran with the adapter of digest {receipt.adapter.hex()}..., which this server lacks"
            raise Rejected(Reason.NOT_JUDGED, detail)
        if announced is None and receipt.weights != ours:
            raise Rejected(Reason.NOT_JUDGED, "states other weights than this server's (fingerprints, quantization)")


def _genuine(
    meta: EvidenceRequest, receipts: Sequence[Receipt], output, hidden, position_ids, mask, costly: bool = True
) -> None:
    """Raises ``forged`` unless every receipt is the accused's, of one session, contiguous from 0 to
    the tensors' end, and names exactly the tensors sent (``costly``: the signatures and digests too,
    else the caller runs :func:`_signed_and_named` itself, in parts)."""
    forged = lambda detail: Rejected(Reason.FORGED, detail)  # noqa: E731
    first = receipts[0]
    if not known_compute(first.compute):  # no honest server signs it: a liar would pick its own tolerance
        raise forged(f"an unknown compute {first.compute!r}")
    expected = 0
    for receipt in receipts:
        if (receipt.start, receipt.end) != (meta.start, meta.end):
            raise forged(f"a receipt of blocks {receipt.start}:{receipt.end}, not {meta.start}:{meta.end}")
        if (receipt.session, receipt.adapter, receipt.compute) != (first.session, first.adapter, first.compute):
            raise forged("receipts of mixed sessions")
        if receipt.position != expected:
            raise forged(f"positions not contiguous: a receipt at {receipt.position}, expected {expected}")
        expected += receipt.n
    if expected != hidden.shape[1]:
        raise forged(f"the receipts cover {expected} positions, the inputs {hidden.shape[1]}")
    disputed = receipts[-meta.disputed :]
    if len({r.codec for r in disputed}) > 1:  # one tolerance for all of them
        raise forged("disputed steps sent in different codecs")
    if outputs_named(disputed, output) is not None:  # at most 64 steps' rows: cheap, before the costly checks
        raise forged("the output is not the one the accused signed")
    if costly:  # the costly checks last
        _signed_and_named(meta.accused, receipts, disputed, output, hidden, position_ids, mask)


def _signed_and_named(accused: PeerId, receipts: Sequence[Receipt], disputed: Sequence[Receipt], output, hidden,
                      position_ids, mask, previous: Receipt | None = None) -> None:  # fmt: skip
    """The costly ``forged`` checks of ``receipts`` (a run of the evidence's, after ``previous``;
    None: from position 0): each signed by the accused, naming the inputs sent, and stating the
    cache state those inputs chain to at its position; with ``disputed`` (the disputed receipts,
    when the run ends with them), the output too."""
    forged = lambda detail: Rejected(Reason.FORGED, detail)  # noqa: E731
    for receipt in receipts:
        if not signed_by(receipt, accused):
            raise forged(f"the receipt at position {receipt.position} is not signed by the accused")
        sent = step_tensors(hidden, position_ids, mask, receipt.position, receipt.position + receipt.n)
        if tensor_digest(sent) != receipt.inputs:
            raise forged(f"the inputs at position {receipt.position} are not the ones the accused signed")
        if receipt.state != _state_after(previous, hidden, position_ids, mask):
            raise forged(f"the receipt at position {receipt.position} ran on another cache than these inputs "
                         "(a receipt from before a rollback?)")  # fmt: skip
        previous = receipt
    if disputed and outputs_named(disputed, output) is not None:
        raise forged("the output is not the one the accused signed")


def _state_after(receipt: Receipt | None, hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> bytes:
    """The cache state after ``receipt``'s step (its signed ``state`` chained over its inputs in the
    evidence): what the next receipt must state. None: the empty cache, position 0's."""
    if receipt is None:
        return EMPTY_STATE
    start, end = receipt.position, receipt.position + receipt.n
    columns = None if mask is None else mask[:, start:end]
    return chain_states(receipt.state, hidden[:, start:end], position_ids[:, start:end], columns)[-16:]


def check_evidence(
    meta: EvidenceRequest, tensors: Sequence[Tensor], bench: Bench, *, costly: bool = True,
    announced: Announced | None = None,
) -> Case:  # fmt: skip
    """Evidence sent to ``bench``, checked (malformed, not judged here, forged, in that order);
    raises :class:`Rejected`. Replays and the recomputation are the judge's. ``costly=False``: all
    but the signature and digest checks, which the caller then runs in parts (:func:`check_part`: a
    judge's compute tasks stay short). ``announced``: what the swarm holds the accused to (in a
    swarm; None: the receipts' own ``weights`` must be this judge's)."""
    receipts, output, hidden, position_ids, mask = _tensors(tensors, bench)
    if len(receipts) != meta.steps or not receipts:
        raise _malformed(f"the metadata says {meta.steps} receipts, the tensor holds {len(receipts)}")
    if meta.disputed > len(receipts):
        raise _malformed(f"{meta.disputed} disputed steps of {len(receipts)} receipts")
    disputed_positions = sum(r.n for r in receipts[-meta.disputed :])
    if output.shape[1] != disputed_positions:
        plural = "s" if meta.disputed > 1 else ""
        raise _malformed(f"the output has {output.shape[1]} positions, the disputed step{plural} {disputed_positions}")
    if meta.end <= meta.start:
        raise _malformed(f"empty blocks {meta.start}:{meta.end}")
    _judged_here(meta, receipts, tensors, bench, announced)
    _genuine(meta, receipts, output, hidden, position_ids, mask, costly)
    key = hashlib.sha256(b"".join(r.signature for r in receipts)).digest()
    digest = hashlib.sha256(EVIDENCE_CONTEXT + _encode(meta) + tensors[0].numpy().tobytes()).digest()
    blocks = BlockRange(meta.start, meta.end)
    adapter = bench.adapters.get(receipts[-1].adapter)  # None: the base weights (b"" is no adapter's tag)
    compute = announced.compute if announced is not None and announced.compute else receipts[-1].compute
    return Case(meta.accused, meta.model, blocks, tuple(receipts), output, hidden, position_ids, mask, key, digest,
                adapter, compute, meta.disputed)  # fmt: skip


def check_part(case: Case, first: int, last: int) -> None:
    """The signature and digest checks of receipts ``[first, last)`` of a case that
    :func:`check_evidence` passed with ``costly=False`` (the output's with the last receipt);
    raises ``forged``. Every part passed: the case is what ``costly=True`` would have returned."""
    receipts = case.receipts[first:last]
    disputed = case.receipts[-case.disputed_steps :] if last >= len(case.receipts) else ()
    previous = case.receipts[first - 1] if first > 0 else None  # signed: checked by the part before
    _signed_and_named(case.accused, receipts, disputed, case.output, case.hidden, case.position_ids, case.mask,
                      previous)  # fmt: skip


def finding(case: Case, recomputed: Tensor, tolerance: Tolerance) -> int:
    """The first position where the accused's disputed output disagrees with ``recomputed`` (the
    judge's outputs at ``[0, P)``) beyond ``tolerance``; raises ``framing`` when it agrees."""
    start = case.first_disputed.position
    rows = recomputed[:, start:]
    mask = case.mask[:, start:] if case.mask is not None else None
    wrong = first_disagreement(rows, case.output.to(rows.dtype), tolerance, mask)
    if wrong is None:
        detail = f"the accused's outputs at {start}:{start + case.output.shape[1]} recompute within tolerance"
        raise Rejected(Reason.FRAMING, detail)
    return start + wrong


class Ledger:
    """The evidence a judge has taken up (by :attr:`Case.key`), the most recent ``capacity``: the same
    receipts again are a replay. Bounded; an evicted one judged again only repeats its verdict."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)


__all__ = [
    "EVIDENCE_CONTEXT",
    "MAX_EVIDENCE_BYTES",
    "MAX_EVIDENCE_POSITIONS",
    "Announced",
    "Bench",
    "Case",
    "Evidence",
    "History",
    "Ledger",
    "NoEvidence",
    "Reason",
    "Rejected",
    "build_evidence",
    "check_evidence",
    "check_part",
    "covering_receipts",
    "disputed_receipts",
    "finding",
    "outputs_named",
    "step_tensors",
]
