"""Model families, looked up by ``config.model_type``.

Adding a llama-like family: write ``shoal/models/<name>.py`` defining ``FAMILY = DecoderFamily(...)``
and add one line to ``_FAMILY_MODULES``. Family modules import lazily (they pull in transformers).
"""

from __future__ import annotations

import importlib

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
    "llama": "shoal.models.llama",
    "mistral": "shoal.models.mistral",
    "qwen2": "shoal.models.qwen2",
}


class UnsupportedModelError(ValueError):
    """The checkpoint's ``model_type`` has no family adapter."""


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_FAMILY_MODULES))


def get_family(config) -> Family:
    """The family adapter for ``config`` (anything with ``model_type``, e.g. a transformers config)."""
    model_type = getattr(config, "model_type", None)
    module = _FAMILY_MODULES.get(model_type)
    if module is None:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return importlib.import_module(module).FAMILY
