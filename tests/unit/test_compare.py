"""The comparison tolerance: honest replicas of a tiny span agree, corruptions (noise at the claimed smallest
size, zeros, NaN, the input returned) are caught at their first position, padding is ignored, and bf16's
isolated honest spikes pass while corruption that persists is caught."""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shoal.models import get_family
from shoal.server.backend import SpanBackend
from shoal.verify import Tolerance, discrepancy, first_disagreement, tolerance_for
from testkit.faults import FaultRecord, Noise, When
from testkit.faulty import FaultState, FaultyBackend
from testkit.tiny import tiny_model

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.bfloat16]
#: The smallest noise (relative to the output's norm) claimed detected per dtype, bf16's on two or more
#: consecutive positions (bench/calibrate_verify.py: honest spikes up to ~1.2e-5 in fp32, ~0.065 in bf16).
CLAIMED_SMALLEST_NOISE = {torch.float32: 5e-4, torch.bfloat16: 5e-2}
N = 24  # positions of every case


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=3)


def span_of(model, dtype: torch.dtype, attn: str = "sdpa", start: int = 0, end: int = 4):
    config = copy.deepcopy(model.config)
    config._attn_implementation = attn
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return get_family(config).build_span(config, start, end, state, dtype, "cpu")


def inputs(model, dtype: torch.dtype, n: int = N, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(2, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    return model.get_input_embeddings()(ids).detach().to(dtype)


def forward(span, hidden, position_ids=None, mask=None) -> torch.Tensor:
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1])[None].expand(hidden.shape[0], -1)
    with torch.inference_mode():
        return span(hidden, position_ids, mask, cache=None, past_length=0)


def session(span, hidden, prefill: int, step: int, position_ids=None, mask=None) -> torch.Tensor:
    """A session's outputs: ``prefill`` positions in one step, then ``step`` at a time."""
    batch, n = hidden.shape[:2]
    position_ids = torch.arange(n)[None].expand(batch, -1) if position_ids is None else position_ids
    cache, outs, at = span.allocate_cache(batch, n), [], 0
    with torch.inference_mode():
        while at < n:
            size = prefill if at == 0 else min(step, n - at)
            window = None if mask is None else mask[:, : at + size]
            outs.append(span(hidden[:, at : at + size], position_ids[:, at : at + size], window, cache=cache,
                             past_length=at))  # fmt: skip
            at += size
    return torch.cat(outs, dim=1)


# ---- honest replicas agree ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_identical_outputs_agree(llama, dtype):
    out = forward(span_of(llama, dtype), inputs(llama, dtype))
    assert first_disagreement(out, out.clone(), tolerance_for(dtype)) is None
    assert torch.equal(discrepancy(out, out), torch.zeros(N))


@pytest.mark.parametrize("dtype", DTYPES)
def test_honest_variants_agree(llama, dtype):
    """Threads 1 vs 2, the row alone vs in a left-padded batch of 3, cached decode (1 and 8 at a time) vs
    one pass, and everything at once; in fp32 also eager vs sdpa attention."""
    span, hidden, tolerance = span_of(llama, dtype), inputs(llama, dtype), tolerance_for(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        reference = forward(span, hidden)
        torch.set_num_threads(1)
        variants = {"threads1": forward(span, hidden)}
        others = torch.randn(2, N + 4, hidden.shape[-1], generator=torch.Generator().manual_seed(1)).to(dtype)
        rows = torch.cat([others[:1], torch.cat([others[1:, :4], hidden], dim=1), others[1:]])
        mask = torch.ones(3, N + 4, dtype=torch.bool)
        mask[1, :4] = mask[2, :2] = False
        position_ids = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
        variants["batch3"] = forward(span, rows, position_ids, mask)[1:2, 4:]
        variants["decode1"] = session(span, hidden, N - 8, 1)
        variants["chunk8"] = session(span, hidden, N - 16, 8)
        variants["combined"] = session(span, rows, N + 4 - 8, 1, position_ids, mask)[1:2, 4:]
        if dtype == torch.float32:  # bf16 across kernels is outside the envelope (bench/calibrate_verify.py)
            variants["eager"] = forward(span_of(llama, dtype, "eager"), hidden)
    finally:
        torch.set_num_threads(threads)
    for name, out in variants.items():
        assert first_disagreement(reference, out, tolerance) is None, (name, float(discrepancy(reference, out).max()))
        assert first_disagreement(out, reference, tolerance) is None, name


def test_rounding_of_outlier_channels_is_honest():
    """Errors proportional to each value (rounding), with a channel of magnitude 90, stay far below the bf16
    tolerance; the same absolute error in the plain relative L2 would read 4x more."""
    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(2, 6, 256, generator=generator)
    expected[..., 7] = 90.0
    got = expected * (1 + 2**-8 * (2 * torch.rand(expected.shape, generator=generator) - 1))
    got[..., 7] += 90 * 2**-5  # the outlier channel off by several of its ulps
    assert float(discrepancy(expected, got).max()) < tolerance_for(torch.bfloat16).relative / 4


def test_near_zero_rows_are_measured_against_the_floor():
    expected = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))
    expected[0, 2] *= 1e-6
    got = expected.clone()
    got[0, 2] += 1e-9  # 1e-3 of that row, 1e-9 of the typical one
    assert first_disagreement(expected, got, tolerance_for(torch.float32)) is None


def test_discrepancy_is_symmetric():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 32, generator=generator), torch.randn(2, 5, 32, generator=generator)
    assert torch.equal(discrepancy(a, b), discrepancy(b, a))


# ---- corruptions are caught ---------------------------------------------------------------------
def noisy_session(span, hidden, size: float, from_position: int, seed: int) -> tuple[torch.Tensor, FaultRecord]:
    """A faulty server's session through the fault seam: prefill 12 positions, then decode 1 at a time,
    adding noise of ``size`` from ``from_position`` on."""
    executor = ThreadPoolExecutor(1)
    record = FaultRecord()
    fault = Noise(relative=size, seed=seed, when=When(from_position=from_position))
    backend = FaultyBackend(SpanBackend(span, hidden.shape[-1], executor=executor), FaultState([fault], record, False))

    async def drive() -> torch.Tensor:
        cache = await backend.allocate_cache(1, N)
        outs, at = [], 0
        while at < N:
            size_now = 12 if at == 0 else 1
            positions = torch.arange(at, at + size_now)[None]
            outs.append(await backend.run(hidden[:, at : at + size_now], positions, None, cache, at))
            at += size_now
        return torch.cat(outs, dim=1)

    try:
        return asyncio.run(drive()), record
    finally:
        executor.shutdown()


@pytest.mark.parametrize("dtype", DTYPES)
def test_noise_at_the_claimed_smallest_size_is_caught_at_its_first_position(llama, dtype):
    """The auditor recomputes in one pass; the liar decoded step by step and corrupted positions >= 17."""
    span, hidden, first = span_of(llama, dtype), inputs(llama, dtype), 17
    auditor = forward(span, hidden)
    for seed in range(4):
        lied, record = noisy_session(span, hidden, CLAIMED_SMALLEST_NOISE[dtype], first, seed)
        assert [e.positions for e in record.entries("noise")] == [(p, p + 1) for p in range(first, N)]
        assert first_disagreement(auditor, lied, tolerance_for(dtype)) == first, discrepancy(auditor, lied)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_nan_and_the_input_returned_are_caught(llama, dtype):
    span, hidden, tolerance = span_of(llama, dtype), inputs(llama, dtype), tolerance_for(dtype)
    honest = forward(span, hidden)
    zeros = honest.clone()
    zeros[:, 5:] = 0
    assert first_disagreement(honest, zeros, tolerance) == 5
    assert first_disagreement(zeros, honest, tolerance) == 5
    nan = honest.clone()
    nan[0, 9, 3] = float("nan")
    assert first_disagreement(honest, nan, tolerance) == 9
    assert discrepancy(honest, nan)[9] == torch.inf
    assert first_disagreement(honest, hidden, tolerance) == 0  # no block ran
    blown = honest.clone()
    blown[0, 11, 2] *= 1000  # one channel: the relative L2 view catches what the bounded elementwise one would not
    assert first_disagreement(honest, blown, tolerance) == 11


def test_nonfinite_values_agree_only_where_both_hold_the_same():
    expected = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    expected[0, 1, 0] = float("nan")
    expected[0, 2, 0] = float("inf")
    got = expected.clone()
    assert first_disagreement(expected, got, tolerance_for(torch.float32)) is None
    got[0, 2, 0] = float("-inf")
    assert first_disagreement(expected, got, tolerance_for(torch.float32)) == 2


# ---- padding, shapes, constants -----------------------------------------------------------------
def test_masked_padded_positions_are_ignored():
    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(2, 6, 16, generator=generator)
    got = expected.clone()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False  # row 0 left-padded by 2
    mask[:, 3] = False  # position 3 padded in every row
    got[0, :2] = torch.randn(2, 16, generator=generator) * 100
    got[0, 1, 0] = float("nan")
    got[:, 3] = 0
    assert first_disagreement(expected, got, Tolerance(1e-6), mask) is None
    assert torch.equal(discrepancy(expected, got, mask), torch.zeros(6))
    assert first_disagreement(expected, got, Tolerance(1e-6)) == 0  # the same, unmasked
    got[1, 4] += 1
    assert first_disagreement(expected, got, Tolerance(1e-6), mask) == 4


def test_shape_mismatches_raise():
    a = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="one shape"):
        first_disagreement(a, torch.zeros(1, 5, 8), Tolerance(1e-3))
    with pytest.raises(ValueError, match="one shape"):
        discrepancy(a[0], a[0])
    with pytest.raises(ValueError, match="mask"):
        first_disagreement(a, a, Tolerance(1e-3), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="positive"):
        Tolerance(0.0)


def test_tolerance_constants():
    fp32, bf16 = tolerance_for(torch.float32), tolerance_for(torch.bfloat16)
    assert fp32 == tolerance_for(torch.float32, "cpu") == Tolerance(3e-4)
    assert bf16 == Tolerance(0.13, sustained=0.035, window_count=3, window=8, channels=1.0)
    assert fp32.relative < tolerance_for(torch.float16).relative < bf16.relative
    assert CLAIMED_SMALLEST_NOISE[torch.float32] <= 1e-3 and CLAIMED_SMALLEST_NOISE[torch.bfloat16] <= 5e-2
    on_gpu = tolerance_for(torch.bfloat16, "cuda:0")  # uncalibrated: a margin more
    assert on_gpu.relative > bf16.relative and on_gpu.sustained > bf16.sustained
    with pytest.raises(ValueError, match="calibrated"):
        tolerance_for(torch.int64)
    with pytest.raises(ValueError, match="sustained"):
        Tolerance(0.1, sustained=0.2)


def spiked(readings: list[float], hidden: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of outputs whose :func:`discrepancy` at position j is about ``readings[j]`` (one
    direction of noise per position, scaled to the row's norm)."""
    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(1, len(readings), hidden, generator=generator)
    noise = torch.randn(expected.shape, generator=generator)
    got = expected.clone()
    for j, size in enumerate(readings):
        got[0, j] += noise[0, j] * (size * expected[0, j].norm() / noise[0, j].norm())
    return expected, got


def test_bf16_isolated_spikes_pass_and_persistent_corruption_is_caught():
    tolerance = tolerance_for(torch.bfloat16)

    def flagged(spikes: dict[int, float], n: int = 12) -> int | None:
        expected, got = spiked([spikes.get(j, 0.01) for j in range(n)])
        return first_disagreement(expected, got, tolerance)

    assert flagged({5: 0.07}) is None  # an honest replica's near-tie, once
    assert flagged({5: 0.07, 7: 0.07}) is None  # twice, not adjacent
    assert flagged(dict.fromkeys(range(5, 12), 0.05)) == 5  # sustained from position 5 on
    assert flagged({5: 0.3}) == 5  # one large lie
    assert flagged({11: 0.05}) is None  # a small lie on the last compared position only: seen next time
    # two rows each off at one position, adjacent ones: no row sustains it
    expected, got = spiked([0.01, 0.05, 0.01])
    other_expected, other_got = spiked([0.01, 0.01, 0.05])
    pair = first_disagreement(torch.cat([expected, other_expected]), torch.cat([got, other_got]), tolerance)
    assert pair is None
