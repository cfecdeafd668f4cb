"""The typed metadata of every message kind (wire version 2), and the capabilities peers announce.

Each kind's metadata is a frozen msgspec struct, validated once where a message enters
(:func:`decode_meta`): a wrong type, a missing or unknown field, or a value out of range becomes a
:class:`~shoal.errors.BadRequest` whose text names the field (``... at `$.position```). Handlers and
clients only see these structs, never raw maps.

Room to grow without a new wire version: every peer announces :data:`capabilities <CAPABILITIES>`
(in ``hello``, ``info`` and its swarm record). A new optional field or a new message kind belongs to
a capability, and a sender includes it only when the other side announced that capability; so a
receiver never sees a field it does not know, and refuses one it does not know (strict structs)
instead of silently ignoring what the sender meant. ``result`` metadata is decoded by the requester,
which knows what it asked (:meth:`shoal.wire.Message.reply`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shoal.errors import BadRequest
from shoal.ids import BlockRange, PeerId, SessionId
from shoal.quantization.formats import Quantization
from shoal.wire.codecs import Codec
from shoal.wire.counters import ServerCounters
from shoal.wire.evidence import MAX_DISPUTED_STEPS, MAX_EVIDENCE_STEPS, EvidenceReply, EvidenceRequest, Receipt
from shoal.wire.fields import (
    MAX_BATCH,
    MAX_SESSION_LENGTH,
    AdapterName,
    Capabilities,
    Digest,
    Digest16,
    Empty,
    Meta,
    Position,
    Session,
    StepId,
    Text,
)

MAX_PUSH_HOPS = 64

#: Every capability this version of shoal knows, announced by servers (``info``, records) and by
#: every node (``hello``). Gate each new optional field or kind on one of these.
# step.push / the push kind: server-to-server hand-off of step outputs, each push with the token the
# client bound to the pushing peer (shoal.verify.tokens; "/2": plain "push" peers took the secret itself)
PUSH = "push/2"
CODEC_RAW = Codec.RAW.capability  # tensors as their raw bytes (every v2 peer)
CODEC_BF16 = Codec.BF16.capability  # float32 tensors as bfloat16 (shoal.wire.codecs)
CODEC_FP16 = Codec.FP16.capability  # float32 tensors as float16
CODEC_Q8 = Codec.Q8.capability  # float32 tensors as int8 blocks of 64 with a scale each
TRAIN = "train"  # the backward kind; deep prompts (``prompts``) on forward, backward and open
ADAPTERS = "adapters"  # ``adapter`` on forward, backward and open: run with one of the server's LoRA adapters
RECEIPTS = "receipts"  # ``receipt`` on step, push and forward: the reply carries a signed Receipt
#: announced in a server record (not a blocks capability): the server gives its model's chunks (shoal/weights)
WEIGHTS = "weights"
EVIDENCE = "evidence"  # the evidence kind: the server judges another's signed lie (shoal.server.judge)
SUB_SPAN = "sub-span"  # ``blocks`` on forward: run only those blocks of the span (an audit through pieces)
# the migrate and pages kinds: a session's KV pages handed to a replacement of the same span (shoal.server.migrate)
MIGRATE = "migrate"
CAPABILITIES = frozenset(
    {PUSH, TRAIN, ADAPTERS, RECEIPTS, EVIDENCE, SUB_SPAN, MIGRATE, *(codec.capability for codec in Codec)}
)


# ---- shoal/meta --------------------------------------------------------------------------------


#: bytes of a credential a peer presents in ``hello`` (a private swarm's member certificate)
MAX_CREDENTIAL = 512


class Hello(Meta):
    # what the dialling peer presents before its first connection of another protocol (sent only to
    # peers of a private swarm, all of which know the field): the receiver keeps it for its checks
    credential: Annotated[bytes, msgspec.Meta(max_length=MAX_CREDENTIAL)] | None = None


class HelloReply(Meta):
    protocols: list[Text]
    capabilities: Capabilities = frozenset()


class Ping(Meta):
    echo: bool = True  # echo the tensors back (False: only the round trip)


# ---- shoal/blocks ------------------------------------------------------------------------------


class AdapterInfo(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A LoRA adapter a server can run its span with: its name and the sha256 of the whole adapter's
    tensors (:func:`shoal.models.lora.adapter_digest`; the same on every server that loaded the
    same adapter, whatever blocks it serves, so a client can pin it)."""

    name: AdapterName
    digest: Digest


class SpanInfo(Meta):
    """What a server hosts: fixed while its span is loaded."""

    model: Text
    num_blocks: Annotated[int, msgspec.Meta(ge=1)]
    blocks: BlockRange
    fingerprints: list[Text]
    dtype: Text
    hidden_size: Annotated[int, msgspec.Meta(ge=1)]
    version: Text
    capabilities: Capabilities = CAPABILITIES
    # how the weights the fingerprints name are held (left out at full precision, as in records)
    quantization: Quantization = Quantization.NONE
    adapters: Annotated[tuple[AdapterInfo, ...], msgspec.Meta(max_length=64)] = ()  # needs ADAPTERS
    # how it computes, as its receipts sign it ("bf16/cuda", one of shoal.verify.receipts.COMPUTE_LABELS;
    # "" from a server predating the field): a receipt signing another label is refused
    compute: Annotated[str, msgspec.Meta(max_length=24)] = ""


def same_weights(a: SpanInfo, b: SpanInfo) -> bool:
    """Whether a server of ``b`` can take ``a``'s KV pages (MIGRATE): same model, blocks, weights, dtype."""
    return (a.model, a.num_blocks, a.blocks, a.fingerprints, a.dtype, a.quantization) == (
        b.model, b.num_blocks, b.blocks, b.fingerprints, b.dtype, b.quantization
    )  # fmt: skip


class InfoReply(Meta):
    """``info``'s result: the span and the server's state now, what routing needs. ``counters``
    only from a server that shares them (``--share-counters``): sessions opened and positions run
    tell a liar when an auditor replays its steps on a replica (the metrics endpoint has them)."""

    span: SpanInfo
    free_cache_tokens: Annotated[int, msgspec.Meta(ge=0)]
    draining: bool = False
    counters: ServerCounters | None = None


class OpenRequest(Meta):
    max_length: Annotated[int, msgspec.Meta(ge=1, le=MAX_SESSION_LENGTH)]
    batch_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH)] = 1
    # needs TRAIN: the open's one tensor holds the session's deep prompts, [span blocks, batch or 1,
    # N, hidden]; every step adds them to each block's input at positions [0, N)
    prompts: bool = False
    adapter: AdapterName | None = None  # needs ADAPTERS: the session runs with this LoRA adapter
    # positions [0, share) of every row whose KV pages the server may let OTHER peers reuse (a gateway's
    # system prompt: shoal.server.prefix); 0: only this peer's own later sessions reuse its pages
    share: Annotated[int, msgspec.Meta(ge=0, le=MAX_SESSION_LENGTH)] = 0


class ForwardRequest(Meta):
    """A stateless pass. Tensors: ``[hidden, position_ids, attention_mask?, prompts?]``."""

    prompts: bool = False  # needs TRAIN: the last tensor is the span's deep prompts (as OpenRequest's)
    adapter: AdapterName | None = None  # needs ADAPTERS
    receipt: bool = False  # needs RECEIPTS: answer with a ForwardReply carrying a signed Receipt
    # needs SUB_SPAN: only these blocks of the span (model indices, inside the server's span: checked
    # where it is served), without deep prompts or a receipt; None: the whole span
    blocks: BlockRange | None = None


class ForwardReply(Meta):
    """``forward``'s result when it asked for a receipt (else the result's metadata is empty)."""

    receipt: Receipt | None = None


class BackwardRequest(Meta):
    """Needs TRAIN: the gradient of a stateless pass's inputs. Tensors: ``[hidden, position_ids,
    attention_mask?, prompts?, grad_output]``; the result's are ``[grad_hidden, grad_prompts?]``.
    The server recomputes the forward with autograd (its parameters stay frozen)."""

    prompts: bool = False
    adapter: AdapterName | None = None


class OpenReply(Meta):
    session: Session
    token: Text  # the session's push secret: the client derives from it each previous server's push token
    max_length: int


class PushHop(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One server further down a chain: where to push, into which session, with the token that lets
    the server just before it (and no other peer) push there (:mod:`shoal.verify.tokens`)."""

    ticket: Text
    session: Session
    token: Text


PushRoute = Annotated[tuple[PushHop, ...], msgspec.Meta(max_length=MAX_PUSH_HOPS)]


class StepRequest(Meta):
    session: Session
    position: Position  # the session's length before this step
    # needs PUSH: the rest of the chain, to hand the output on to; each hop's token is bound to the hop
    # before it, so the tail a server passes on is no use to it (nor to anyone but its intended pusher)
    push: PushRoute = ()
    receipt: bool = False  # needs RECEIPTS: the reply carries a signed Receipt (pushed on to the chain)


class StepReply(Meta):
    position: Position  # the session's length after the step
    pushed: bool | None = None  # whether the hand-off to push[0] went out (None: no push asked)
    draining: bool = False  # the server is leaving: move this span before the next step
    receipt: Receipt | None = None  # when the step asked for one


class PushRequest(Meta):
    """A step handed on by the previous server (needs PUSH); answered on the session's stream."""

    session: Session
    token: Text
    position: Position
    step: StepId  # the client's step id: the reply goes out under it; older ones are dropped
    push: PushRoute = ()
    receipt: bool = False  # needs RECEIPTS: as the client's step asked (it asks a whole push segment or none)


class MigrateRequest(Meta):
    """Needs MIGRATE, on a session's stream: hand its KV pages of ``[0, position)`` to the session ``to``
    names on a server of the same span (:mod:`shoal.server.migrate`); an empty result once taken."""

    session: Session
    position: Annotated[int, msgspec.Meta(ge=1, le=MAX_SESSION_LENGTH)]
    step: StepId  # the client's id of this migration: the replacement reports under it
    to: PushHop  # its token: shoal.verify.tokens.migrate_token


class PagesRequest(Meta):
    """Needs MIGRATE, server to server: KV pages for ``session``. Tensors: keys and values ``[blocks,
    batch, position, kv heads, head dim]``, and u8 ``c_1 .. c_position`` (:mod:`shoal.verify.state`)."""

    session: Session
    token: Text
    position: Annotated[int, msgspec.Meta(ge=1, le=MAX_SESSION_LENGTH)]
    step: StepId
    model: Text  # the sender's span, weights (shoal.verify.receipts.weights_digest) and cache dtype
    blocks: BlockRange
    weights: Digest16
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    adapter: AdapterName | None = None
    prompts: bool = False


class MigratedReply(Meta):
    """The replacement to the client (a result under the migration's ``step``): what it holds now."""

    position: Position
    state: Digest16  # c_position: the client checks it against its own chain before switching over


class ErrorReply(Meta):
    code: Text
    message: Text
    reason: Text | None = None  # wire errors: the frame problem's tag


# ---- shoal/weights -----------------------------------------------------------------------------


class ManifestRequest(Meta):
    """The chunk manifest of ``model`` (:mod:`shoal.checkpoints.manifest`), asked of a server that
    announced :data:`WEIGHTS`. Reply: ``result`` Empty ``[manifest u8]``, checked by the asker against
    the digest in the swarm's model record."""

    model: Text


class ChunkRequest(Meta):
    """Chunk ``chunk`` of item ``item`` of the manifest whose BLAKE3 digest is ``manifest`` (hex). Reply:
    ``result`` Empty ``[chunk u8]``, its size and digest checked by the asker; ``not_found`` when this
    peer gives another manifest or lacks the item, ``busy`` while it is giving all it may."""

    manifest: Digest
    item: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    chunk: Annotated[int, msgspec.Meta(ge=0, lt=1 << 24)]


class HeldRequest(Meta):
    """Which items of the manifest whose BLAKE3 digest is ``manifest`` (hex) this peer gives: a server
    that fetched its span holds only that span's items. Reply: ``result`` Empty ``[held u8]``, a
    byte per item of the manifest, 1 where held; ``not_found`` when this peer gives another manifest."""

    manifest: Digest


# ---- shoal/swarm -------------------------------------------------------------------------------


class Gossip(Meta):
    op: Annotated[str, msgspec.Meta(max_length=32)]


#: kind -> the struct its metadata decodes to. ``result``'s depends on the request (None here).
KIND_META: dict[str, type[Meta] | None] = {
    "hello": Hello,  # which protocols and capabilities a peer has (meta protocol)
    "ping": Ping,  # echo for liveness and round-trip measurement
    "info": Empty,  # what a server hosts
    "forward": ForwardRequest,  # stateless forward through a span
    "backward": BackwardRequest,  # gradient of a stateless forward's inputs (needs TRAIN)
    "open": OpenRequest,  # open an inference session
    "step": StepRequest,  # one inference step of a session
    "push": PushRequest,  # a server hands its step output to the next server of the chain
    "evidence": EvidenceRequest,  # another server's signed lie, to judge (needs EVIDENCE)
    "migrate": MigrateRequest,  # hand a session's KV pages to a replacement (needs MIGRATE)
    "pages": PagesRequest,  # a session's KV pages, server to server (needs MIGRATE)
    "close": Empty,  # close a session
    "gossip": Gossip,  # swarm record exchange; payload as one u8 tensor
    "manifest": ManifestRequest,  # a model's chunk manifest (shoal/weights)
    "chunk": ChunkRequest,  # one verified chunk of a model's weights (shoal/weights)
    "held": HeldRequest,  # which of a manifest's items a giver holds (shoal/weights)
    "result": None,  # a successful reply
    "error": ErrorReply,  # an error reply
}
KINDS = frozenset(KIND_META)

_DECODERS = {kind: msgspec.msgpack.Decoder(t) for kind, t in KIND_META.items() if t is not None}
_REPLY_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}


def decode_meta(kind: str, raw: bytes | msgspec.Raw) -> Meta:
    """The metadata of a ``kind`` request, validated: the one place that turns malformed metadata
    into :class:`BadRequest` (its text names the field)."""
    try:
        return _DECODERS[kind].decode(raw)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {kind} metadata: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"{kind} metadata is not msgpack: {exc}") from None


def decode_reply(raw: bytes | msgspec.Raw, type_: type[Meta]) -> Meta:
    """A ``result``'s metadata as ``type_``; raises msgspec's errors (the caller decides whose fault)."""
    decoder = _REPLY_DECODERS.get(type_)
    if decoder is None:
        decoder = _REPLY_DECODERS[type_] = msgspec.msgpack.Decoder(type_)
    return decoder.decode(raw)


__all__ = [
    "ADAPTERS",
    "CAPABILITIES",
    "CODEC_BF16",
    "CODEC_FP16",
    "CODEC_Q8",
    "CODEC_RAW",
    "EVIDENCE",
    "KINDS",
    "KIND_META",
    "MAX_DISPUTED_STEPS",
    "MAX_EVIDENCE_STEPS",
    "MAX_PUSH_HOPS",
    "MAX_SESSION_LENGTH",
    "MIGRATE",
    "PUSH",
    "RECEIPTS",
    "SUB_SPAN",
    "TRAIN",
    "WEIGHTS",
    "AdapterInfo",
    "AdapterName",
    "BackwardRequest",
    "ChunkRequest",
    "Empty",
    "ErrorReply",
    "EvidenceReply",
    "EvidenceRequest",
    "ForwardReply",
    "ForwardRequest",
    "Gossip",
    "HeldRequest",
    "Hello",
    "HelloReply",
    "InfoReply",
    "ManifestRequest",
    "Meta",
    "MigrateRequest",
    "MigratedReply",
    "OpenReply",
    "OpenRequest",
    "PagesRequest",
    "PeerId",
    "Ping",
    "PushHop",
    "PushRequest",
    "Receipt",
    "ServerCounters",
    "SessionId",
    "SpanInfo",
    "StepReply",
    "StepRequest",
    "same_weights",
]
