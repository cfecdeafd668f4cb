"""Parity helpers: a shoal client model must generate exactly what the plain transformers model does.

Backend-agnostic: ``model`` is a :class:`~shoal.client.model.DistributedModelForCausalLM` over any
:class:`~shoal.client.blocks.BlockSequence` (in-process spans, or a swarm), ``reference`` is the
local ``transformers`` model built from the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from shoal.client.blocks import BlockSequence, BlockSession


@dataclass
class CountingSession:
    """Wraps a :class:`BlockSession`, counting the positions it is sent."""

    inner: BlockSession
    consumed: int = 0
    steps: list[int] = field(default_factory=list)
    closed: bool = False

    @property
    def position(self) -> int:
        return self.inner.position

    @position.setter
    def position(self, value: int) -> None:
        self.inner.position = value

    @property
    def max_length(self) -> int:
        return self.inner.max_length

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    def step(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        self.consumed += hidden.shape[1]
        self.steps.append(hidden.shape[1])
        return self.inner.step(hidden, position_ids, attention_mask)

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class CountingBlocks:
    """Wraps a :class:`BlockSequence`, keeping every session it opens."""

    def __init__(self, inner: BlockSequence):
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.sessions: list[CountingSession] = []
        self.forward_calls = 0

    def forward(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        self.forward_calls += 1
        return self.inner.forward(hidden, position_ids, attention_mask)

    def open_session(self, batch_size: int, max_length: int) -> CountingSession:
        session = CountingSession(self.inner.open_session(batch_size, max_length))
        self.sessions.append(session)
        return session


def min_top2_gap(reference, input_ids: Tensor, **kwargs) -> float:
    """Smallest gap between the two best logits over a greedy run: far above 1e-4 means numerical
    noise cannot flip a greedy choice."""
    out = reference.generate(input_ids, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    top2 = torch.stack(out.logits).float().topk(2, dim=-1).values
    return float((top2[..., 0] - top2[..., 1]).min())


def greedy_with_gap(reference, input_ids: Tensor, **kwargs) -> tuple[Tensor, float]:
    """Greedy sequences of ``reference`` and the smallest top-2 logit gap of that same run (as
    :func:`min_top2_gap`), counting each row only up to its own eos (later steps only pad it)."""
    out = reference.generate(input_ids, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    top2 = torch.stack(out.logits).float().topk(2, dim=-1).values  # [steps, batch, 2]
    gaps = top2[..., 0] - top2[..., 1]
    eos = kwargs.get("eos_token_id", reference.generation_config.eos_token_id)
    eos_ids = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else list(eos), dtype=torch.long)
    new = out.sequences[:, input_ids.shape[1] :]
    finished = torch.zeros(new.shape[0], dtype=torch.bool)
    live = torch.ones_like(gaps, dtype=torch.bool)
    for t in range(new.shape[1]):
        live[t] = ~finished
        finished |= torch.isin(new[:, t], eos_ids)
    return out.sequences, float(gaps[live].min())


def prompt_of(seed: int, length: int = 12) -> Tensor:
    """A seeded ``[1, length]`` prompt of ids in ``[3, 256)`` (testkit.tiny's char tokenizer's bytes)."""
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def honest_greedy(model_dir: Path, prompt: Tensor, new_tokens: int, min_gap: float = 1e-3) -> Tensor:
    """Local transformers' fp32 greedy sequences from ``prompt``: what a swarm, honest or repaired,
    must answer. Its top-2 logit gap must exceed ``min_gap``, so noise cannot flip a choice."""
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens, gap = greedy_with_gap(reference, prompt, max_new_tokens=new_tokens)
    assert gap > min_gap, f"honest greedy run has a near-tie (top-2 gap {gap:.2e}): choose another seed"
    return tokens


def left_padded(rows: list[list[int]], pad: int = 0) -> tuple[Tensor, Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` for prompts of different lengths."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def assert_generate_matches(model, reference, input_ids: Tensor, seed: int | None = None, **kwargs) -> Tensor:
    """Generate with both (re-seeding before each when ``seed`` is given); sequences must be equal."""
    if seed is not None:
        torch.manual_seed(seed)
    expected = reference.generate(input_ids, **kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    got = model.generate(input_ids, **kwargs)
    assert got.shape == expected.shape, f"{tuple(got.shape)} != {tuple(expected.shape)}"
    diff = (got != expected).nonzero()
    assert diff.numel() == 0, f"first mismatch at (row, col) {diff[0].tolist()}"
    return got


def assert_logits_close(model, reference, input_ids: Tensor, atol: float = 1e-4, **kwargs) -> tuple[float, bool]:
    """Forward logits within ``atol``; returns (max abs difference, bitwise equal)."""
    with torch.no_grad():
        expected = reference(input_ids, **kwargs).logits
        got = model(input_ids, **kwargs).logits
    assert got.shape == expected.shape
    err = float((got.float() - expected.float()).abs().max())
    assert err <= atol, f"max |logits diff| {err} > {atol}"
    return err, bool(torch.equal(got, expected))


__all__ = [
    "CountingBlocks",
    "CountingSession",
    "assert_generate_matches",
    "assert_logits_close",
    "greedy_with_gap",
    "honest_greedy",
    "left_padded",
    "min_top2_gap",
    "prompt_of",
]
