"""``shoal models list``: the models ``shoal models fetch`` knows (and whether each is here yet) and
the model families shoal serves."""

from __future__ import annotations

from typing import Any

GENERIC_PATH = (
    "any other decoder-only model transformers knows with the common layout (model.embed_tokens, model.layers, "
    "model.norm, model.rotary_emb, lm_head) and no client-side scalar shoal does not apply; checked at load, "
    "and refused naming why when it does not fit"
)


def catalog() -> dict[str, Any]:
    """Known models and families, as plain data (what ``--json`` prints)."""
    from shoal.checkpoints import KNOWN_MODELS, is_fetched, model_cache_dir
    from shoal.models import supported_model_types

    models = [
        {
            "name": spec.name,
            "description": spec.description,
            "download_bytes": spec.size,
            "fetched": is_fetched(spec.name),
            "path": str(model_cache_dir(spec.name)),
        }
        for spec in sorted(KNOWN_MODELS.values(), key=lambda spec: spec.name)
    ]
    return {"models": models, "families": list(supported_model_types()), "generic": GENERIC_PATH}


def render(entries: dict[str, Any]) -> str:
    """The catalog as a table for a terminal."""
    rows = [("MODEL", "FETCHED", "DOWNLOAD", "DESCRIPTION")]
    for model in entries["models"]:
        fetched = model["path"] if model["fetched"] else "no (shoal models fetch " + model["name"] + ")"
        rows.append((model["name"], fetched, f"{model['download_bytes'] / 1e6:.0f} MB", model["description"]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for row in rows:
        padded = (cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
        lines.append("  ".join([*padded, row[3]]))
    lines += ["", "families (model_type): " + ", ".join(entries["families"]), "generic path: " + entries["generic"]]
    return "\n".join(lines)
