"""What the client model drives: all transformer blocks of a model, wherever they run.

The model never knows whether blocks run in-process (:class:`shoal.client.local.LocalBlockSequence`)
or on a swarm of servers (the remote implementation); both satisfy these two protocols. Calls are
synchronous: the model is a ``transformers`` model, and ``generate`` is a plain Python loop.

Tensor conventions are those of :mod:`shoal.models.base`:
    hidden:          [batch, n, hidden_size]  float32 on the wire by default
    position_ids:    [batch, n]               int64, absolute positions of the n new tokens
    attention_mask:  [batch, past + n]        bool (True = attend), or None when nothing is padded
    prompts:         [num_blocks, batch or 1, N, hidden]  deep prompts (optional): block i's input
                     gets prompts[i] added at positions [0, N)
Errors are exceptions from :mod:`shoal.errors`. A stateless ``forward`` whose ``hidden`` or
``prompts`` require grad (with autograd on) is differentiable; sessions are for inference.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from shoal.errors import BadRequest, NotFound

__all__ = ["AuditedSession", "BlockSequence", "BlockSession", "SessionPositions"]


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
class AuditedSession(BlockSession, Protocol):
    """A session whose hops other servers check (audit mode, :mod:`shoal.client.verification.audit`): what
    ``generate``'s repair loop (:mod:`shoal.client.verification.repair`) needs besides a plain session's."""

    @property
    def audited_position(self) -> int:
        """Positions ``[0, result)`` whose outputs every checked hop's auditor confirmed."""
        ...

    def audit(self) -> None:
        """Audit every position not audited yet; raises :class:`~shoal.client.verification.audit.LieDetected`."""
        ...


@runtime_checkable
class BlockSequence(Protocol):
    """All ``num_blocks`` blocks of one model, in order."""

    num_blocks: int

    def forward(
        self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None, prompts: Tensor | None = None
    ) -> Tensor:
        """Stateless pass (no cache): ``[B, n, H] -> [B, n, H]``, ``attention_mask`` is ``[B, n]``."""
        ...

    def open_session(
        self, batch_size: int, max_length: int, prompts: Tensor | None = None, share: int = 0
    ) -> BlockSession:
        """Reserve caches for ``batch_size`` sequences of up to ``max_length`` positions; every
        step adds the deep ``prompts`` (if any) at positions ``[0, N)``. ``share``: positions
        ``[0, share)`` whose cached pages servers may let other peers reuse (a system prompt)."""
        ...

    def close(self) -> None:
        """Release what the sequence holds (a node, background tasks); idempotent."""
        ...


class SessionPositions:
    """The bookkeeping every :class:`BlockSession` shares, wherever its blocks run: the positions
    its caches hold (``position``, which may only roll back), and the checks a step passes before
    it runs. Subclasses say whether they are closed and what a rollback drops (:meth:`_rolled_back`)."""

    def __init__(self, batch_size: int, max_length: int):
        self.batch_size = batch_size
        self.max_length = max_length
        self._position = 0

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if not 0 <= value <= self._position:
            raise ValueError(f"can only roll back: position {value} not in [0, {self._position}]")
        if value < self._position:
            self._rolled_back(value)
        self._position = value

    def _rolled_back(self, position: int) -> None:
        """What follows ``position`` is gone (the caches are overwritten by position anyway)."""

    def _check_step(self, hidden: Tensor, attention_mask: Tensor | None) -> int:
        """Raise what a server would for this step; return its number of new positions."""
        if self.closed:
            raise NotFound("session is closed")
        batch, n = hidden.shape[:2]
        if batch != self.batch_size:
            raise BadRequest(f"batch size {batch} != session batch size {self.batch_size}")
        if self._position + n > self.max_length:
            raise BadRequest(f"step of {n} at position {self._position} exceeds max_length {self.max_length}")
        if attention_mask is not None and attention_mask.shape != (batch, self._position + n):
            raise BadRequest(f"attention_mask {tuple(attention_mask.shape)} != {(batch, self._position + n)}")
        return n
