"""In-process :class:`~shoal.client.blocks.BlockSequence`: the reference implementation.

It runs the family's own :class:`~shoal.models.base.BlockSpan` modules, so a client model over it
computes exactly what a swarm would, minus the network. Tests compare it against plain
``transformers`` models; the remote implementation is then compared against it. It mirrors the
server's checks (batch size, ``max_length``, closed sessions) and raises the same errors.
"""

from __future__ import annotations

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

    @torch.inference_mode()
    def forward(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        for span in self.spans:
            hidden = self._run(span, hidden, position_ids, attention_mask, None, 0)
        return hidden

    def open_session(self, batch_size: int, max_length: int) -> LocalBlockSession:
        if batch_size < 1 or max_length < 1:
            raise BadRequest(f"bad session size: batch_size={batch_size}, max_length={max_length}")
        caches = [span.allocate_cache(batch_size, max_length) for span in self.spans]
        return LocalBlockSession(self, caches, batch_size, max_length)

    def _run(
        self,
        span: BlockSpan,
        hidden: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        cache: SpanCache | None,
        past_length: int,
    ) -> Tensor:
        param = next(span.parameters(), None)
        dtype = param.dtype if param is not None else hidden.dtype
        out = span(hidden.to(dtype), position_ids, attention_mask, cache=cache, past_length=past_length)
        return out.to(self.wire_dtype)


class LocalBlockSession(SessionPositions):
    """One cache per span; ``position`` counts the positions every span holds."""

    def __init__(self, blocks: LocalBlockSequence, caches: list[SpanCache], batch_size: int, max_length: int):
        super().__init__(batch_size, max_length)
        self._blocks = blocks
        self._caches: list[SpanCache] | None = caches

    @property
    def closed(self) -> bool:
        return self._caches is None

    @torch.inference_mode()
    def step(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        n = self._check_step(hidden, attention_mask)
        for span, cache in zip(self._blocks.spans, self._caches, strict=True):
            hidden = self._blocks._run(span, hidden, position_ids, attention_mask, cache, self._position)
        self._position += n
        return hidden

    def close(self) -> None:
        self._caches = None
