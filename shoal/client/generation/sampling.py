"""Sampling that a repaired generation reproduces: each token is drawn from a generator seeded by the
run's seed and the token's position.

transformers' own sampling draws from torch's global generator, so a generation that rolls back and
regenerates its tail (an audit found a lie, :mod:`shoal.client.verification.audit`) draws other tokens than an
uninterrupted run would. :class:`PositionSeededSampler` makes the draw at a position depend only on
the seed, the position and the logits there: a repaired seeded run equals the honest seeded run,
whatever else runs concurrently and whatever speculation did.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import TopPLogitsWarper

__all__ = ["PositionSeededSampler"]


class PositionSeededSampler(LogitsProcessor):
    """Samples the next token and leaves only that token possible, so ``generate`` runs greedy over
    it (pass it in ``logits_processor=`` with ``do_sample=False``).

    Each draw has its own generator, seeded from ``seed`` and the token's position: a seed
    reproduces the answer whatever else runs concurrently, whatever speculation did (a draft's
    windows depend on timing; the target's token at a position is drawn the same way regardless,
    and a draft that agrees with the target draws what the target will, so it is accepted), and
    whatever a repair rolled back and regenerated. ``seed`` None: a random one, drawn once."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy needs no sampler), got {temperature}")
        self.temperature = temperature
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None
        self.seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float() / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        probs = torch.softmax(scores, dim=-1)
        position = input_ids.shape[-1]
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + position) % 2**63)
        token = torch.multinomial(probs.cpu(), 1, generator=generator).to(scores.device)
        return torch.full_like(scores, -float("inf")).scatter_(1, token, 0.0)
