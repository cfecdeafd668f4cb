"""Autograd through remote blocks: the stateless pass as a :class:`torch.autograd.Function`.

The forward runs the ordinary stateless pass (:meth:`RemoteSequence.run_forward
<shoal.client.remote.sequence.RemoteSequence.run_forward>`) and remembers, per span, which server computed it
and the hidden states it computed on (as that server decoded them). The backward walks those spans
in reverse: each server gets a ``backward`` request (:class:`~shoal.wire.schema.BackwardRequest`,
tensors ``[hidden_in, position_ids, attention_mask?, prompts?, grad_output]``, raw) and recomputes
its span's forward with autograd, its own weights frozen, answering the gradient of its input (and
of its slice of the deep prompts). So ``loss.backward()`` on a distributed model works as on a
local one, and the servers keep no activations between the two passes.

A server that fails before its backward (it died, or left) is banned, and that span's blocks
``[s, e)`` are routed again over other servers, maybe cut differently: the forward is recomputed
from the recorded input at ``s`` through the new route, then the backward runs through it in
reverse (recursively, if one of those fails too), up to
:data:`~shoal.client.remote.recovery.MAX_RECOVERIES` times per backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from shoal.client.remote.history import step_inputs
from shoal.client.remote.recovery import MAX_RECOVERIES, gave_up
from shoal.errors import BadRequest, ShoalError, WireError
from shoal.protocols import BLOCKS
from shoal.routing import ServerSpan
from shoal.wire import Message
from shoal.wire.schema import TRAIN, BackwardRequest

if TYPE_CHECKING:
    from shoal.client.remote.sequence import RemoteSequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Traced:
    """One span of a differentiable forward: its server and the hidden states that entered it."""

    span: ServerSpan
    hidden: Tensor


@dataclass
class _Backward:
    """One backward's shared state: its inputs, the prompts' gradient so far, what failed."""

    sequence: RemoteSequence
    position_ids: Tensor
    mask: Tensor | None
    prompts: Tensor | None
    grad_prompts: Tensor | None
    failed: set[str] = field(default_factory=set)
    recoveries: int = 0


class _ThroughServers(torch.autograd.Function):
    """``(sequence, hidden, prompts, position_ids, mask) -> output hidden``, differentiable in
    ``hidden`` and ``prompts``."""

    @staticmethod
    def forward(ctx, sequence, hidden, prompts, position_ids, mask):
        trace: list[Traced] = []
        prompts = None if prompts is None else prompts.detach()
        out = sequence.runtime.run(sequence.run_forward(hidden.detach(), position_ids, mask, prompts, trace=trace))
        ctx.sequence, ctx.trace, ctx.inputs = sequence, trace, (position_ids, mask, prompts)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        position_ids, mask, prompts = ctx.inputs
        grad_prompts = None if prompts is None else torch.zeros_like(prompts)
        state = _Backward(ctx.sequence, position_ids, mask, prompts, grad_prompts)
        grad = ctx.sequence.runtime.run(_backward_trace(state, ctx.trace, grad_output))
        return (
            None,
            grad if ctx.needs_input_grad[1] else None,
            grad_prompts if ctx.needs_input_grad[2] else None,
            None,
            None,
        )


def differentiable_forward(
    sequence: RemoteSequence, hidden: Tensor, position_ids: Tensor, mask: Tensor | None, prompts: Tensor | None
) -> Tensor:
    """The stateless pass of ``sequence``, with a backward through the same servers."""
    return _ThroughServers.apply(sequence, hidden, prompts, position_ids, mask)


async def _backward_trace(state: _Backward, trace: list[Traced], grad: Tensor) -> Tensor:
    """The gradient of the input of ``trace``'s first span, given that of its last span's output;
    the prompts' gradients add up in ``state.grad_prompts``."""
    for traced in reversed(trace):
        grad = await _backward_span(state, traced, grad)
    return grad


async def _backward_span(state: _Backward, traced: Traced, grad: Tensor) -> Tensor:
    span, sequence = traced.span, state.sequence
    part = None if state.prompts is None else state.prompts[span.start : span.end].contiguous()
    tensors = [*step_inputs(traced.hidden, state.position_ids, state.mask), *([] if part is None else [part])]
    tensors.append(grad.to(traced.hidden.dtype).contiguous())
    meta = BackwardRequest(prompts=part is not None, adapter=sequence.adapter)
    try:
        reply = await sequence.node.request(span.ticket, BLOCKS, Message("backward", 1, meta, tensors))
        grads = _checked(reply.tensors, traced.hidden, part, span)
    except BadRequest:
        raise
    except ShoalError as exc:
        return await _recompute(state, traced, grad, exc)
    sequence.directory.succeeded(span.peer_id)
    if part is not None:
        state.grad_prompts[span.start : span.end] += grads[1].to(state.grad_prompts.dtype)
    return grads[0]


async def _recompute(state: _Backward, traced: Traced, grad: Tensor, cause: ShoalError) -> Tensor:
    """The backward of ``traced``'s span after its server failed: over a new route of its blocks,
    whose forward is recomputed from the span's recorded input first."""
    span, directory = traced.span, state.sequence.directory
    state.failed.add(span.peer_id)
    directory.failed(span.peer_id)
    state.recoveries += 1
    if state.recoveries > MAX_RECOVERIES:
        raise gave_up(directory, state.failed, span.start, cause, (TRAIN,)) from cause
    log.warning("backward on %s failed (%s); recomputing blocks %d-%d elsewhere", span.peer_id[:10], cause,
                span.start, span.end - 1)  # fmt: skip
    sub: list[Traced] = []
    await state.sequence.run_forward(
        traced.hidden, state.position_ids, state.mask, state.prompts,
        start=span.start, end=span.end, trace=sub, failed=state.failed,
    )  # fmt: skip
    return await _backward_trace(state, sub, grad)


def _checked(tensors: list[Tensor], hidden: Tensor, prompts: Tensor | None, span: ServerSpan) -> list[Tensor]:
    """A backward's result as asked: ``[grad_hidden, grad_prompts?]`` shaped as those inputs."""
    expected = [tuple(hidden.shape), *([] if prompts is None else [tuple(prompts.shape)])]
    got = [tuple(t.shape) for t in tensors]
    if got != expected or not all(t.is_floating_point() for t in tensors):
        raise WireError("bad_reply", f"backward of {span.peer_id[:10]} answered shapes {got}, expected {expected}")
    return tensors


__all__ = ["Traced", "differentiable_forward"]
