"""A session's inputs at its chain's boundaries, kept so that a replacement server can be replayed.

A server that takes over blocks ``[a, b)`` mid-session has no cache: it gets one step over every
position so far, with the hidden states that entered block ``a`` (and the positions and mask),
which is exactly what this history holds for every block where a server of the chain begins.
An audited session (:mod:`shoal.client.verification.audit`) also records the chain's last output (block
``num_blocks``): then every hop's outputs are in the history (the next boundary's inputs), and an
auditor's answer for a window of positions is compared with them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import Tensor

from shoal.errors import ShoalError
from shoal.wire.schema import Receipt
from shoal.wire.tensors import cat_serial


def step_inputs(hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> list[Tensor]:
    """A step's tensors as the blocks protocol sends them (the mask only when something is padded)."""
    return [hidden, position_ids] if mask is None else [hidden, position_ids, mask]


class SpanHistory:
    """Every step's inputs so far, by chain boundary (first block of a hop). Steps append chunks;
    they are joined (serially, see :func:`cat_serial`) only when a replay or a rollback needs them."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self._hidden: dict[int, list[Tensor]] = {}  # block -> [B, n_k, H] per step
        self._positions: list[Tensor] = []  # [B, n_k] per step
        self._mask: Tensor | None = None  # [B, position] bool, all positions so far
        self._receipts: dict[int, list[Receipt]] = {}  # block -> signed receipts of its hop's steps, in order

    def blocks(self) -> list[int]:
        """The boundaries with a history (tests and diagnostics)."""
        return sorted(block for block, chunks in self._hidden.items() if chunks)

    def at(self, block: int) -> Tensor | None:
        """The inputs of block ``block`` at every position so far, or None if it has no history."""
        chunks = self._hidden.get(block)
        if not chunks:
            return None
        if len(chunks) > 1:
            chunks[:] = [cat_serial(chunks, dim=1)]
        return chunks[0]

    def recorded(self, block: int) -> tuple[int, int, torch.dtype] | None:
        """(positions, hidden size, dtype) of the states recorded at ``block``, without joining its
        chunks: a witness sizes evidence before it copies anything. None: no history there."""
        chunks = self._hidden.get(block)
        if not chunks:
            return None
        return sum(chunk.shape[1] for chunk in chunks), chunks[0].shape[-1], chunks[0].dtype

    def position_ids(self) -> Tensor:
        if len(self._positions) > 1:
            self._positions[:] = [cat_serial(self._positions, dim=1)]
        return self._positions[0]

    def record(
        self,
        inputs: Mapping[int, Tensor],
        starts: Collection[int],
        position_ids: Tensor,
        mask: Tensor | None,
        end: int,
        receipts: Mapping[int, Receipt] | None = None,
    ) -> None:
        """Append one step that ended at position ``end``: its inputs at every block in ``starts``
        (the chain's boundaries now), and the receipts its hops signed (by first block: what a
        verdict on a lie will show). A block that is no longer a boundary loses its history (it
        would stay incomplete)."""
        hidden = self._hidden
        for block in [b for b in hidden if b not in starts]:
            del hidden[block]
        for block, receipt in (receipts or {}).items():
            self._receipts.setdefault(block, []).append(receipt)
        for block in starts:
            chunks = hidden.get(block)
            if chunks is None:
                hidden[block] = [inputs[block]]
            else:
                chunks.append(inputs[block])
        self._positions.append(position_ids)
        # a step's mask covers every position so far; None: nothing is padded
        self._mask = mask if mask is not None else torch.ones(self.batch_size, end, dtype=torch.bool)

    def adopt(self, block: int, hidden: Tensor) -> None:
        """``hidden`` (a replay's output: every position so far) becomes the history of ``block``,
        unless it has one already (the inputs the chain actually used win)."""
        if not self._hidden.get(block):
            self._hidden[block] = [hidden]

    def replay_inputs(self, block: int, position: int, fresh: Mapping[int, Tensor] | None = None) -> list[Tensor]:
        """The tensors of one step over positions ``[0, position)`` into block ``block``: its
        history, else ``fresh[block]`` (the output of a replay just made), else an error."""
        hidden = self.at(block)
        if hidden is None and fresh is not None:
            hidden = fresh.get(block)
        if hidden is None or hidden.shape[1] != position:
            raise ShoalError(f"no history at block {block} to replay (internal error)")
        mask = self._mask
        if mask is not None and bool(mask.all()):
            mask = None
        return step_inputs(hidden, self.position_ids(), mask)

    def hidden(self, block: int, start: int, end: int) -> Tensor:
        """The hidden states recorded at ``block`` for positions ``[start, end)`` (an audit compares a
        hop's outputs, the history of its end block, with another server's)."""
        whole = self.at(block)
        if whole is None or whole.shape[1] < end:
            raise ShoalError(f"no history at block {block} up to position {end} (internal error)")
        return whole[:, start:end]

    def window(self, block: int, start: int, end: int) -> list[Tensor]:
        """The tensors of one step over positions ``[start, end)`` into block ``block`` (a session's
        step as the hop there got it: its inputs, positions, and the mask of ``[0, end)``)."""
        hidden = self.hidden(block, start, end)
        mask = self._mask[:, :end] if self._mask is not None else None
        if mask is not None and bool(mask.all()):
            mask = None
        return step_inputs(hidden, self.position_ids()[:, start:end], mask)

    def receipts(self, block: int) -> list[Receipt]:
        """The receipts of the steps the hop starting at ``block`` ran, oldest first (any server's)."""
        return list(self._receipts.get(block, ()))

    def truncate(self, position: int) -> None:
        """Forget positions ``[position, ...)`` (a rollback), and the receipts of steps that reached them."""
        for receipts in self._receipts.values():
            receipts[:] = [r for r in receipts if r.position + r.n <= position]
        for block in list(self._hidden):
            whole = self.at(block)
            self._hidden[block] = [whole[:, :position]] if whole is not None and position else []
        if self._positions:
            self._positions[:] = [self.position_ids()[:, :position]] if position else []
        if self._mask is not None:
            self._mask = self._mask[:, :position]

    def clear(self) -> None:
        self._hidden.clear()
        self._receipts.clear()
        self._positions.clear()
        self._mask = None


__all__ = ["SpanHistory", "cat_serial", "step_inputs"]
