"""PlannedDrafts (:mod:`shoal.client.generation.speculation`): a drafter driven by a window planner,
timed on both halves of each round, with its statistics and pass-through attributes; and the
prompt-lookup window helpers. The planner and its cost models: ``test_speculation.py``."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.candidate_generator import CandidateGenerator, PromptLookupCandidateGenerator

from shoal.client.generation.speculation import (
    PlannedDrafts,
    RoundRecord,
    SpeculationStats,
    WindowPlanner,
    max_window,
    set_window,
    windowed,
)


class FakeDrafter(CandidateGenerator):
    """Drafts tokens 100, 101, ... up to its window, at most ``supply`` of them."""

    def __init__(self, supply: int = 100):
        self.num_assistant_tokens = 0
        self.supply = supply
        self.windows: list[int] = []
        self.updates: list[tuple[int, int]] = []

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        self.windows.append(self.num_assistant_tokens)
        n = min(self.num_assistant_tokens, self.supply)
        drafts = torch.arange(100, 100 + n).view(1, -1)
        return torch.cat([input_ids, drafts], dim=1), torch.zeros(1, n, 8)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.updates.append((input_ids.shape[1], num_matches))


class ScriptedPlanner(WindowPlanner):
    """Chooses the windows given, and records what it is told."""

    def __init__(self, windows: list[int]):
        super().__init__(8)
        self.windows = list(windows)
        self.observed: list[dict] = []

    def choose(self) -> int:
        return self.windows.pop(0)

    def observe(self, **outcome) -> None:
        self.observed.append(outcome)


class FakeClock:
    """Returns the scripted times in turn."""

    def __init__(self, times: list[float]):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_planned_drafts_set_the_window_time_both_halves_and_keep_stats():
    """Each round: the planner's window goes to the drafter (not asked at all for 0), the round is
    recorded once transformers reports its matches, and the planner hears its costs when the next
    round starts (drafting: the drafter's call; verifying: from then until the next round), the
    first round marked as the prefill."""
    drafter, planner, stats = FakeDrafter(supply=3), ScriptedPlanner([4, 0, 2, 0]), SpeculationStats()
    cached = {"n": 0}
    # per round: start (the previous round's verification ends), drafting done
    clock = FakeClock([0.0, 0.5, 2.0, 2.0, 2.75, 2.875, 3.75, 3.75])
    planned = PlannedDrafts(drafter, planner, stats, cached=lambda: cached["n"], clock=clock)
    ids = torch.arange(10).view(1, -1)

    # round 1 (prefill): window 4, the drafter finds 3; 10 prompt + 3 drafts sent; 1 accepted
    candidates, logits = planned.get_candidates(ids)
    assert candidates.tolist() == [[*range(10), 100, 101, 102]] and logits.shape == (1, 3, 8)
    ids = candidates[:, :12]
    planned.update_candidate_strategy(ids, torch.zeros(1, 4, 8), 1)
    assert stats.rounds == [RoundRecord(4, 3, 1)] and planner.observed == []  # its cost: when round 2 starts
    cached["n"] = 11
    # round 2: window 0, the drafter is not asked; the last token is sent alone
    candidates, logits = planned.get_candidates(ids)
    assert torch.equal(candidates, ids) and logits is None
    ids = torch.cat([ids, torch.tensor([[7]])], dim=1)
    planned.update_candidate_strategy(ids, torch.zeros(1, 1, 8), 0)
    cached["n"] = 12
    # round 3: window 2, both drafts accepted (transformers may report more matches than drafts: capped)
    candidates, _ = planned.get_candidates(ids)
    ids = torch.cat([candidates, torch.tensor([[9]])], dim=1)
    planned.update_candidate_strategy(ids, torch.zeros(1, 3, 8), 5)
    cached["n"] = 15
    # round 4: window 0 again
    planned.get_candidates(ids)
    planned.update_candidate_strategy(torch.cat([ids, torch.tensor([[3]])], dim=1), torch.zeros(1, 1, 8), 0)

    assert drafter.windows == [4, 2]
    assert drafter.updates == [(12, 1), (13, 0), (16, 5), (17, 0)]  # every round is passed on, plain ones too
    assert stats.rounds == [RoundRecord(4, 3, 1), RoundRecord(0, 0, 0), RoundRecord(2, 2, 2), RoundRecord(0, 0, 0)]
    assert planner.observed == [  # the last round is heard of only if another starts
        dict(drafted=3, accepted=1, draft_seconds=0.5, verify_positions=13, verify_seconds=1.5, prefill=True),
        dict(drafted=0, accepted=0, draft_seconds=0.0, verify_positions=1, verify_seconds=0.75, prefill=False),
        dict(drafted=2, accepted=2, draft_seconds=0.125, verify_positions=3, verify_seconds=0.875, prefill=False),
    ]
    assert clock.times == []
    assert (stats.drafted, stats.accepted, stats.acceptance) == (5, 3, 0.6)
    assert stats.mean_window == pytest.approx(5 / 4)
    # an update without a round in flight records nothing (but still reaches the drafter)
    planned.update_candidate_strategy(ids, torch.zeros(1, 1, 8), 0)
    assert len(stats.rounds) == 4 and len(drafter.updates) == 5


def test_planned_drafts_mark_each_calls_first_round_as_prefill():
    """The planner outlives a ``generate`` call: every call's wrapper reports its own first round as
    the prefill (an update before any round does not count as one)."""
    planner = ScriptedPlanner([2, 0, 1] * 2)
    for _ in range(2):  # two calls sharing the planner, three rounds each
        clock = FakeClock([0.0] * 6)
        planned = PlannedDrafts(FakeDrafter(), planner, SpeculationStats(), cached=lambda: 0, clock=clock)
        ids = torch.arange(4).view(1, -1)
        planned.update_candidate_strategy(ids, torch.zeros(1, 1, 8), 0)
        for _ in range(3):
            candidates, _ = planned.get_candidates(ids)
            planned.update_candidate_strategy(candidates, torch.zeros(1, 1, 8), 0)
    # the third round of each call is never observed: no round starts after it
    assert [(o["drafted"], o["prefill"]) for o in planner.observed] == [(2, True), (0, False)] * 2


def test_planned_drafts_pass_attributes_through():
    drafter = FakeDrafter()
    planned = PlannedDrafts(drafter, ScriptedPlanner([]), SpeculationStats(), cached=lambda: 0)
    assert planned.supply == 100 and planned.requires_model_outputs is False


def test_speculation_stats_summary():
    assert SpeculationStats().summary() == {
        "rounds": 0,
        "drafted_tokens": 0,
        "accepted_tokens": 0,
        "acceptance_rate": 0.0,
        "mean_window": 0.0,
    }
    stats = SpeculationStats([RoundRecord(4, 4, 3), RoundRecord(4, 2, 0), RoundRecord(0, 0, 0)])
    assert stats.summary() == {
        "rounds": 3,
        "drafted_tokens": 6,
        "accepted_tokens": 3,
        "acceptance_rate": 0.5,
        "mean_window": 2.0,
    }


def test_prompt_lookup_window_helpers():
    lookup = PromptLookupCandidateGenerator(num_output_tokens=5, max_length=40)
    assert windowed(lookup) and max_window(lookup) == 5
    set_window(lookup, 2)
    assert lookup.num_output_tokens == 2
    assert not windowed(FakeDrafter())
