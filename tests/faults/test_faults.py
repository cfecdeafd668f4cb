"""Every fault of testkit's fault seam does exactly what it says, and the faulty server's own record
says what it did.

Each test serves a faulty server and an honest replica of the same blocks of a tiny random llama
(3 blocks, hidden 64) in this process, over the in-memory transport, sends both the same inputs and
compares the answers (:mod:`tests.faults.bench`). Here: faults of the outputs and the blocks, and
when they strike; faults of delivery are in ``test_delivery.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.checkpoints import load_span
from testkit.faults import Identity, Noise, OtherWeights, SkipBlock, StaleCache, When, Zeros
from testkit.faulty import perturbed_copy
from tests.faults.bench import SPAN, Session, inputs, pair, relative
from tests.helpers.aio import run

pytestmark = pytest.mark.timeout(60)


def test_noise_has_the_relative_size_asked_and_is_recorded(model_dir):
    async def scenario():
        async with pair(model_dir, [Noise(0.1, seed=1)]) as p:
            return await p.drive([5, 1, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    ratios = [relative(faulty, honest) for _, honest, faulty in steps]
    assert all(0.05 <= r <= 0.2 for r in ratios), ratios
    assert [(e.fault, e.step, e.session, e.positions, e.blocks) for e in record] == [
        ("noise", 0, 0, (0, 5), SPAN),
        ("noise", 1, 0, (5, 6), SPAN),
        ("noise", 2, 0, (6, 7), SPAN),
    ]
    for entry, ratio in zip(record, ratios, strict=True):
        assert entry.size == pytest.approx(0.1, abs=1e-4) and ratio == pytest.approx(entry.size, abs=1e-3)


def test_zeros_and_identity_answer_exactly_that(model_dir):
    async def scenario(fault):
        async with pair(model_dir, [fault]) as p:
            return await p.drive([4, 1]), p.record.entries()

    for _, honest, faulty in run(scenario(Zeros()), 30)[0]:
        assert torch.equal(faulty, torch.zeros_like(honest)) and honest.abs().max() > 0.1
    steps, record = run(scenario(Identity()), 30)
    for hidden, honest, faulty in steps:
        assert torch.equal(faulty, hidden) and relative(honest, hidden) > 0.1
    assert [(e.fault, e.step, e.positions) for e in record] == [("identity", 0, (0, 4)), ("identity", 1, (4, 5))]


def test_composed_output_faults_apply_in_order(model_dir):
    async def scenario():
        async with pair(model_dir, [Identity(), Noise(0.2, seed=5)]) as p:
            return await p.drive([3, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    for hidden, _, faulty in steps:
        assert 0.1 <= relative(faulty, hidden) <= 0.4  # noise relative to the input it replaced the output with
    assert [(e.fault, e.step) for e in record] == [("identity", 0), ("noise", 0), ("identity", 1), ("noise", 1)]


def reference_chain(model_dir: Path, block: int, replace=None):
    """Blocks 0:3 of the checkpoint as separate one-block spans, block ``block`` left out
    (``replace`` None) or swapped for ``replace(layer)``; returns a stepper with caches."""
    spans = []
    for i in range(*SPAN):
        span, _ = load_span(model_dir, i, i + 1)
        if i == block and replace is None:
            continue
        if i == block:
            span.layers[0] = replace(span.layers[0])
        spans.append((span, span.allocate_cache(1, 32)))

    @torch.inference_mode()
    def step(hidden: torch.Tensor, position_ids: torch.Tensor, past: int) -> torch.Tensor:
        for span, cache in spans:
            hidden = span(hidden, position_ids, None, cache=cache, past_length=past)
        return hidden

    return step


def check_against(reference, steps) -> None:
    past = 0
    for hidden, honest, faulty in steps:
        n = hidden.shape[1]
        expected = reference(hidden, torch.arange(past, past + n)[None], past)
        torch.testing.assert_close(faulty, expected, atol=1e-4, rtol=0)
        assert relative(faulty, honest) > 1e-2  # the fault did change the answer
        past += n


def test_a_skipped_block_answers_what_the_other_blocks_compute(model_dir):
    async def scenario():
        async with pair(model_dir, [SkipBlock(1)]) as p:
            return await p.drive([4, 1, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    check_against(reference_chain(model_dir, block=1), steps)
    assert [(e.fault, e.step, e.blocks, e.positions) for e in record] == [
        ("skip_block", 0, (1, 2), (0, 4)),
        ("skip_block", 1, (1, 2), (4, 5)),
        ("skip_block", 2, (1, 2), (5, 6)),
    ]


def test_other_weights_run_one_block_with_its_perturbed_copy(model_dir):
    fault = OtherWeights(block=1, relative=0.5, seed=3)

    async def scenario():
        async with pair(model_dir, [fault]) as p:
            return await p.drive([4, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    original = load_span(model_dir, 1, 2)[0].layers[0]
    perturbed = perturbed_copy(original, fault.relative, fault.seed)
    for (name, before), (_, after) in zip(original.named_parameters(), perturbed.named_parameters(), strict=True):
        assert relative(after, before) == pytest.approx(0.5, abs=1e-4), name
    check_against(reference_chain(model_dir, block=1, replace=lambda layer: perturbed), steps)
    assert [(e.fault, e.step, e.blocks) for e in record] == [("other_weights", 0, (1, 2)), ("other_weights", 1, (1, 2))]


def test_every_nth_step_only_those_steps_differ(model_dir):
    async def scenario():
        async with pair(model_dir, [Noise(0.2, seed=2, when=When(first_step=1, every=2))]) as p:
            return await p.drive([3, 1, 1, 1, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    differs = [relative(faulty, honest) > 0.1 for _, honest, faulty in steps]
    assert differs == [False, True, False, True, False]
    for (_, honest, faulty), hit in zip(steps, differs, strict=True):
        if not hit:
            torch.testing.assert_close(faulty, honest, atol=1e-5, rtol=0)
    assert [(e.fault, e.step) for e in record] == [("noise", 1), ("noise", 3)]


def test_steps_are_counted_per_session(model_dir):
    async def scenario():
        async with pair(model_dir, [Zeros(when=When(last_step=0))]) as p:
            sessions = [await Session.open(p.client, p.faulty.ticket) for _ in range(2)]
            answers = []
            for i in range(2):  # step 0 of both sessions, then step 1 of both
                for session in sessions:
                    answers.append(await session.step(inputs(2, session.position, i)))
            return answers, p.record.entries()

    answers, record = run(scenario(), 30)
    assert [bool((a == 0).all()) for a in answers] == [True, True, False, False]
    assert [(e.session, e.step) for e in record] == [(0, 0), (1, 0)]


def test_after_position_p_earlier_positions_match(model_dir):
    async def scenario():
        async with pair(model_dir, [Noise(0.3, seed=4, when=When(from_position=3))]) as p:
            return await p.drive([5, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    (_, honest0, faulty0), (_, honest1, faulty1) = steps
    torch.testing.assert_close(faulty0[:, :3], honest0[:, :3], atol=1e-4, rtol=0)
    for position in (3, 4):
        assert relative(faulty0[:, position], honest0[:, position]) > 0.05
    assert relative(faulty1, honest1) > 0.1
    assert [(e.step, e.positions) for e in record] == [(0, (3, 5)), (1, (5, 6))]
    assert all(e.size == pytest.approx(0.3, abs=1e-4) for e in record)


def test_a_stale_cache_answers_right_once_then_wrong(model_dir):
    async def scenario():
        async with pair(model_dir, [StaleCache()]) as p:
            return await p.drive([4, 1, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    (_, honest0, faulty0), *later = steps
    torch.testing.assert_close(faulty0, honest0, atol=1e-5, rtol=0)  # its own positions were in the copy
    for _, honest, faulty in later:
        assert relative(faulty, honest) > 1e-2  # they attend to slots never written
    assert [(e.fault, e.step, e.positions) for e in record] == [
        ("stale_cache", 0, (0, 4)),
        ("stale_cache", 1, (4, 5)),
        ("stale_cache", 2, (5, 6)),
    ]
