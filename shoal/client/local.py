"""In-process :class:`~shoal.client.blocks.BlockSequence`: the reference implementation.

It runs the family's own :class:`~shoal.models.base.BlockSpan` modules, so a client model over it
computes exactly what a swarm would, minus the network. Tests compare it against plain
``transformers`` models; the remote implementation is then compared against it. It mirrors the
server's checks (batch size, ``max_length``, closed sessions) and raises the same errors.
A forward whose input or deep prompts require grad runs under plain autograd (the spans' weights
are frozen as loaded), the reference for the remote backward; everything else runs in inference
mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor

from shoal.client.blocks import SessionPositions
from shoal.errors import BadRequest
from shoal.models.base import BlockSpan, SpanCache

__all__ = ["LocalBlockSequence", "LocalBlockSession"]


class LocalBlockSequence:
    """Spans ``[0, a), [a, b), ... [z, num_blocks)`` run one after another in this process.

    Hidden states cross span boundaries in ``wire_dtype`` (as they would cross the network) and are
    cast to each span's dtype inside it.
    """

    def __init__(self, spans: Sequence[BlockSpan], wire_dtype: torch.dtype = torch.float32):
        if not spans:
            raise ValueError("need at least one span")
        for prev, nxt in pairwise(spans):
            if prev.end != nxt.start:
                raise ValueError(f"spans are not contiguous: [{prev.start}, {prev.end}) then [{nxt.start}, {nxt.end})")
        if spans[0].start != 0:
            raise ValueError(f"the first span starts at block {spans[0].start}, not 0")
        self.spans = list(spans)
        self.num_blocks = spans[-1].end
        self.wire_dtype = wire_dtype

    @classmethod
    def from_state_dict(
        cls,
        config,
        state_dict: dict[str, Tensor],
        boundaries: Sequence[int] = (),
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> LocalBlockSequence:
        """Build spans split at ``boundaries`` (e.g. ``(2,)`` -> ``[0, 2), [2, n)``) from a full
        checkpoint ``state_dict``, through the family adapter."""
        from shoal.models import get_family  # the registry imports every family: keep it off import time

        family = get_family(config)
        edges = [0, *boundaries, family.num_blocks(config)]
        spans = [family.build_span(config, a, b, state_dict, dtype, device) for a, b in pairwise(edges)]
        return cls(spans)

    def forward(
        self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None, prompts: Tensor | None = None
    ) -> Tensor:
        """``prompts``: deep prompts ``[num_blocks, batch or 1, N, hidden]``, each span gets its slice."""
        grad = torch.is_grad_enabled() and (hidden.requires_grad or (prompts is not None and prompts.requires_grad))
        # with autograd on but nothing to differentiate: no_grad, whose outputs (unlike inference
        # mode's) may still meet trainable weights of the head
        quiet = torch.no_grad() if torch.is_grad_enabled() else torch.inference_mode()
        with contextlib.nullcontext() if grad else quiet:
            for span in self.spans:
                part = None if prompts is None else prompts[span.start : span.end]
                hidden = self._run(span, hidden, position_ids, attention_mask, None, 0, part)
        return hidden

    def open_session(
        self, batch_size: int, max_length: int, prompts: Tensor | None = None, share: int = 0
    ) -> LocalBlockSession:
        """``share`` is for servers' prefix caches: local blocks share nothing."""
        if batch_size < 1 or max_length < 1:
            raise BadRequest(f"bad session size: batch_size={batch_size}, max_length={max_length}")
        caches = [span.allocate_cache(batch_size, max_length) for span in self.spans]
        return LocalBlockSession(self, caches, batch_size, max_length, None if prompts is None else prompts.detach())

    def close(self) -> None:
        """In-process blocks hold nothing to release."""

    def _run(
        self,
        span: BlockSpan,
        hidden: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        cache: SpanCache | None,
        past_length: int,
        prompts: Tensor | None = None,
    ) -> Tensor:
        param = next(span.parameters(), None)
        dtype = param.dtype if param is not None else hidden.dtype
        prompts = None if prompts is None else prompts.to(dtype)
        out = span(
            hidden.to(dtype), position_ids, attention_mask, cache=cache, past_length=past_length, prompts=prompts
        )
        return out.to(self.wire_dtype)


class LocalBlockSession(SessionPositions):
    """One cache per span; ``position`` counts the positions every span holds. ``prompts``: deep
    prompts added to each block's input at positions ``[0, N)`` (as a server's session does)."""

    def __init__(
        self,
        blocks: LocalBlockSequence,
        caches: list[SpanCache],
        batch_size: int,
        max_length: int,
        prompts: Tensor | None = None,
    ):
        super().__init__(batch_size, max_length)
        self._blocks = blocks
        self._caches: list[SpanCache] | None = caches
        self._prompts = [None if prompts is None else prompts[s.start : s.end] for s in blocks.spans]

    @property
    def closed(self) -> bool:
        return self._caches is None

    @torch.inference_mode()
    def step(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        n = self._check_step(hidden, attention_mask)
        for span, cache, prompts in zip(self._blocks.spans, self._caches, self._prompts, strict=True):
            hidden = self._blocks._run(span, hidden, position_ids, attention_mask, cache, self._position, prompts)
        self._position += n
        return hidden

    def close(self) -> None:
        self._caches = None
