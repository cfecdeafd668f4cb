"""Model quality on real text, the same way for a local model and a distributed one: perplexity of a
real English text obtained offline (a licence text Debian ships in ``/usr/share/common-licenses``),
teacher-forced in fixed windows.

Windows do not overlap: each scores its tokens given only the window's earlier tokens, so the number
depends on the window (stated with it) but every variant compared is scored on the same windows.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

#: A real English text of about 8,000 tokens for either tokenizer, on every Debian machine.
LICENCE_TEXT = Path("/usr/share/common-licenses/GPL-3")


def licence_tokens(tokenizer, max_tokens: int, path: Path = LICENCE_TEXT) -> torch.Tensor:
    """The first ``max_tokens`` tokens of ``path`` as ``[1, n]`` ids (``ValueError`` if it is shorter)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: it comes with Debian's base-files package")
    ids = tokenizer(path.read_text(), return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < max_tokens:
        raise ValueError(f"{path} has {ids.shape[1]} tokens, fewer than {max_tokens}")
    return ids[:, :max_tokens]


@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, window: int = 512) -> float:
    """exp(mean negative log-likelihood) of ``ids`` ([1, n]) under ``model`` (anything callable as a
    transformers causal LM), scored in consecutive windows of ``window`` tokens."""
    total, count = 0.0, 0
    for start in range(0, ids.shape[1] - 1, window):
        chunk = ids[:, start : start + window]
        if chunk.shape[1] < 2:
            break
        logits = model(input_ids=chunk).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
        total, count = total + nll.item(), count + chunk.shape[1] - 1
    return math.exp(total / count)


__all__ = ["LICENCE_TEXT", "licence_tokens", "perplexity"]
