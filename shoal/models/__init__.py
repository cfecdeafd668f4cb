"""Model families, looked up by ``config.model_type``.

Adding a llama-like family: write ``shoal/models/<name>.py`` defining ``FAMILY = DecoderFamily(...)``
and add one line to ``_FAMILY_MODULES``. Family modules import lazily (they pull in transformers).
"""

from __future__ import annotations

import importlib

from shoal.errors import UsageError
from shoal.models.base import BlockSpan, CacheGeometry, ClientHead, Family, SpanCache

__all__ = [
    "BlockSpan",
    "CacheGeometry",
    "ClientHead",
    "Family",
    "SpanCache",
    "UnsupportedModelError",
    "get_family",
    "supported_model_types",
]

_FAMILY_MODULES: dict[str, str] = {
    "falcon": "shoal.models.falcon",
    "gemma3_text": "shoal.models.gemma3",
    "llama": "shoal.models.llama",
    "mistral": "shoal.models.mistral",
    "mixtral": "shoal.models.mixtral",
    "phi3": "shoal.models.phi3",
    "qwen2": "shoal.models.qwen2",
    "qwen3": "shoal.models.qwen3",
    "qwen3_moe": "shoal.models.qwen3_moe",
}


class UnsupportedModelError(UsageError):
    """The checkpoint's ``model_type`` has no family adapter, and the model does not fit the generic path."""


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_FAMILY_MODULES))


def get_family(config) -> Family:
    """The family adapter for ``config`` (anything with ``model_type``, e.g. a transformers config);
    a model type without one goes the generic path (:mod:`shoal.models.generic`), if it fits."""
    model_type = getattr(config, "model_type", None)
    module = _FAMILY_MODULES.get(model_type)
    if module is not None:
        return importlib.import_module(module).FAMILY
    from shoal.models.generic import UnfitModel, generic_family  # builds a tiny model: only when needed

    try:
        return generic_family(config)
    except UnfitModel as unfit:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}: no family adapter (supported: "
            f"{', '.join(supported_model_types())}) and the generic path does not fit: {unfit}"
        ) from None
