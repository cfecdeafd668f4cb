"""What servers sign and what a judge is shown: the signed :class:`Receipt` that rides on step
and forward replies, and the ``evidence`` kind built from receipts (:mod:`shoal.wire.schema`
re-exports them; :mod:`shoal.verify` makes and checks them)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shoal.wire.codecs import Codec
from shoal.wire.fields import Digest, Digest16, Meta, Position, Session, Signature, StepId, Text

MAX_EVIDENCE_STEPS = 1 << 16  # receipts in one piece of evidence
MAX_DISPUTED_STEPS = 64  # of them, the last steps whose outputs it carries (what one audit compared)


class Receipt(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What a server computed, signed by its node key (:mod:`shoal.verify.receipts`): blocks
    ``[start, end)`` of the weights ``weights`` names, for ``session`` ("" for a forward) at cache
    positions ``[position, position + n)``, step (or forward request) ``step``; ``inputs`` and
    ``outputs`` digest the tensors it decoded and the output its receiver decodes; ``state`` names
    what its cache held at ``[0, position)`` (:mod:`shoal.verify.state`), ``adapter`` the LoRA
    adapter's tensors, ``compute`` how it computed. Compact on purpose (an array, about 185 bytes,
    200 with an adapter): one rides on every step reply of every hop."""

    weights: Digest16  # shoal.verify.receipts.weights_digest of the span's fingerprints and quantization
    start: Annotated[int, msgspec.Meta(ge=0)]
    end: Annotated[int, msgspec.Meta(ge=1)]
    session: Session
    position: Position
    n: Position
    step: StepId
    inputs: Digest16
    outputs: Digest16
    # how the output travelled (its digest is of the codec's round trip): a judge of evidence
    # compares within that codec's tolerance, and nobody can claim a tighter one for it
    codec: Codec
    # the LoRA adapter it ran with: the first 16 bytes of its AdapterInfo.digest (b"" none): a name
    # alone would let a judge holding another adapter of that name convict an honest server
    adapter: Annotated[bytes, msgspec.Meta(max_length=16)]
    prompts: bool  # whether deep prompts joined the inputs (evidence cannot show them: not judged)
    # the chain digest of the cache's inputs at [0, position) (shoal.verify.state): a receipt from
    # before a rollback cannot pass for one of the cache a later step ran on
    state: Digest16
    # how it computed, f"{dtype}/{device type}" ("f32/cpu", "bf16/cuda"): a judge compares
    # within the coarser of its own and this (an honest bf16 or GPU server is not held to fp32 CPU noise)
    compute: Annotated[str, msgspec.Meta(max_length=24)]
    signature: Signature  # ed25519 by the server's node key (its peer id) over the other fields


class EvidenceRequest(Meta):
    """Evidence that server ``accused`` lied on blocks ``[start, end)`` of ``model`` (needs
    EVIDENCE; sent only to servers that serve those blocks). Tensors:
    ``[receipts u8, output [B, n, H], hidden [B, P, H], position_ids [B, P], attention_mask [B, P]?]``.

    ``receipts``: msgpack of a list of ``steps`` :class:`Receipt` (they do not fit a header), every
    step the accused signed for one session, in order, covering its cache positions ``[0, P)``
    contiguously; the last ``disputed`` are the disputed steps (the one holding the first wrong
    position and the steps after it that the client's audit compared: a lie spread over several
    one-position decode steps is judged by the same window rule the audit applied). ``output``:
    what the disputed steps answered, end to end, as their receiver decoded them (each one's slice
    is its receipt's ``outputs``). ``hidden``, ``position_ids`` and the
    mask: the inputs of block ``start`` at those positions as the accused decoded them (each
    receipt's ``inputs`` digests its slice, with the mask of ``[0, its end)`` when anything there
    is padded). The judge recomputes and confirms the lie or rejects the evidence
    (:mod:`shoal.server.judge`)."""

    model: Text
    accused: Digest  # a peer id: 64 hex digits
    start: Annotated[int, msgspec.Meta(ge=0)]
    end: Annotated[int, msgspec.Meta(ge=1)]
    steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_EVIDENCE_STEPS)]
    disputed: Annotated[int, msgspec.Meta(ge=1, le=MAX_DISPUTED_STEPS)] = 1


class EvidenceReply(Meta):
    """The judge's finding: ``confirmed`` (it signed and gossips a verdict), else ``reason``: a short
    tag (``forged``, ``replayed``, ``framing``, ``not_judged``...) naming why, with ``detail``."""

    confirmed: bool
    reason: Annotated[str, msgspec.Meta(max_length=32)] = ""
    detail: Text = ""
