"""Requests served without a session: ``forward`` (one pass, e.g. a client's stateless run or a
training forward) and ``backward`` (training: the gradient of a pass's inputs, recomputed with
autograd at the lowest priority of the compute thread). Both may carry deep prompts and name a LoRA
adapter. Codecs: an output travels in the codec the hidden states came in (:func:`in_kind`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shoal.errors import BadRequest, Unavailable, WireError
from shoal.ids import BlockRange, PeerId
from shoal.verify.receipts import server_receipt
from shoal.wire import Codec, Message, codecs
from shoal.wire.schema import BackwardRequest, ForwardReply, ForwardRequest

if TYPE_CHECKING:
    from shoal.server.handler import BlockServer


async def forward(server: BlockServer, request: Message, peer_id: PeerId) -> Message:
    """One pass over the span's blocks, or over the sub-range ``meta.blocks`` of them (receipt signed if asked)."""
    if server.draining:
        raise Unavailable("server is draining (leaving the swarm): use another server")
    meta: ForwardRequest = request.meta
    backend = server.backend
    sub = check_sub_range(server, meta)
    hidden, position_ids, mask, prompts = backend.forward_inputs(request.tensors, meta.prompts)
    check_positions(server, hidden, in_chunks=prompts is None)
    backend.check_adapter(meta.adapter)
    if sub is not None:
        out = await backend.run_blocks(hidden, position_ids, mask, sub.start, sub.end, adapter=meta.adapter,
                                       peer=peer_id)  # fmt: skip
    else:
        out = await backend.run(hidden, position_ids, mask, prompts=prompts, adapter=meta.adapter, peer=peer_id)
    server.counters.forward_requests += 1
    server.counters.forward_tokens += hidden.shape[0] * hidden.shape[1]
    codecs_out = in_kind(out, request)  # first: raises if the codec cannot carry the output
    receipt = None
    if meta.receipt:
        receipt = server_receipt(server.signer, server.info, request, out, adapter=meta.adapter, prompts=meta.prompts,
                                 device=backend.device)  # fmt: skip
    return Message("result", request.id, ForwardReply(receipt=receipt), [out], codecs_out)


async def backward(server: BlockServer, request: Message) -> Message:
    """The gradients of a stateless pass's inputs; they travel raw (no codec)."""
    if server.draining:
        raise Unavailable("server is draining (leaving the swarm): use another server")
    meta: BackwardRequest = request.meta
    backend = server.backend
    hidden, position_ids, mask, prompts, grad_output = backend.backward_inputs(request.tensors, meta.prompts)
    check_positions(server, hidden, in_chunks=False)
    backend.check_adapter(meta.adapter)
    grads = await backend.backward(hidden, position_ids, mask, grad_output, prompts=prompts, adapter=meta.adapter)
    server.counters.backward_requests += 1
    server.counters.backward_tokens += hidden.shape[0] * hidden.shape[1]
    return Message("result", request.id, tensors=grads)


def check_sub_range(server: BlockServer, meta: ForwardRequest) -> BlockRange | None:
    """The blocks a forward asks for when they are a proper part of the span (None: the whole span).
    They must lie inside the span; deep prompts and receipts are for whole spans only (a prompt
    tensor and a receipt name the span's blocks)."""
    blocks, span = meta.blocks, server.info.blocks
    if blocks is None or blocks == span:
        return None
    if not span.start <= blocks.start < blocks.end <= span.end:
        raise BadRequest(f"blocks {blocks.start}:{blocks.end} are not within this span {span.start}:{span.end}")
    if meta.prompts or meta.receipt:
        raise BadRequest("a forward over part of the span takes no deep prompts and signs no receipt")
    return blocks


def check_positions(server: BlockServer, hidden: torch.Tensor, in_chunks: bool) -> None:
    """A stateless pass of more positions (rows x tokens) than ``max_forward_positions`` is refused:
    one request must not hold the compute thread (or its memory) for minutes. A forward runs in
    chunks of positions (:meth:`~shoal.server.backend.SpanBackend.run`), so a task's attention memory
    stays linear in the row's length; a pass that cannot (a backward, a forward with deep prompts)
    holds a row's tokens x tokens scores at once, so its rows are capped too (``max_unchunked_row_tokens``)."""
    limits = server.limits
    rows, tokens = hidden.shape[:2]
    if rows * tokens > limits.max_forward_positions:
        raise BadRequest(
            f"a stateless pass of {rows * tokens} positions (rows x tokens) is over this server's limit of "
            f"{limits.max_forward_positions} (--max-forward-positions): split it, or use a session"
        )
    if not in_chunks and tokens > limits.max_unchunked_row_tokens:
        raise BadRequest(
            f"a backward or a forward with deep prompts of {tokens} tokens per row is over this server's limit "
            f"of {limits.max_unchunked_row_tokens} (--max-unchunked-row-tokens): use shorter sequences"
        )


def in_kind(out: torch.Tensor, request: Message) -> tuple[Codec, ...]:
    """The codecs of the reply to ``request``: ``out`` travels in the codec the hidden states came
    in. An output that codec cannot carry (q8: NaN or infinity) is the request's error."""
    codec = request.codec_of(0)
    if codec is Codec.RAW:
        return ()
    try:
        codecs.check(codec, out)
    except WireError as exc:
        raise BadRequest(f"the output cannot travel in codec {codec}: {exc}") from None
    return (codec,)


__all__ = ["backward", "check_positions", "check_sub_range", "forward", "in_kind"]
