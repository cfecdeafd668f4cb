"""What a server checks before it binds a port or reads a weight: the model (see
:mod:`shoal.checkpoints.check`) and that the blocks asked for are inside it."""

from __future__ import annotations

from shoal.checkpoints.check import CheckedModel, check_model
from shoal.errors import UsageError
from shoal.ids import BlockRange

__all__ = ["CheckedModel", "check_blocks", "check_model"]


def check_blocks(blocks: BlockRange | None, model: CheckedModel) -> None:
    """Refuse a span that reaches past the model's last block."""
    if blocks is not None and blocks.end > model.num_blocks:
        raise UsageError(
            f"--blocks {blocks.start}:{blocks.end} is outside the model's {model.num_blocks} blocks "
            f"(choose START:END within 0:{model.num_blocks})"
        )
