"""The contract between shoal's core and a model family.

A family adapter is the only place that knows transformers' layer classes and call signatures.
The server builds a :class:`BlockSpan` for its half-open block range ``[start, end)``; the client
builds a :class:`ClientHead` (embeddings, final norm, LM head). Neither core side imports a
family module directly: they go through :func:`shoal.models.get_family`.

Tensor conventions (the wire contract, as transformers' ``base_model_pp_plan``):
    hidden:          [batch, new_tokens, hidden_size]  floating point
    position_ids:    [batch, new_tokens]               int64, absolute positions of the new tokens
    attention_mask:  [batch, past + new_tokens]        bool (True = attend) or None (no padding)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


class SpanCache(Protocol):
    """Per-session KV cache of one span, for up to ``max_length`` positions: pages of a pool, taken as
    the session grows (:class:`shoal.models.kv.PagedCache`, the one cache every family uses).

    Written by position, so a session can roll back by stepping again from an earlier position.
    """

    batch_size: int
    max_length: int
    length: int  # positions [0, length) hold valid keys/values; a step may start at any past_length <= length

    def nbytes(self) -> int: ...


class BlockSpan(nn.Module):
    """A contiguous run of transformer blocks ``[start, end)`` with what the whole model normally
    builds once (rotary embeddings, attention masks)."""

    start: int
    end: int
    dtype: torch.dtype

    def allocate_pool(self, num_pages: int, page_size: int):  # pragma: no cover
        """A :class:`shoal.models.kv.PagePool` for this span's blocks (a server's, shared by its sessions)."""
        raise NotImplementedError

    def allocate_cache(self, batch_size: int, max_length: int) -> SpanCache:  # pragma: no cover
        """A cache on a pool of its own, just big enough (recomputes, warm-ups, a client's local span)."""
        raise NotImplementedError

    def forward_steps(self, steps: list) -> list[torch.Tensor]:  # pragma: no cover
        """One batched forward of several sessions' :class:`shoal.models.kv.CachedStep` s (any mix of
        positions, lengths and batch sizes, each with its own cache); each step's output, in order."""
        raise NotImplementedError

    def sub_span(self, first: int, last: int) -> BlockSpan:  # pragma: no cover
        """Blocks ``[start + first, start + last)`` of this span as a span of their own, sharing its
        modules (no copy): a server recomputes a backward one block at a time through these."""
        raise NotImplementedError

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: SpanCache | None = None,
        past_length: int = 0,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:  # pragma: no cover
        """Run ``hidden`` through the span. With ``cache``, the new keys/values are written at
        positions ``[past_length, past_length + new_tokens)`` and attention sees the cached
        ``[0, past_length)`` too; ``attention_mask`` then covers ``past_length + new_tokens``.
        ``prompts`` (deep prompt tuning), ``[blocks of the span, batch or 1, N, hidden]``: block i's
        input gets ``prompts[i]`` added at sequence positions ``[0, N)`` (:func:`add_deep_prompt`).
        Runs under the caller's grad mode: the server enables autograd only for a backward."""
        raise NotImplementedError


def add_deep_prompt(hidden: torch.Tensor, prompt: torch.Tensor | None, past_length: int) -> torch.Tensor:
    """``hidden`` (``[batch, n, H]``, positions ``[past_length, past_length + n)``) with ``prompt``
    (``[batch or 1, N, H]``) added where those positions fall in ``[0, N)``; out of place, so
    autograd sees it (a block's input before that block runs, as Petals' deep prompts)."""
    if prompt is None or past_length >= prompt.shape[1]:
        return hidden
    upto = min(prompt.shape[1], past_length + hidden.shape[1])
    part = prompt[:, past_length:upto].to(hidden.dtype)
    return torch.cat([hidden[:, : upto - past_length] + part, hidden[:, upto - past_length :]], dim=1)


@dataclass(frozen=True)
class CacheGeometry:
    """Bytes of KV cache one token costs in one block (keys and values), for budgeting."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token_per_block(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class ClientHead(nn.Module):
    """What the client keeps locally: token embeddings, final norm and LM head."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """Final norm then LM head: [batch, n, hidden] -> [batch, n, vocab]."""
        raise NotImplementedError


class Family(Protocol):
    """A model family adapter (registered by ``config.model_type``)."""

    model_types: tuple[str, ...]

    def num_blocks(self, config) -> int: ...

    def block_tensor_prefix(self, config, index: int) -> str:
        """Checkpoint name prefix of block ``index``, e.g. ``model.layers.3.``."""
        ...

    def client_tensor_names(self, config) -> list[str]:
        """Checkpoint tensors the client needs (embeddings, final norm, LM head if untied)."""
        ...

    def build_span(
        self, config, start: int, end: int, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: str
    ) -> BlockSpan: ...

    def build_block(
        self, config, index: int, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: str
    ) -> nn.Module:
        """Block ``index`` alone, from its checkpoint tensors named relative to its block prefix
        (what a server loading one block at a time builds, then quantises)."""
        ...

    def assemble_span(
        self, config, start: int, end: int, blocks: list[nn.Module], dtype: torch.dtype, device: str
    ) -> BlockSpan:
        """The span of blocks ``[start, end)``, each built by :meth:`build_block`."""
        ...

    def build_client_head(
        self, config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: str
    ) -> ClientHead: ...

    def cache_geometry(self, config, dtype: torch.dtype) -> CacheGeometry: ...
