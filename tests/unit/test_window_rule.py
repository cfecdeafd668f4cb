"""bf16's window rule and channel view (issue #34): noise of 5e-2 of the row norm on alternate positions
and a push of half the row norm into 4 channels, lies the per-position rules let through, are caught
18/18 on honest bf16 pairs of a tiny llama and SmolLM2, at or before their first corrupted position, and
those honest pairs raise no alarm; the rules' mechanics on made-up readings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.calibrate_verify import Model, honest_outputs, smollm2, tiny
from shoal.verify.compare import channel_discrepancy, first_disagreement, tolerance_for, window_counts
from testkit.lies import alternate_noise, channel_push

pytestmark = pytest.mark.timeout(240)

BF16 = tolerance_for(torch.bfloat16)
#: the per-position rules alone, as before the window rule and channel view
PER_POSITION = dataclasses.replace(BF16, window_count=None, channels=None)
N, CHUNK = 24, 8  # positions per honest pair; positions one audit at audit_every=8 compares
VARIANTS = ("threads1", "batch3", "decode1")  # 3 per model, x 3 chunks x 2 models: 18 trials a lie


def honest_pairs(model: Model, span: tuple[int, int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    hidden = model.embed(0, N)
    if span[0]:
        hidden = model.span(0, span[0], torch.float32)(
            hidden, torch.arange(N)[None], None, cache=None, past_length=0
        ).detach()
    reference, variants = honest_outputs(model, span, torch.bfloat16, hidden.to(torch.bfloat16), 0, kernels=False)
    return {name: (reference, out) for name, out in variants.items()}


@pytest.fixture(scope="module")
def pairs(smollm2_dir) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Honest bf16 pairs: a tiny llama's 4 blocks (hidden 64), SmolLM2's blocks 0:2 (hidden 576)."""
    return {"tiny-llama": honest_pairs(tiny("llama", 0, [N]), (0, 4)), "smollm2": honest_pairs(smollm2([N]), (0, 2))}


def trials(pairs):
    """(reference chunk, honest chunk) for each model x variant x chunk: 18."""
    for by_variant in pairs.values():
        for variant in VARIANTS:
            reference, out = by_variant[variant]
            for first in range(0, N, CHUNK):
                yield reference[:, first : first + CHUNK], out[:, first : first + CHUNK]


def test_honest_bf16_pairs_raise_no_alarm(pairs):
    for model, by_variant in pairs.items():
        for variant, (reference, out) in by_variant.items():
            assert first_disagreement(reference, out, BF16) is None, (model, variant)
            assert float(channel_discrepancy(reference, out).max()) < BF16.channels / 4, (model, variant)


def test_alternate_noise_at_5e_2_is_caught_18_of_18(pairs):
    generator = torch.Generator().manual_seed(0)
    caught = missed_before = 0
    for index, (reference, out) in enumerate(trials(pairs)):
        first = index % 2  # from the chunk's first or second position on
        lied = alternate_noise(out, first, 5e-2, generator)
        wrong = first_disagreement(reference, lied, BF16)
        caught += wrong is not None and wrong <= first
        missed_before += first_disagreement(reference, lied, PER_POSITION) is None
    assert caught == 18
    assert missed_before == 18  # what the window rule adds: the per-position rules saw none of them


def test_four_channel_push_of_half_the_row_norm_is_caught_18_of_18(pairs):
    generator = torch.Generator().manual_seed(1)
    caught = missed_before = 0
    for index, (reference, out) in enumerate(trials(pairs)):
        at = (3 * index) % CHUNK
        lied = channel_push(out, at, 0.5, 4, generator)
        caught += first_disagreement(reference, lied, BF16) == at
        missed_before += first_disagreement(reference, lied, PER_POSITION) is None
    assert caught == 18
    assert missed_before == 9  # hidden 576: 0.115 per position, under 0.13 (hidden 64 reads about 0.25)


def readings(values: dict[int, float], n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[1, n, 64]`` outputs whose discrepancy at position j is about ``values.get(j, 0.01)``."""
    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(1, n, 64, generator=generator)
    got = expected.clone()
    for j in range(n):
        noise = torch.randn(64, generator=generator)
        got[0, j] += noise * (values.get(j, 0.01) / 0.84 * expected[0, j].norm() / noise.norm())
    return expected, got


def test_window_rule_counts_positions_beyond_the_sustained_level():
    def flagged(values: dict[int, float]) -> int | None:
        return first_disagreement(*readings(values), BF16)

    assert BF16.window_count == 3 and BF16.window == 8
    assert flagged({3: 0.06, 6: 0.06}) is None  # two honest spikes in 8 positions
    assert flagged(dict.fromkeys(range(4, 16), 0.03)) is None  # honest drift, below the sustained level
    assert flagged({3: 0.045, 5: 0.045, 7: 0.045}) == 3  # every other position
    assert flagged({2: 0.045, 5: 0.045, 8: 0.045}) == 2  # every third
    assert flagged({2: 0.045, 6: 0.045, 10: 0.045}) is None  # every fourth: 2 in any 8
    assert flagged({1: 0.06, 9: 0.045, 11: 0.045, 13: 0.045}) == 9  # an honest spike 8 before: not counted
    assert flagged({13: 0.045, 15: 0.045}) is None  # 2 at the end: seen with the next comparison's
    counts = window_counts(torch.tensor([[0.04, 0.0, 0.04, 0.0, 0.04]]), 0.035, 4)
    assert counts.tolist() == [[2.0, 2.0, 2.0, 1.0, 1.0]]  # from each position on, fewer at the end


def test_channel_view_reads_a_few_channels_in_row_rms_units():
    expected, got = readings({})
    assert float(channel_discrepancy(expected, got).max()) < 0.1  # diffuse honest-sized error
    pushed = channel_push(got, 5, 0.5, 4, torch.Generator().manual_seed(0))
    view = channel_discrepancy(expected, pushed)
    assert 1.5 < float(view[0, 5]) < 2.0  # about 0.5 sqrt(64) / 4 / 1.12 (its norm grew)
    assert first_disagreement(expected, pushed, BF16) == 5
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[0, 5] = False
    assert float(channel_discrepancy(expected, pushed, mask)[0, 5]) == 0.0  # padding is not compared
    assert first_disagreement(expected, pushed, BF16, mask) is None
