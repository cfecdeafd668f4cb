"""Speculative decoding through the swarm: transformers drafts and verifies, shoal picks the window.

``model.generate(..., assistant_model=draft)`` and ``model.generate(..., prompt_lookup_num_tokens=N)``
run transformers' own assisted decoding over the distributed model: a round drafts ``k`` tokens
locally (a draft model with its own KV cache, or n-grams of the prompt), sends them through the
chain as one step of ``k + 1`` positions, keeps the longest prefix the target agrees with (greedy), or
applies the speculative-sampling rule, which leaves the target's distribution exact (sampling with
a draft model), and crops the rest: :class:`~shoal.client.model.SessionCache` rolls the session
back, and every server overwrites the rejected positions with its next step.

What transformers leaves to a heuristic (grow the window by 2 when every draft was accepted, shrink
it by 1 otherwise) shoal decides from measurements, in :class:`WindowPlanner`: a round of window
``k`` yields ``E(k) = 1 + a (1 - a^k) / (1 - a)`` tokens on average (acceptance ``a`` per draft
token, independent, until the first rejection) and costs ``verify(k + 1) + draft(k)`` seconds, where
``verify(n)`` is the chain's measured time for a step of ``n`` positions (its round trip and fixed
costs are the intercept, compute per position the slope) and ``draft(k)`` the drafter's. The
planner takes the ``k`` with the most tokens per second, and ``k = 0`` (plain decoding: the round
sends one position and drafts nothing) when drafting does not pay; then now and then a round drafts
one token (a probe, costing at most 3% of the time), so a draft that starts to agree again is
noticed. Everything is measured on the running generation (wall clock around transformers' calls),
so the window follows the network the chain is on: long round trips make verifying many positions
at once worth a lot.

Any window may follow any other, 0 included: before a round, :mod:`shoal.client.generation.drafters` lines the
drafter up with the sequence (transformers assumes it ran in the previous round). A drafter that
fails in a round costs that round its drafts, never the generation: the round decodes plainly (the
tokens are plain decoding's), the first failure of a call is logged, and after
:data:`MAX_DRAFT_FAILURES` the call's remaining rounds draft nothing.

Pure apart from the clock: :class:`WindowPlanner` and :class:`LinearCost` do no I/O, and
:class:`PlannedDrafts` only wraps one of transformers' candidate generators.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation.candidate_generator import (
    AssistedCandidateGenerator,
    CandidateGenerator,
    PromptLookupCandidateGenerator,
)

from shoal.client.generation.drafters import view_of

logger = logging.getLogger(__name__)

#: The largest share of plain decoding's time that probing a draft that does not pay may cost.
PROBE_BUDGET = 0.03
#: Below this weighted variance, the step sizes observed count as one size (no slope to fit).
MIN_SIZE_VARIANCE = 0.1
#: Failed rounds after which a ``generate`` call stops asking its drafter (each may cost a draft prefill).
MAX_DRAFT_FAILURES = 3

__all__ = [
    "LinearCost",
    "PlannedDrafts",
    "RoundRecord",
    "SpeculationStats",
    "VerifyCost",
    "WindowPlanner",
    "expected_tokens",
]


@dataclass(frozen=True)
class RoundRecord:
    """One verification round: the window chosen, the tokens drafted (a drafter may find fewer, e.g.
    no n-gram match) and how many of them the target accepted."""

    window: int
    drafted: int
    accepted: int


@dataclass
class SpeculationStats:
    """What speculation did in one ``generate`` call. Acceptance = accepted / drafted draft tokens;
    window = drafted tokens / rounds (the prefill round included). ``failures``: rounds whose drafter
    raised (they decoded plainly)."""

    rounds: list[RoundRecord] = field(default_factory=list)
    failures: int = 0

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_window(self) -> float:
        return self.drafted / len(self.rounds) if self.rounds else 0.0

    def summary(self) -> dict[str, float | int]:
        """The numbers the API's usage extension, the metrics and the demo show."""
        return {
            "rounds": len(self.rounds),
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.acceptance, 4),
            "mean_window": round(self.mean_window, 3),
        }


def expected_tokens(window: int, acceptance: float) -> float:
    """Tokens a round of ``window`` drafts yields on average: the accepted drafts plus the target's
    own next token, with each draft accepted with probability ``acceptance`` until the first miss."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return window + 1.0
    return 1.0 + a * (1.0 - a**window) / (1.0 - a)


class LinearCost:
    """``seconds ~ intercept + slope * n``, fitted by least squares with exponential forgetting
    (``memory`` per observation). Until two different ``n`` were seen, the slope is
    ``prior_slope`` if given, else the cost is taken as proportional to ``n`` (the pessimistic
    guess for the drafter: each token costs the same)."""

    def __init__(self, memory: float = 0.9, prior_slope: float | None = None):
        if not 0.0 < memory <= 1.0:
            raise ValueError("memory must be in (0, 1]")
        self.memory = memory
        self.prior_slope = prior_slope
        self._sums = [0.0] * 5  # weights, n, n^2, seconds, n * seconds

    @property
    def known(self) -> bool:
        return self._sums[0] > 0

    def add(self, n: int, seconds: float) -> None:
        w, sn, snn, st, snt = (s * self.memory for s in self._sums)
        self._sums = [w + 1, sn + n, snn + n * n, st + seconds, snt + n * seconds]

    def _variance(self) -> float:
        """The weighted variance of the sizes observed."""
        w, sn, snn = self._sums[:3]
        return snn / w - (sn / w) ** 2 if w > 0 else 0.0

    @property
    def spread(self) -> bool:
        """Whether observations came in at least two sizes (a slope can be fitted)."""
        return self._variance() > MIN_SIZE_VARIANCE

    def mean(self) -> tuple[float, float]:
        """The weighted mean size and seconds observed."""
        w, sn, _, st, _ = self._sums
        return (sn / w, st / w) if w > 0 else (0.0, 0.0)

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope), both >= 0."""
        if not self.known:
            return 0.0, 0.0
        mean_n, mean_t = self.mean()
        if self.spread:  # at least two sizes seen: regress
            slope = (self._sums[4] / self._sums[0] - mean_n * mean_t) / self._variance()
        elif self.prior_slope is not None:
            slope = self.prior_slope
        else:
            slope = mean_t / mean_n if mean_n > 0 else 0.0
        slope = max(slope, 0.0)
        intercept = mean_t - slope * mean_n
        if intercept < 0:  # the line would promise free rounds: make it proportional instead
            intercept, slope = 0.0, (mean_t / mean_n if mean_n > 0 else slope)
        return intercept, slope

    def predict(self, n: int) -> float:
        intercept, slope = self.coefficients()
        return intercept + slope * n


class VerifyCost:
    """The chain's time for a step of ``n`` positions. A one-position step is measured on its own
    (``single``): on a CPU it is a matrix-vector product, a regime of its own, cheaper per position
    than the matrix products of longer steps, which :class:`LinearCost` fits (``steps``). Until
    those came in two sizes, a longer step is taken to cost what the ones seen did (optimistic: the
    planner then tries a wider window, and its cost shows the slope)."""

    def __init__(self, memory: float = 0.95):
        if not 0.0 < memory <= 1.0:
            raise ValueError("memory must be in (0, 1]")
        self.memory = memory
        self.steps = LinearCost(memory=memory, prior_slope=0.0)
        self._single: float | None = None

    @property
    def known(self) -> bool:
        return self.steps.known and self._single is not None

    def add(self, n: int, seconds: float) -> None:
        if n <= 1:
            self._single = seconds if self._single is None else self.memory * self._single + (1 - self.memory) * seconds
        else:
            self.steps.add(n, seconds)

    def predict(self, n: int) -> float:
        if n <= 1 and self._single is not None:
            return self._single
        if not self.steps.known:
            return (self._single or 0.0) * n
        return self.steps.predict(n)


class WindowPlanner:
    """Chooses each round's number of draft tokens (0 .. ``max_window``) for the most expected tokens
    per second, from the chain's and the drafter's measured costs and the running acceptance rate.

    ``free_drafts``: the drafter costs nothing worth measuring (prompt lookup). ``fixed``: always
    ``max_window`` (a fixed schedule, for comparison). Acceptance starts at ``prior_acceptance``
    worth ``prior_weight`` rounds and forgets old rounds at ``memory`` per round.
    """

    def __init__(
        self,
        max_window: int,
        *,
        free_drafts: bool = False,
        fixed: bool = False,
        first_window: int = 2,
        prior_acceptance: float = 0.5,
        prior_weight: float = 2.0,
        memory: float = 0.9,
        probe_every: int = 8,
    ):
        if max_window < 1:
            raise ValueError("max_window must be at least 1")
        self.max_window = max_window
        self.free_drafts = free_drafts
        self.fixed = fixed
        self.first_window = max(1, min(first_window, max_window))
        self.memory = memory
        self.probe_every = probe_every
        self.verify = VerifyCost(memory=0.95)
        self.draft = LinearCost(memory=0.9)
        self._accepted = prior_acceptance * prior_weight  # accepted draft tokens (discounted)
        self._missed = (1.0 - prior_acceptance) * prior_weight  # rounds that ended on a rejected draft
        self._plain_rounds = 0

    @property
    def acceptance(self) -> float:
        """Estimated chance that a draft token is accepted, given all before it were (the maximum-
        likelihood estimate of a geometric run length, censored at the window)."""
        return self._accepted / (self._accepted + self._missed)

    def rate(self, window: int) -> float:
        """Expected tokens per second of a round of ``window`` drafts (needs a verify measurement)."""
        seconds = self.verify.predict(window + 1)
        if window > 0 and not self.free_drafts:
            seconds += self.draft.predict(window)
        return expected_tokens(window, self.acceptance) / seconds if seconds > 0 else math.inf

    def choose(self) -> int:
        if self.fixed:
            return self.max_window
        # learn the costs first: a round that drafts (its step and the drafter), then a plain one
        if not self.verify.steps.known or not (self.free_drafts or self.draft.known):
            return self.first_window
        if not self.verify.known:
            return 0
        rates = [self.rate(k) for k in range(self.max_window + 1)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))  # ties: the smaller window
        if best > 0:
            self._plain_rounds = 0
            return best
        self._plain_rounds += 1
        if self._plain_rounds >= self.probe_interval():  # drafting did not pay: look again now and then
            self._plain_rounds = 0
            return 1
        return 0

    def probe_interval(self) -> int:
        """Plain rounds between probes: at least ``probe_every``, and enough that probing costs at
        most ``PROBE_BUDGET`` of the time plain decoding takes."""
        extra = self.verify.predict(2) - self.verify.predict(1) + (0.0 if self.free_drafts else self.draft.predict(1))
        plain = self.verify.predict(1)
        if plain <= 0:
            return self.probe_every
        return max(self.probe_every, math.ceil(extra / (PROBE_BUDGET * plain)))

    def observe(
        self,
        *,
        drafted: int,
        accepted: int,
        draft_seconds: float,
        verify_positions: int,
        verify_seconds: float,
        prefill: bool = False,
    ) -> None:
        """One round's outcome: what was drafted and accepted, and what drafting and verifying cost.
        A call's first round (``prefill``: the prompt's step, the draft model's own prefill) counts
        for the acceptance rate only: its costs are not a round's."""
        if not prefill:
            self.verify.add(verify_positions, verify_seconds)
            if drafted > 0:
                self.draft.add(drafted, draft_seconds)
        if drafted > 0:
            self._accepted = self._accepted * self.memory + accepted
            self._missed = self._missed * self.memory + (1.0 if accepted < drafted else 0.0)


class PlannedDrafts(CandidateGenerator):
    """One of transformers' drafters with the window set by a :class:`WindowPlanner` every round,
    timing both halves of the round and keeping :class:`SpeculationStats`.

    ``cached()`` is the number of positions the target's session holds (what a verification step does
    not send again). Only drafters with a window to set are wrapped (see :func:`windowed`)."""

    def __init__(
        self,
        inner: CandidateGenerator,
        planner: WindowPlanner,
        stats: SpeculationStats,
        cached: Callable[[], int],
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.inner = inner
        self.planner = planner
        self.stats = stats
        self.cached = cached
        self.clock = clock
        self.view = view_of(inner)  # lines the drafter up with the sequence before each round
        # window, drafted, draft s, positions, t0, and whether it is the call's first round (its prefill)
        self._round: tuple[int, int, float, int, float, bool] | None = None
        self._outcome: tuple[int, int, float, int, float, bool] | None = None  # the last round, until the next
        if isinstance(inner, AssistedCandidateGenerator):
            # the window is the planner's: no confidence cut-off inside the draft's own generate
            inner.generation_config.assistant_confidence_threshold = 0.0
            inner.assistant_generation_config.assistant_confidence_threshold = 0.0
        if isinstance(inner, PromptLookupCandidateGenerator):
            # it runs the logits processors on placeholder logits to drop candidates they forbid; a
            # sampling processor forbids all but its draw. Verification keeps the output exact anyway.
            inner.logits_processor = None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # e.g. requires_model_outputs, assistant_model

    @property
    def requires_model_outputs(self) -> bool:
        return bool(getattr(self.inner, "requires_model_outputs", False))

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        started = self.clock()
        self._observe_previous(started)
        window = self.planner.choose()
        first = not self.stats.rounds  # its step sends the prompt: not a round's cost
        if isinstance(self.inner, PromptLookupCandidateGenerator):  # it does not stop at max_length itself
            window = max(0, min(window, self.inner.max_length - 1 - input_ids.shape[1]))
        if self.stats.failures >= MAX_DRAFT_FAILURES:
            window = 0
        candidates, logits, prefill = self._draft(input_ids, window, kwargs)
        drafted = candidates.shape[1] - input_ids.shape[1]
        now = self.clock()
        self._round = (window, drafted, now - started, candidates.shape[1] - self.cached(), now, first or prefill)
        return candidates, logits

    def _draft(
        self, input_ids: torch.LongTensor, window: int, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """(candidates, their logits, whether the draft model started from nothing: its prefill) for a
        round of ``window``; the input alone (a plain round) for window 0 or a drafter that raised."""
        if window == 0:
            return input_ids, None, False
        try:
            prefill = self.view.before(input_ids)
            set_window(self.inner, window)
            candidates, logits = self.inner.get_candidates(input_ids, **kwargs)
            self.view.after(input_ids, candidates)
        except Exception as error:  # speculation must not fail the generation: this round decodes plainly
            self.stats.failures += 1
            if self.stats.failures == 1:
                logger.warning(
                    "speculation: the drafter (%s) failed: %r; its rounds decode plainly",
                    type(self.inner).__name__, error, exc_info=True,
                )  # fmt: skip
            self.view.reset()  # its cache may be half written: start over
            return input_ids, None, False
        return candidates, logits, prefill

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        if self._round is not None:
            window, drafted, draft_seconds, positions, verify_started, first = self._round
            accepted = min(int(num_matches), drafted)
            self.stats.rounds.append(RoundRecord(window, drafted, accepted))
            self._outcome = (drafted, accepted, draft_seconds, positions, verify_started, first)
            self._round = None
        self.inner.update_candidate_strategy(input_ids, scores, num_matches)

    def _observe_previous(self, now: float) -> None:
        """Tell the planner what the last round cost: verifying is everything from the end of its
        drafting to the start of this round (the step, the LM head, transformers' bookkeeping)."""
        if self._outcome is not None:
            drafted, accepted, draft_seconds, positions, verify_started, prefill = self._outcome
            self.planner.observe(
                drafted=drafted,
                accepted=accepted,
                draft_seconds=draft_seconds,
                verify_positions=positions,
                verify_seconds=now - verify_started,
                prefill=prefill,
            )
            self._outcome = None


def windowed(inner: CandidateGenerator) -> bool:
    """Whether shoal can set ``inner``'s window (a draft model, any tokenizer, or prompt lookup)."""
    return isinstance(inner, AssistedCandidateGenerator | PromptLookupCandidateGenerator)


def max_window(inner: CandidateGenerator) -> int:
    """The largest window to consider: what the user configured the drafter with."""
    if isinstance(inner, PromptLookupCandidateGenerator):
        return int(inner.num_output_tokens)
    return max(1, int(inner.num_assistant_tokens))


def set_window(inner: CandidateGenerator, window: int) -> None:
    if isinstance(inner, PromptLookupCandidateGenerator):
        inner.num_output_tokens = window
    else:
        inner.num_assistant_tokens = window
