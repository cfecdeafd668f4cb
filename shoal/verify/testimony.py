"""Building evidence of a settled lie on the client's side (what :mod:`shoal.verify.evidence` judges).

From a session's history (:class:`History`), :func:`build_evidence` takes the liar's own signed
receipts of that session from position 0 through the disputed steps (:func:`disputed_receipts`: the
step holding the first wrong position and the later ones the audit compared, so a judge applies the
same window rule), the inputs of its first block and the disputed steps' outputs, and checks every
digest against them. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import torch
from torch import Tensor

from shoal.errors import ShoalError
from shoal.ids import BlockRange, PeerId
from shoal.verify.receipts import signed_by, tensor_digest
from shoal.wire import Message
from shoal.wire.schema import MAX_DISPUTED_STEPS, EvidenceRequest, Receipt
from shoal.wire.tensors import serial_copy

#: positions ``[0, P)`` one piece of evidence may cover at most (a judge recomputes all of them)
MAX_EVIDENCE_POSITIONS = 8192
#: bytes of tensors one piece of evidence may carry at most
MAX_EVIDENCE_BYTES = 64 << 20
_encode = msgspec.msgpack.Encoder().encode


class NoEvidence(ShoalError):
    """The client cannot build evidence of this lie (it logs why and testifies to nobody)."""


class History(Protocol):
    """What evidence is built from: a session's history (:class:`shoal.client.remote.history.SpanHistory`)."""

    def receipts(self, block: int) -> list[Receipt]: ...

    def window(self, block: int, start: int, end: int) -> list[Tensor]: ...

    def hidden(self, block: int, start: int, end: int) -> Tensor: ...


@dataclass(frozen=True)
class Evidence:
    """One piece of evidence, ready to send (:meth:`message`) to any judge."""

    meta: EvidenceRequest
    tensors: list[Tensor] = field(repr=False)  # [receipts u8, output, hidden, position_ids, mask?]

    @property
    def positions(self) -> int:
        return self.tensors[2].shape[1]

    def message(self, request_id: int = 1) -> Message:
        return Message("evidence", request_id, self.meta, self.tensors)


def step_tensors(hidden: Tensor, position_ids: Tensor, mask: Tensor | None, start: int, end: int) -> list[Tensor]:
    """The tensors a step over ``[start, end)`` sent (what its receipt's ``inputs`` digests): the
    slices, and the mask of ``[0, end)`` only when something there is padded (as the client sends)."""
    tensors = [_serial(hidden[:, start:end]), _serial(position_ids[:, start:end])]
    if mask is not None and not mask[:, :end].numpy().all():
        tensors.append(_serial(mask[:, :end]))
    return tensors


def _serial(tensor: Tensor) -> Tensor:
    """``tensor`` if contiguous, else a numpy-made copy: digesting a slice of a batch would copy it in
    torch, and the client digests in a worker thread that must never open an OpenMP pool of its own."""
    return tensor if tensor.is_contiguous() else serial_copy(tensor)


def covering_receipts(receipts: Sequence[Receipt], liar: PeerId, blocks: BlockRange, position: int) -> list[Receipt]:
    """The liar's receipts of the session in which it answered ``position`` wrong, covering
    ``[0, P)`` contiguously, the latest covering each position, the disputed step last. Raises
    :class:`NoEvidence` when they do not."""
    mine = [r for r in receipts if (r.start, r.end) == (blocks.start, blocks.end)]
    disputed = None
    for index in range(len(mine) - 1, -1, -1):  # the latest step covering the position
        receipt = mine[index]
        if receipt.position <= position < receipt.position + receipt.n and signed_by(receipt, liar):
            disputed = index
            break
    if disputed is None:
        raise NoEvidence(f"no receipt of {liar[:10]} covers position {position} of blocks {blocks}")
    session = mine[disputed].session
    kept: list[Receipt] = []
    for receipt in mine[: disputed + 1]:
        if receipt.session != session or not signed_by(receipt, liar):
            continue
        while kept and kept[-1].position >= receipt.position:  # re-sent: the later step overwrote it
            kept.pop()
        if kept and kept[-1].position + kept[-1].n > receipt.position:
            raise NoEvidence(f"a re-sent step at {receipt.position} split the step at {kept[-1].position}")
        kept.append(receipt)
    expected = 0
    for receipt in kept:
        if receipt.position != expected:
            raise NoEvidence(f"the liar's receipts do not cover positions {expected}:{receipt.position}")
        expected += receipt.n
    return kept


def disputed_receipts(
    receipts: Sequence[Receipt], liar: PeerId, blocks: BlockRange, position: int, through: int | None = None
) -> tuple[list[Receipt], int]:
    """(:func:`covering_receipts` up to the step holding ``through - 1``, how many of them are
    disputed: the step holding ``position`` and the later ones, at most :data:`MAX_DISPUTED_STEPS`).
    Without receipts that far, or ``through`` None, only the step holding ``position`` is."""
    chosen = covering_receipts(receipts, liar, blocks, position)
    if through is not None and through - 1 > position:
        try:
            chosen = covering_receipts(receipts, liar, blocks, through - 1)
        except NoEvidence:
            pass
    first = next(i for i, r in enumerate(chosen) if r.position + r.n > position)
    if chosen[first].position > position:  # a later session than the lie's: only the lie's step
        chosen = covering_receipts(receipts, liar, blocks, position)
        first = len(chosen) - 1
    chosen = chosen[: first + MAX_DISPUTED_STEPS]
    return chosen, len(chosen) - first


def outputs_named(disputed: Sequence[Receipt], output: Tensor) -> int | None:
    """The position of the first disputed receipt whose ``outputs`` is not the digest of its slice
    of ``output`` (the disputed steps' outputs end to end), or None when all are."""
    begin = disputed[0].position
    for receipt in disputed:
        rows = output[:, receipt.position - begin : receipt.position - begin + receipt.n]
        if tensor_digest([_serial(rows)]) != receipt.outputs:
            return receipt.position
    return None


def build_evidence(
    model: str, blocks: BlockRange, liar: PeerId, position: int, history: History, through: int | None = None
) -> Evidence:
    """Evidence that ``liar``, serving ``blocks`` of ``model``, answered wrong outputs at ``position``,
    from ``history`` (copies: the history may be truncated right after); ``through``: the end of
    the comparison that found it (its later steps up to there are disputed too: judges apply the
    same window rule). Every receipt's digests are checked against the tensors taken (a judge would
    reject what they do not name); raises :class:`NoEvidence` saying why there is none. Evidence of
    the later steps that cannot be built (too large, not in the history) falls back to the one
    holding ``position``."""
    if through is not None:
        try:
            return _build(model, blocks, liar, position, history, through)
        except NoEvidence:
            pass
    return _build(model, blocks, liar, position, history, None)


def _build(
    model: str, blocks: BlockRange, liar: PeerId, position: int, history: History, through: int | None
) -> Evidence:
    chosen, count = disputed_receipts(history.receipts(blocks.start), liar, blocks, position, through)
    disputed = chosen[-count:]
    end = disputed[-1].position + disputed[-1].n
    if end > MAX_EVIDENCE_POSITIONS:
        raise NoEvidence(f"the disputed step ends at position {end}, past {MAX_EVIDENCE_POSITIONS}")
    try:
        window = history.window(blocks.start, 0, end)
        output = history.hidden(blocks.end, disputed[0].position, end)
    except ShoalError as exc:
        raise NoEvidence(f"the history lacks the evidence's tensors: {exc}") from None
    hidden, position_ids = window[0], window[1]
    mask = window[2] if len(window) > 2 else None
    for receipt in chosen:
        sent = step_tensors(hidden, position_ids, mask, receipt.position, receipt.position + receipt.n)
        if tensor_digest(sent) != receipt.inputs:
            raise NoEvidence(f"the recorded inputs at {receipt.position} are not the ones the liar signed")
    if (wrong := outputs_named(disputed, output)) is not None:
        raise NoEvidence(f"the recorded output of the disputed step at {wrong} is not the one the liar signed")
    packed = torch.frombuffer(bytearray(_encode(chosen)), dtype=torch.uint8)
    tensors = [packed, serial_copy(output), serial_copy(hidden), serial_copy(position_ids)]
    if mask is not None:
        tensors.append(serial_copy(mask))
    size = sum(t.numel() * t.element_size() for t in tensors)
    if size > MAX_EVIDENCE_BYTES:
        raise NoEvidence(f"{size} bytes of evidence, past {MAX_EVIDENCE_BYTES}")
    meta = EvidenceRequest(model=model, accused=liar, start=blocks.start, end=blocks.end, steps=len(chosen),
                           disputed=count)  # fmt: skip
    return Evidence(meta, tensors)


__all__ = [
    "MAX_EVIDENCE_BYTES",
    "MAX_EVIDENCE_POSITIONS",
    "Evidence",
    "History",
    "NoEvidence",
    "build_evidence",
    "covering_receipts",
    "disputed_receipts",
    "outputs_named",
    "step_tensors",
]
