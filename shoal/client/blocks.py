"""What the client model drives: all transformer blocks of a model, wherever they run.

The model never knows whether blocks run in-process (:class:`shoal.client.local.LocalBlockSequence`)
or on a swarm of servers (the remote implementation); both satisfy these two protocols. Calls are
synchronous: the model is a ``transformers`` model, and ``generate`` is a plain Python loop.

Tensor conventions are those of :mod:`shoal.models.base`:
    hidden:          [batch, n, hidden_size]  float32 on the wire by default
    position_ids:    [batch, n]               int64, absolute positions of the n new tokens
    attention_mask:  [batch, past + n]        bool (True = attend), or None when nothing is padded
Errors are exceptions from :mod:`shoal.errors`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["BlockSequence", "BlockSession"]


@runtime_checkable
class BlockSession(Protocol):
    """A stateful pass through all blocks: the servers keep the keys/values of ``position`` tokens.

    ``position`` may be set to any value ``<= position`` to roll back (the caches are written by
    position, so the next ``step`` simply overwrites what followed).
    """

    position: int
    max_length: int
    batch_size: int

    def step(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Run ``n`` new tokens, written at ``[position, position + n)``; then ``position += n``."""
        ...

    def close(self) -> None:
        """Free the servers' caches; idempotent."""
        ...


@runtime_checkable
class BlockSequence(Protocol):
    """All ``num_blocks`` blocks of one model, in order."""

    num_blocks: int

    def forward(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Stateless pass (no cache): ``[B, n, H] -> [B, n, H]``, ``attention_mask`` is ``[B, n]``."""
        ...

    def open_session(self, batch_size: int, max_length: int) -> BlockSession:
        """Reserve caches for ``batch_size`` sequences of up to ``max_length`` positions."""
        ...
