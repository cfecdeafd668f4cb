"""The pure parts of speculative decoding: the expected-tokens formula, the cost fit and the window
planner's choices (the wrapper that times transformers' drafter: ``test_planned_drafts.py``)."""

from __future__ import annotations

import math

import pytest

from shoal.client.generation.speculation import PROBE_BUDGET, LinearCost, VerifyCost, WindowPlanner, expected_tokens

# ---- expected_tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "acceptance", "tokens"),
    [
        (0, 0.7, 1.0),  # no drafts: the target's own token
        (4, 0.0, 1.0),  # every first draft rejected
        (4, 1.0, 5.0),  # every draft accepted, plus the bonus token
        (3, 0.5, 1.875),  # 1 + 1/2 + 1/4 + 1/8
        (2, 0.8, 2.44),  # 1 + 0.8 + 0.64
        (4, 1.5, 5.0),  # clamped to 1
        (4, -0.2, 1.0),  # clamped to 0
    ],
)
def test_expected_tokens_values(window, acceptance, tokens):
    assert expected_tokens(window, acceptance) == pytest.approx(tokens)


@pytest.mark.parametrize("acceptance", [0.1, 0.35, 0.9, 0.999])
def test_expected_tokens_is_the_geometric_sum(acceptance):
    """E(k) = sum over i <= k of a^i: the i-th draft counts when all before it were accepted."""
    for window in range(9):
        assert expected_tokens(window, acceptance) == pytest.approx(sum(acceptance**i for i in range(window + 1)))


# ---- LinearCost ----------------------------------------------------------------------------------


@pytest.mark.parametrize("memory", [1.0, 0.9, 0.5])
def test_linear_cost_recovers_an_exact_line(memory):
    cost = LinearCost(memory=memory)
    for n in [1, 5, 2, 8, 3, 3, 6]:
        cost.add(n, 0.01 + 0.002 * n)
    intercept, slope = cost.coefficients()
    assert intercept == pytest.approx(0.01, rel=1e-6) and slope == pytest.approx(0.002, rel=1e-6)
    assert cost.predict(20) == pytest.approx(0.05, rel=1e-6)


def test_linear_cost_with_one_size_seen():
    """One n only: proportional to n without a prior slope, the prior slope with one."""
    empty = LinearCost()
    assert not empty.known and empty.coefficients() == (0.0, 0.0)
    proportional, with_prior = LinearCost(), LinearCost(prior_slope=0.001)
    for cost in (proportional, with_prior):
        cost.add(4, 0.02)
        cost.add(4, 0.02)
        assert cost.known
    assert proportional.coefficients() == pytest.approx((0.0, 0.005))
    assert with_prior.coefficients() == pytest.approx((0.016, 0.001))
    assert with_prior.predict(10) == pytest.approx(0.026)


def test_linear_cost_never_promises_free_rounds():
    """A fitted line with a negative intercept becomes proportional (both coefficients >= 0)."""
    cost = LinearCost(memory=1.0)
    cost.add(2, 0.01)
    cost.add(4, 0.03)  # the line through both: -0.01 + 0.01 n
    assert cost.coefficients() == pytest.approx((0.0, 0.04 / 6))


def test_linear_cost_forgets_old_observations():
    cost = LinearCost(memory=0.5)
    for _ in range(30):
        cost.add(1, 1.0)
        cost.add(3, 3.0)  # slope 1, intercept 0
    for _ in range(30):
        cost.add(1, 2.0)
        cost.add(3, 2.2)  # slope 0.1, intercept 1.9
    assert cost.coefficients() == pytest.approx((1.9, 0.1), rel=1e-6)


@pytest.mark.parametrize("memory", [0.0, -0.1, 1.5])
def test_linear_cost_rejects_a_memory_outside_0_1(memory):
    with pytest.raises(ValueError, match="memory"):
        LinearCost(memory=memory)


def test_linear_cost_spread_and_mean():
    """``spread`` once sizes differ (a slope can be fitted); ``mean`` the weighted mean size and time."""
    cost = LinearCost(memory=1.0)
    assert not cost.spread and cost.mean() == (0.0, 0.0)
    cost.add(4, 0.02)
    cost.add(4, 0.04)
    assert not cost.spread and cost.mean() == pytest.approx((4.0, 0.03))
    cost.add(1, 0.0)
    assert cost.spread and cost.mean() == pytest.approx((3.0, 0.02))
    forgetting = LinearCost(memory=0.5)
    forgetting.add(2, 0.01)
    forgetting.add(6, 0.05)  # weights 0.5 and 1
    assert forgetting.mean() == pytest.approx((14 / 3, 0.11 / 3))


# ---- VerifyCost ----------------------------------------------------------------------------------


def test_verify_cost_with_nothing_or_only_single_steps_seen():
    """Nothing seen: free. Only one-position steps: proportional to them."""
    cost = VerifyCost()
    assert not cost.known and cost.predict(1) == 0.0 and cost.predict(5) == 0.0
    cost.add(1, 0.01)
    assert not cost.known and not cost.steps.known
    assert cost.predict(1) == pytest.approx(0.01) and cost.predict(4) == pytest.approx(0.04)


def test_verify_cost_with_only_longer_steps_seen():
    """No one-position time yet, steps in one size: flat (optimistic: a wider window gets tried)."""
    cost = VerifyCost()
    cost.add(4, 0.02)
    assert cost.steps.known and not cost.known
    assert cost.predict(8) == pytest.approx(0.02) and cost.predict(1) == pytest.approx(0.02)


def test_verify_cost_single_time_is_a_running_mean():
    cost = VerifyCost(memory=0.9)
    cost.add(1, 0.01)
    cost.add(1, 0.03)
    cost.add(0, 0.03)  # nothing to send counts as one position
    assert cost.predict(1) == pytest.approx(0.81 * 0.01 + 0.09 * 0.03 + 0.1 * 0.03)
    assert not cost.steps.known


def test_verify_cost_takes_longer_steps_as_flat_until_they_spread():
    """Steps in one size: a longer one is taken to cost the same (the planner tries it, and learns
    the slope); one position keeps its own measured time."""
    cost = VerifyCost()
    cost.add(1, 0.01)
    cost.add(5, 0.03)
    cost.add(5, 0.03)
    assert cost.known and not cost.steps.spread
    assert cost.predict(1) == pytest.approx(0.01)
    assert [cost.predict(n) for n in (3, 5, 9)] == pytest.approx([0.03, 0.03, 0.03])
    cost.add(9, 0.05)
    assert cost.steps.spread and cost.predict(9) > cost.predict(5)


def test_verify_cost_keeps_the_single_time_apart_from_the_steps_fit():
    """Steps in two sizes: their own fit for n >= 2, while one position keeps its measured time
    (a matrix-vector product, cheaper than the line's intercept)."""
    cost = VerifyCost(memory=1.0)
    cost.add(1, 0.002)
    for n in (2, 4, 2, 4):
        cost.add(n, 0.02 + 0.001 * n)
    assert cost.steps.spread
    assert cost.predict(1) == pytest.approx(0.002)
    assert [cost.predict(n) for n in (2, 6)] == pytest.approx([0.022, 0.026])


# ---- WindowPlanner -------------------------------------------------------------------------------


def teach(planner: WindowPlanner, verify, draft_per_token: float, acceptance: float, windows=(0, 1, 2, 3, 4)) -> None:
    """Rounds of each window (0: a plain round, one position) with ``verify(n)`` seconds per step of n
    positions, drafts costing ``draft_per_token`` each, and ``acceptance`` of each round's drafts
    accepted (rounded down)."""
    for _ in range(5):
        for k in windows:
            accepted = int(k * acceptance)
            planner.observe(
                drafted=k,
                accepted=accepted,
                draft_seconds=draft_per_token * k,
                verify_positions=k + 1,
                verify_seconds=verify(k + 1),
            )


def test_planner_drafts_its_first_window_until_it_measured():
    planner = WindowPlanner(8, first_window=3)
    assert planner.choose() == 3
    assert WindowPlanner(2, first_window=4).choose() == 2  # never past max_window
    planner.verify.add(1, 0.01)  # the chain measured, the drafter not yet
    assert planner.choose() == 3
    assert WindowPlanner(8).first_window == 2


def test_planner_explores_first_window_then_a_plain_round_then_the_best():
    """first_window until a step of it (and the drafter) was measured, then plain rounds until a
    one-position step was, then the window with the most tokens per second."""
    planner = WindowPlanner(8)
    assert [planner.choose() for _ in range(3)] == [2, 2, 2]
    planner.observe(drafted=2, accepted=2, draft_seconds=0.002, verify_positions=3, verify_seconds=0.103)
    assert planner.verify.steps.known and not planner.verify.known
    assert [planner.choose() for _ in range(2)] == [0, 0]
    planner.observe(drafted=0, accepted=0, draft_seconds=0.0, verify_positions=1, verify_seconds=0.101)
    assert planner.verify.known
    rates = [planner.rate(k) for k in range(9)]
    assert rates.index(max(rates)) == 8  # a long round trip, agreeing drafts: the whole window
    assert planner.choose() == 8


def test_planner_waits_for_the_drafter_cost_unless_drafts_are_free():
    """A measured step without drafting: a drafter that costs still has to be measured first."""
    step = dict(drafted=0, accepted=0, draft_seconds=0.0, verify_positions=4, verify_seconds=0.04)
    costly, free = WindowPlanner(8, first_window=3), WindowPlanner(8, first_window=3, free_drafts=True)
    costly.observe(**step)
    free.observe(**step)
    assert costly.choose() == 3 and free.choose() == 0


def test_planner_prefill_round_counts_for_acceptance_only():
    """A call's first round (the prompt's step, the draft model's prefill) teaches no costs."""
    planner = WindowPlanner(8, first_window=3)
    planner.observe(drafted=3, accepted=3, draft_seconds=0.5, verify_positions=13, verify_seconds=1.5, prefill=True)
    planner.observe(drafted=0, accepted=0, draft_seconds=0.0, verify_positions=1, verify_seconds=2.0, prefill=True)
    assert planner.acceptance == pytest.approx((0.9 + 3) / (0.9 + 3 + 0.9))
    assert not planner.verify.steps.known and not planner.draft.known and planner.verify.predict(1) == 0.0
    assert planner.choose() == 3
    planner.observe(drafted=3, accepted=1, draft_seconds=0.003, verify_positions=4, verify_seconds=0.02)
    assert planner.verify.predict(4) == pytest.approx(0.02) and planner.draft.predict(3) == pytest.approx(0.003)
    assert planner.choose() == 0  # the one-position step is still to measure


def test_planner_chooses_plain_decoding_when_drafting_is_dear_and_verifying_cheap():
    planner = WindowPlanner(8, probe_every=100)
    teach(planner, verify=lambda n: 0.001 + 0.0001 * n, draft_per_token=0.05, acceptance=0.5)
    assert planner.choose() == 0
    assert planner.rate(0) > max(planner.rate(k) for k in range(1, 9))


def test_planner_chooses_a_large_window_over_a_long_round_trip_when_drafts_agree():
    planner = WindowPlanner(8)
    teach(planner, verify=lambda n: 0.1 + 0.001 * n, draft_per_token=0.001, acceptance=1.0)
    assert planner.acceptance > 0.9
    assert planner.choose() == 8


def test_planner_window_follows_the_acceptance():
    """Same costs: agreeing drafts get a longer window than mostly rejected ones."""
    chain = lambda n: 0.02 + 0.002 * n  # noqa: E731
    agreeing, rejected = WindowPlanner(8), WindowPlanner(8)
    teach(agreeing, chain, draft_per_token=0.003, acceptance=0.75)
    teach(rejected, chain, draft_per_token=0.003, acceptance=0.25)
    assert agreeing.acceptance > rejected.acceptance
    assert agreeing.choose() > rejected.choose() >= 0


def test_planner_probes_one_draft_every_probe_every_plain_rounds():
    """Drafts that never agree, cheap to make and verify: plain rounds, and a 1-token probe every
    ``probe_every``-th round."""
    planner = WindowPlanner(8, probe_every=4)
    teach(planner, verify=lambda n: 0.01 + 0.0001 * n, draft_per_token=0.0001, acceptance=0.0)
    assert planner.probe_interval() == 4
    assert [planner.choose() for _ in range(12)] == [0, 0, 0, 1] * 3


def test_planner_probes_less_often_when_a_probe_is_dear():
    """A probe costs at most PROBE_BUDGET of the plain rounds' time: dear drafts, rarer probes."""
    planner = WindowPlanner(8, probe_every=4)
    teach(planner, verify=lambda n: 0.01 + 0.0001 * n, draft_per_token=0.003, acceptance=0.0)
    extra, plain = 0.0001 + 0.003, 0.0101
    interval = math.ceil(extra / (PROBE_BUDGET * plain))
    assert interval > 4 and planner.probe_interval() == interval
    assert [planner.choose() for _ in range(2 * interval)] == ([0] * (interval - 1) + [1]) * 2


def test_free_drafts_ignore_the_drafter_cost():
    """Prompt lookup: no drafter measurement needed, and its cost does not count."""
    planner = WindowPlanner(6, free_drafts=True)
    for n in (1, 5, 1, 5):
        planner.observe(drafted=0, accepted=0, draft_seconds=0.0, verify_positions=n, verify_seconds=0.05 + 0.001 * n)
    assert not planner.draft.known and planner.choose() > 0


def test_fixed_planner_always_drafts_max_window():
    planner = WindowPlanner(5, fixed=True)
    assert planner.choose() == 5
    teach(planner, verify=lambda n: 0.001 + 0.0001 * n, draft_per_token=0.05, acceptance=0.0)
    assert [planner.choose() for _ in range(10)] == [5] * 10


def test_planner_acceptance_estimate():
    """Prior 0.5 worth 2 rounds; a round of 4 accepted drafts raises it, a round rejected at once lowers it."""
    planner = WindowPlanner(8)
    assert planner.acceptance == pytest.approx(0.5)
    planner.observe(drafted=4, accepted=4, draft_seconds=0.01, verify_positions=5, verify_seconds=0.01)
    assert planner.acceptance == pytest.approx((0.9 + 4) / (0.9 + 4 + 0.9))
    planner.observe(drafted=4, accepted=0, draft_seconds=0.01, verify_positions=5, verify_seconds=0.01)
    assert planner.acceptance == pytest.approx(4.41 / (4.41 + 0.81 + 1))
    planner.observe(drafted=0, accepted=0, draft_seconds=0.0, verify_positions=1, verify_seconds=0.01)
    assert planner.acceptance == pytest.approx(4.41 / (4.41 + 0.81 + 1))  # a plain round says nothing


def test_planner_rejects_a_window_below_1():
    with pytest.raises(ValueError, match="max_window"):
        WindowPlanner(0)


# ---- PlannedDrafts -------------------------------------------------------------------------------
