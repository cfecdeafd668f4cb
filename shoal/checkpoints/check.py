"""What any party checks about a model before it binds a port or reads a weight: the name resolves
(a directory, a known model, a Hub id) and shoal serves its family. A mistake then costs a second."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.checkpoints.fetch import resolve_model
from shoal.checkpoints.loading import load_config
from shoal.models import get_family


@dataclass(frozen=True)
class CheckedModel:
    model_dir: Path  # holds at least config.json (no weights are fetched or read for the check)
    model_type: str
    num_blocks: int
    #: the transformers config, read once here: whoever checked the model passes it on instead of re-reading it
    hf_config: Any = field(default=None, compare=False, repr=False)


def check_model(model: str) -> CheckedModel:
    """Resolve ``model`` to its config and family. Raises :class:`~shoal.errors.ModelNotFoundError`
    or :class:`~shoal.models.UnsupportedModelError` (both usage errors)."""
    model_dir = resolve_model(model, metadata_only=True)
    config = load_config(model_dir)
    return CheckedModel(model_dir, config.model_type, get_family(config).num_blocks(config), config)
