"""Audit mode (``verify="audit"``, K = 8) against byzantine servers from the fault seam.

One swarm of honest servers of a tiny random llama (4 blocks): ``[0:2]`` x3 and ``[2:4]`` x3 (the
third replica of each span runs 2 torch threads, the others 1). Each case adds one liar
(:func:`testkit.faulty.make_faulty`) and connects a fresh client to the liar, two honest replicas
of its span (3 replicas in all: one to audit, one to settle) and the 3 honest servers of the other
span; the client's first chain is steered through the liar (:func:`tests.helpers.byzantine.steer_through`,
asserted, and the liar's own record proves it served and lied). The honest runs are local
transformers (fp32, one thread) on the same weights; their greedy choices are at least
:data:`MIN_GAP` apart (the large init of :mod:`testkit.tiny`), far above fp32 noise, so token
equality is a fair test.

For every fault kind alone: 64 greedy tokens equal the honest ones, the liar is banned (and no
honest server; both honest replicas of its span confirm the evidence sent to them), and a
position-seeded sampled run (:class:`~shoal.client.generation.sampling.PositionSeededSampler`) equals the
honest seeded run. The detection lag is read from the liar's own record, not from the client under
test: the positions it still computed after the step of its first lie are fewer than K (every step
from the first lie on is recorded, so the last one recorded is the last it served before the ban; a
lie in the 12-token prefill is audited right after it, lag 0). 20 seeded runs with the first lie at
20 different positions each catch it within K. Honest replicas audited over 200+ positions never
disagree; a span without a second replica is reported unverified and generation does not wait
for one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from shoal.client.generation.sampling import PositionSeededSampler
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.verify.compare import tolerance_for
from testkit.faults import (
    Equivocate,
    Fault,
    Identity,
    Noise,
    OtherWeights,
    SkipBlock,
    StaleCache,
    When,
    Zeros,
)
from testkit.faulty import make_faulty
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import (
    connect_over,
    lies,
    peer_of,
    steer_through,
    would_route_over,
)
from tests.helpers.parity import greedy_with_gap

pytestmark = pytest.mark.timeout(60)

K = 8
NEW_TOKENS = 64
PROMPT_LENGTH = 12
LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
MODEL_SEED = 0  # test_swarm_generation's llama: its 64 greedy tokens from this prompt have top-2 gaps >= 2e-2
PROMPT_SEED = 100
MIN_GAP = 1e-3
#: The smallest corruption shoal.verify.compare says it catches in fp32 (its calibration comment: 5e-4;
#: the issue's bar is 1e-3).
SMALLEST_FP32_NOISE = 5e-4
SAMPLING_SEED = 77
SAMPLING_TEMPERATURE = 1.0


@dataclass(frozen=True)
class Case:
    """One liar: its faults, the span it serves, and what its record must show."""

    faults: tuple[Fault, ...]
    span: BlockRange = HIGH
    every_step: bool = True  # the record holds every step from the first lie on (the lag is measurable)
    stale_cache: bool = False


CASES: dict[str, Case] = {
    "noise-1e-1": Case((Noise(0.1, seed=1),)),
    "noise-smallest": Case((Noise(SMALLEST_FP32_NOISE, seed=2),)),
    "zeros": Case((Zeros(),)),
    "identity": Case((Identity(),)),
    "skip-block": Case((SkipBlock(3),)),
    "other-weights": Case((OtherWeights(block=2, relative=0.5, seed=3),)),
    "every-10th-step": Case((Noise(0.1, seed=4, when=When(first_step=9, every=10)),), every_step=False),
    "from-position-32": Case((Noise(0.1, seed=5, when=When(from_position=32)),)),
    "stale-cache": Case((StaleCache(),), stale_cache=True),
    "equivocate": Case((Equivocate(0.1, seed=6),), span=LOW),  # a liar pushes onward: not the last hop
    "noise-1e-1-first-span": Case((Noise(0.1, seed=7),), span=LOW),
}


def prompt_of(seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(seed))


@dataclass
class World:
    """The honest swarm, the local reference, the liars made so far (one per case, shared by its tests)."""

    swarm: InProcessSwarm
    reference: object
    honest: dict[BlockRange, list[LocalServer]]
    liars: dict[str, LocalServer] = field(default_factory=dict)
    memo: dict[object, torch.Tensor] = field(default_factory=dict)

    def liar(self, name: str) -> LocalServer:
        if name not in self.liars:
            case = CASES[name]
            self.liars[name] = self.swarm.add(case.span, lambda server: make_faulty(server, list(case.faults)))
        return self.liars[name]

    def peers_with(self, liar: LocalServer) -> list[LocalServer]:
        """The liar, two honest replicas of its span, every honest server of the other span."""
        other = HIGH if liar.blocks == LOW else LOW
        return [liar, *self.honest[liar.blocks][:2], *self.honest[other]]

    def chain_through(self, liar: LocalServer) -> list[LocalServer]:
        other = HIGH if liar.blocks == LOW else LOW
        return [liar, self.honest[other][0]] if liar.blocks == LOW else [self.honest[other][0], liar]

    def expected(self, key, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def greedy(self, prompt_seed: int, new_tokens: int) -> torch.Tensor:
        def compute() -> torch.Tensor:
            tokens, gap = greedy_with_gap(self.reference, prompt_of(prompt_seed), max_new_tokens=new_tokens)
            assert gap > MIN_GAP, f"honest greedy run has a near-tie (top-2 gap {gap:.2e}): choose another seed"
            assert tokens.shape[1] == PROMPT_LENGTH + new_tokens
            return tokens

        return self.expected(("greedy", prompt_seed, new_tokens), compute)

    def sampled(self) -> torch.Tensor:
        return self.expected("sampled", lambda: sample(self.reference))


def sample(model) -> torch.Tensor:
    processors = LogitsProcessorList([PositionSeededSampler(SAMPLING_TEMPERATURE, seed=SAMPLING_SEED)])
    return model.generate(prompt_of(PROMPT_SEED), max_new_tokens=NEW_TOKENS, do_sample=False,
                          logits_processor=processors)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("verify-model"), "llama", MODEL_SEED, tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def world(model_dir):
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with InProcessSwarm(model_dir, []) as swarm:
        honest = {span: [swarm.add(span), swarm.add(span), swarm.add(span, num_threads=2)] for span in (LOW, HIGH)}
        yield World(swarm, reference, honest)


def audited(world: World, liar: LocalServer):
    """A fresh audit-mode client over the liar and its honest company, its chain steered through the liar."""
    return connect_over(world.swarm, world.peers_with(liar), verify="audit", audit_every=K)


def check_repaired(world: World, model, liar: LocalServer, case: Case, since: int) -> None:
    """The liar lied on this generation (so it was on the chain), was caught within K positions,
    banned and never routed over again; no honest server was banned."""
    entries = liar.server.record.entries()[since:]
    told = lies(entries, stale_cache=case.stale_cache)
    assert told is not None, f"the liar never lied: its record since the run is {entries}"
    if case.every_step:
        assert told.lag < K, f"first lie at position {told.first}, still lying up to position {told.last_end - 1}"
    else:
        assert told.steps == 1, f"the liar lied {told.steps} times: caught only after a later lie ({entries})"
    verification = model.verification
    assert verification.bans == 1, f"bans {verification.bans} (one liar): {verification}"
    assert verification.unsettled == 0, verification
    assert not would_route_over(model, liar), "the banned liar is still routed over"
    assert verification.banned == (peer_of(liar),), verification
    for server in world.peers_with(liar)[1:]:
        assert would_route_over(model, server), f"honest server {peer_of(server)[:10]} is avoided"
    assert liar.ticket.peer_id not in {s.peer_id for s in model.blocks.chain}


@pytest.mark.parametrize("fault_case", list(CASES))
def test_greedy_equals_honest_and_liar_is_banned(world, fault_case):
    case = CASES[fault_case]
    liar = world.liar(fault_case)
    expected = world.greedy(PROMPT_SEED, NEW_TOKENS)
    since = len(liar.server.record)
    with audited(world, liar) as model:
        route = steer_through(model, world.chain_through(liar))
        assert route == [peer_of(s) for s in world.chain_through(liar)], "the chain does not go through the liar"
        got = model.generate(prompt_of(PROMPT_SEED), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert got.shape == expected.shape
        mismatch = (got != expected).nonzero()
        assert mismatch.numel() == 0, f"first wrong token at (row, col) {mismatch[0].tolist()}"
        check_repaired(world, model, liar, case, since)
        if fault_case != "equivocate":  # an equivocation may be caught by receipts before any audit disagrees
            assert model.verification.disagreements >= 1 and model.verification.settled >= 1, model.verification
            assert model.verification.rollbacks >= 1, model.verification
    # closing waited for the testimony: both honest replicas of the liar's span judged the evidence
    # and confirmed the lie (an equivocation is proved by two receipts, for which no evidence is sent)
    verification = model.verification
    if verification.settled:
        assert (verification.evidence_sent, verification.evidence_confirmed) == (2, 2), verification
        assert verification.evidence_rejected == 0, verification


@pytest.mark.slow
@pytest.mark.parametrize("fault_case", list(CASES))
def test_seeded_sampling_equals_honest_seeded_run(world, fault_case):
    case = CASES[fault_case]
    liar = world.liar(fault_case)
    expected = world.sampled()
    greedy = world.greedy(PROMPT_SEED, NEW_TOKENS)
    assert not torch.equal(expected, greedy), "the seeded sampler draws the greedy tokens: the test is void"
    since = len(liar.server.record)
    with audited(world, liar) as model:
        route = steer_through(model, world.chain_through(liar))
        assert route == [peer_of(s) for s in world.chain_through(liar)], "the chain does not go through the liar"
        got = sample(model)
        assert got.shape == expected.shape
        mismatch = (got != expected).nonzero()
        assert mismatch.numel() == 0, f"first wrong token at (row, col) {mismatch[0].tolist()}"
        check_repaired(world, model, liar, case, since)


RUNS = 20
RUN_TOKENS = 24
#: Prompt seeds of the 20 runs: 200-220 without 205, whose honest 24-token run has a near-tie (gap 3e-4).
RUN_PROMPT_SEEDS = (*range(200, 205), *range(206, 221))
#: Prompt seeds of the honest-audit runs: their 64 greedy tokens keep top-2 gaps >= 1.5e-2.
HONEST_PROMPT_SEEDS = (PROMPT_SEED, 103, 104)


def lie_run(world: World, prompt_seed: int, lie_from: int, noise_seed: int) -> tuple[str | None, int | None]:
    """One 24-token run with a fresh liar that adds noise 1e-1 from ``lie_from`` on: (what went
    wrong or None, positions from the step of its first lie to its ban)."""
    fault = Noise(0.1, seed=noise_seed, when=When(from_position=lie_from))
    liar = world.swarm.add(HIGH, lambda server: make_faulty(server, [fault]))
    try:
        expected = world.greedy(prompt_seed, RUN_TOKENS)
        with audited(world, liar) as model:
            steer_through(model, world.chain_through(liar))
            got = model.generate(prompt_of(prompt_seed), max_new_tokens=RUN_TOKENS, do_sample=False)
            told = lies(liar.server.record.entries())
            if told is None or told.first != lie_from:
                return f"the liar's record {liar.server.record.entries()}", None
            if not torch.equal(got, expected):
                return f"first wrong token at {(got != expected).nonzero()[0].tolist()}: {model.verification}", told.lag
            if model.verification.banned != (peer_of(liar),) or would_route_over(model, liar):
                return f"the liar is not banned for good: {model.verification}", told.lag
            return None, told.lag
    finally:
        world.swarm.kill(liar)


@pytest.mark.slow
def test_first_lie_caught_within_k_positions_in_20_seeded_runs(world):
    """Noise 1e-1 from a position chosen per run (spread over every decode position of a 24-token
    run), a prompt per run: each run's first lie is caught within K positions, the answer is the
    honest one, the liar is banned. Every run is made; the failures are reported together."""
    assert len(RUN_PROMPT_SEEDS) == RUNS
    last_position = PROMPT_LENGTH + RUN_TOKENS - 2  # the last position a 24-token run computes
    starts = [PROMPT_LENGTH + (run * 7) % (last_position - PROMPT_LENGTH + 1) for run in range(RUNS)]
    assert len(set(starts)) == RUNS
    problems, lags = {}, {}
    for run, (prompt_seed, lie_from) in enumerate(zip(RUN_PROMPT_SEEDS, starts, strict=True)):
        problem, lags[run] = lie_run(world, prompt_seed, lie_from, noise_seed=1000 + run)
        if problem is not None:
            problems[f"run {run} (prompt {prompt_seed}, lies from {lie_from})"] = problem
    late = {run: lag for run, lag in lags.items() if lag is not None and lag >= K}
    assert not problems and not late, f"failed runs: {problems}; caught K or more positions late: {late}"


def test_repair_keeps_a_generated_pad_token_unmasked(world):
    """The honest answer to prompt 218 begins with the pad id (0); a lie from position 16 makes the
    repair resume from ids that hold it. It must stay a token (the uninterrupted run never masks
    it): the repaired answer equals the honest one."""
    expected = world.greedy(218, RUN_TOKENS)
    assert int(expected[0, PROMPT_LENGTH]) == world.reference.generation_config.pad_token_id == 0
    problem, lag = lie_run(world, 218, lie_from=16, noise_seed=5)
    assert problem is None, problem
    assert lag is not None and lag < K


def test_no_false_alarms_over_200_audited_positions(world):
    """Honest replicas (1 and 2 torch threads) audited over 200+ positions never disagree."""
    servers = [s for span in (LOW, HIGH) for s in world.honest[span]]
    with connect_over(world.swarm, servers, verify="audit", audit_every=K) as model:
        for seed in HONEST_PROMPT_SEEDS:
            expected = world.greedy(seed, NEW_TOKENS)
            got = model.generate(prompt_of(seed), max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, expected), f"prompt {seed}: first wrong token {(got != expected).nonzero()[0]}"
        verification = model.verification
        assert verification.audited_positions >= 200, verification
        assert verification.audits >= 3 * (NEW_TOKENS // K), verification  # at least one audit per K new positions
        assert (verification.disagreements, verification.bans, verification.rollbacks) == (0, 0, 0), verification
        assert verification.unverified_blocks == 0, verification
        assert all(entry["verified"] for entry in model.blocks.describe_route())


def test_a_span_without_a_second_replica_is_unverified_and_never_waited_for(world):
    """One server for [2:4]: nothing can audit it. Generation goes on at once, equal to the honest
    run; the client reports blocks 2 and 3 unverified, [0:2] (3 replicas) verified."""
    servers = [*world.honest[LOW], world.honest[HIGH][0]]
    expected = world.greedy(PROMPT_SEED, NEW_TOKENS)
    with connect_over(world.swarm, servers, verify="audit", audit_every=K) as model:
        got = model.generate(prompt_of(PROMPT_SEED), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(got, expected)
        verification = model.verification
        assert verification.unverified_blocks == 2, verification
        assert verification.disagreements == 0 and verification.bans == 0, verification
        route = model.blocks.describe_route()
        assert [(e["start"], e["end"], e["verified"]) for e in route] == [(0, 2, True), (2, 4, False)]


def test_the_smallest_noise_claimed_is_above_the_fp32_tolerance():
    """The "noise-smallest" case is only a test of the claim if the tolerance is below it."""
    assert tolerance_for(torch.float32).relative < SMALLEST_FP32_NOISE
