"""Speculative decoding through a swarm: transformers drafts and verifies, the servers roll back.

* Greedy: a draft model (the target's own weights, every block perturbed by 2% noise, so it agrees
  often but not always) and prompt lookup give, through 2 and through 3 servers, exactly the tokens of
  plain local greedy generation; every route server processes each position once (the prompt, then
  per round the last token and the drafts: ``prompt - 1 + rounds + drafted``), overwrites exactly the
  rejected drafts of every round but the last, and servers off the route do nothing. Two tiny models:
  a llama (GQA; its random weights ignore repeated n-grams, so prompt lookup drafts are mostly
  rejected) and a mistral whose sliding window of 3 makes its continuation of a repeated stretch of
  the prompt repeat too (prompt lookup drafts are mostly accepted; the server's sliding cache rolls back).
* Sampling: the first two tokens sampled with a draft model through 2 servers follow the target's
  exact distribution (chi-square over the 64 cells of a vocabulary of 8), and drafts are accepted as
  often as the speculative-sampling rule says; a rule that accepts every draft fails the same test.
* Failover: a route server killed after a round's drafting, before its verification, is replaced
  (one recovery, replayed exactly the accepted prefix) and the tokens do not change.

The references are ``AutoModelForCausalLM.from_pretrained(checkpoint)`` in fp32, one torch thread.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers.generation.utils as generation_utils
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from shoal.client.generation import speculation
from shoal.client.generation.speculation import PlannedDrafts, SpeculationStats
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from testkit.faulty import perturbed_copy
from testkit.tiny import tiny_checkpoint, tiny_model
from tests.helpers.parity import greedy_with_gap

pytestmark = pytest.mark.timeout(120)

NEW_TOKENS = 64
WINDOW = 4  # draft tokens per round (a constant schedule: the planner's timing-based choice is not tested here)
DRAFT_NOISE = 0.02  # relative noise on every block tensor of the draft: ~55% of its greedy tokens agree
MIN_GAP = 1e-3  # smallest top-2 logit gap of the references' greedy runs: far above fp32 noise (~1e-5)
A, B = BlockRange(0, 2), BlockRange(2, 4)
CHAINS = {2: [A, B], 3: [BlockRange(0, 1), BlockRange(1, 2), B]}


def repeated(stretch: list[int], continuation: list[int]) -> list[int]:
    """``stretch``, the model's greedy ``continuation`` of it, and ``stretch`` again."""
    return [*stretch, *continuation, *stretch]


#: Per model: checkpoint seed, tiny_config overrides, and three prompts with repeated n-grams. The
#: mistral prompts are ``S + its 12 greedy tokens after S + S`` (|S| = 10 > its receptive field of 9).
MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "seed": 3,
        "overrides": {},
        "prompts": [
            [42, 238, 148, 144, 98, 217, 10, 42, 238, 148, 144, 42, 238],
            [62, 202, 236, 187, 240, 20, 210, 62, 202, 236, 187, 62, 202],
            [121, 95, 254, 232, 233, 96, 130, 121, 95, 254, 232, 121, 95],
        ],
    },
    "mistral": {
        "seed": 1,
        "overrides": {"sliding_window": 3},
        "prompts": [
            repeated(
                [86, 171, 181, 95, 179, 242, 234, 104, 167, 193],
                [248, 250, 237, 201, 109, 151, 68, 99, 5, 33, 104, 111],
            ),
            repeated(
                [220, 61, 11, 200, 19, 242, 3, 61, 134, 112], [26, 13, 152, 191, 146, 32, 21, 68, 138, 54, 214, 203]
            ),
            repeated(
                [41, 116, 111, 227, 250, 216, 165, 192, 15, 6], [68, 219, 75, 198, 67, 164, 253, 115, 86, 162, 41, 152]
            ),
        ],
    },
}
DRAFTERS = ("draft", "lookup")
GREEDY_CASES = [
    pytest.param(name, hops, drafter, i, id=f"{name}-{hops}hops-{drafter}-prompt{i}")
    for name in MODELS
    for hops in CHAINS
    for drafter in DRAFTERS
    for i in range(3)
]


def draft_of(reference: PreTrainedModel, noise: float = DRAFT_NOISE, window: int = WINDOW) -> PreTrainedModel:
    """The reference with every block's tensors perturbed (``noise`` relative), drafting ``window``
    tokens every round."""
    draft = copy.deepcopy(reference)
    draft.model.layers = perturbed_copy(draft.model.layers, noise, seed=1)
    draft.generation_config.num_assistant_tokens = window
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return draft


def drafting(drafter: str, draft: PreTrainedModel) -> dict[str, Any]:
    """``generate`` arguments for ``drafter``."""
    return {"assistant_model": draft} if drafter == "draft" else {"prompt_lookup_num_tokens": WINDOW}


@dataclass
class Served:
    """One model: its swarm of ``[0:2] [2:4] [0:1] [1:2]``, local reference and draft, clients per route."""

    name: str
    swarm: InProcessSwarm
    reference: PreTrainedModel
    draft: PreTrainedModel
    prompts: list[Tensor]
    clients: dict[int, Any] = field(default_factory=dict)
    memo: dict[int, tuple[Tensor, float]] = field(default_factory=dict)

    def client(self, hops: int):
        if hops not in self.clients:
            model = self.swarm.connect(CHAINS[hops])
            assert [s.blocks for s in model.blocks.chain] == CHAINS[hops]
            self.clients[hops] = model
        return self.clients[hops]

    def expected(self, i: int) -> tuple[Tensor, float]:
        if i not in self.memo:
            self.memo[i] = greedy_with_gap(self.reference, self.prompts[i], max_new_tokens=NEW_TOKENS)
        return self.memo[i]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[dict[str, Served]]:
    out: dict[str, Served] = {}
    try:
        for name, spec in MODELS.items():
            path = tiny_checkpoint(tmp_path_factory.mktemp(f"spec-{name}"), name, spec["seed"], **spec["overrides"])
            reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            swarm = InProcessSwarm(path, sorted({span for chain in CHAINS.values() for span in chain}))
            prompts = [torch.tensor([p]) for p in spec["prompts"]]
            out[name] = Served(name, swarm, reference, draft_of(reference), prompts)
        yield out
    finally:
        for case in out.values():
            case.swarm.close()


def snapshot(swarm: InProcessSwarm) -> list[tuple[int, int]]:
    """(positions processed, positions rolled back) of every server, in ``swarm.servers`` order."""
    return [(s.server.counters.positions_processed, s.server.counters.positions_rolled_back) for s in swarm.servers]


@pytest.mark.parametrize(("name", "hops", "drafter", "prompt"), GREEDY_CASES)
def test_greedy_speculation_equals_local_greedy(served, name, hops, drafter, prompt, parity_findings):
    """64 tokens with a draft model / prompt lookup through 2 / 3 servers equal local greedy; the
    counters show no prefix recomputed and exactly the rejected drafts overwritten."""
    case = served[name]
    model = case.client(hops)
    ids = case.prompts[prompt]
    expected, gap = case.expected(prompt)
    assert gap > MIN_GAP, f"reference greedy run has a near-tie (top-2 gap {gap:.2e}): choose another prompt"
    before = snapshot(case.swarm)
    got = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **drafting(drafter, case.draft))
    after = snapshot(case.swarm)
    assert got.shape == expected.shape
    mismatch = (got != expected).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at (row, col) {mismatch[0].tolist()}"

    stats: SpeculationStats = model.last_speculation
    rounds = stats.rounds
    assert len(rounds) + stats.accepted == NEW_TOKENS, "each round yields its accepted drafts and one more token"
    if drafter == "draft":
        assert all(r.window == WINDOW for r in rounds)
        assert all(
            r.drafted == min(WINDOW, NEW_TOKENS - 1 - k) for r, k in zip(rounds, _new_before(rounds), strict=True)
        )
        assert 0 < stats.accepted < stats.drafted, f"acceptance {stats.acceptance:.2f}: the case needs rejections"
    processed = ids.shape[1] - 1 + len(rounds) + stats.drafted
    rolled_back = sum(r.drafted - r.accepted for r in rounds[:-1])  # the last round's rejects are never overwritten
    if drafter == "draft":
        assert rolled_back > 0, "no rejected draft was overwritten: the rollback counters go untested"
    on_route = {s.blocks for s in model.blocks.chain}
    for server, (old, new) in zip(case.swarm.servers, zip(before, after, strict=True), strict=True):
        delta = (new[0] - old[0], new[1] - old[1])
        want = (processed, rolled_back) if server.blocks in on_route else (0, 0)
        assert delta == want, f"server {server.blocks}: (processed, rolled back) grew by {delta}, expected {want}"
    line = (
        f"{name} {hops} hops {drafter} prompt {prompt}: {len(rounds)} rounds, acceptance {stats.acceptance:.2f} "
        f"({stats.accepted}/{stats.drafted}), {rolled_back} positions rolled back per server"
    )
    print(line)
    parity_findings.append(line)


def _new_before(rounds) -> list[int]:
    """Tokens generated before each round."""
    out, total = [], 0
    for r in rounds:
        out.append(total)
        total += r.accepted + 1
    return out


# ---- sampling ------------------------------------------------------------------------------------

VOCAB = 8
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
}
SAMPLING_PROMPT = torch.tensor([[1, 5, 3, 6, 2]])
#: No warper: temperature 1, no top-k (transformers' default is 50), no top-p; the draft's scores
#: are then its plain softmax too.
SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 2}
DRAWS = 4000
WRONG_DRAWS = 400
MIN_EXPECTED = 5.0  # chi-square cells expecting fewer draws are pooled


def chi_square_p(observed: Tensor, expected: Tensor) -> tuple[float, int]:
    """Pearson's chi-square test of ``observed`` counts against ``expected`` counts (same total),
    cells expecting fewer than :data:`MIN_EXPECTED` pooled into one: (p-value, cells tested)."""
    obs, exp = observed.flatten().double(), expected.flatten().double()
    order = exp.argsort()
    pooled = int((exp < MIN_EXPECTED).sum())
    while 0 < pooled < len(order) and float(exp[order[:pooled]].sum()) < MIN_EXPECTED:
        pooled += 1  # the pool itself must expect enough
    if pooled > 1:
        head = order[:pooled]
        obs = torch.cat([obs[head].sum().view(1), obs[order[pooled:]]])
        exp = torch.cat([exp[head].sum().view(1), exp[order[pooled:]]])
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(exp) - 1
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2)  # chi2 survival function
    return float(p), len(exp)


@dataclass
class Sampling:
    swarm: InProcessSwarm
    model: Any
    draft: PreTrainedModel
    joint: Tensor  # [VOCAB, VOCAB]: the target's P(t1, t2 | prompt)
    first_draft: Tensor  # [VOCAB]: the draft's q(t1 | prompt)
    first_target: Tensor  # [VOCAB]: the target's p(t1 | prompt)


@pytest.fixture(scope="module")
def sampling(tmp_path_factory) -> Iterator[Sampling]:
    path = tiny_checkpoint(tmp_path_factory.mktemp("spec-vocab8"), "llama", 11, **SMALL)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    draft = tiny_model("llama", seed=12, **{**SMALL, "num_hidden_layers": 1})
    draft.generation_config.num_assistant_tokens = 2
    draft.generation_config.num_assistant_tokens_schedule = "constant"  # every round drafts
    with torch.no_grad():
        first = reference(SAMPLING_PROMPT).logits[0, -1].double().softmax(-1)
        q = draft(SAMPLING_PROMPT).logits[0, -1].double().softmax(-1)
        extended = torch.cat([SAMPLING_PROMPT.expand(VOCAB, -1), torch.arange(VOCAB).view(-1, 1)], dim=1)
        second = reference(extended).logits[:, -1].double().softmax(-1)
    with InProcessSwarm(path, [BlockRange(0, 1), BlockRange(1, 2)]) as swarm:
        yield Sampling(swarm, swarm.connect(), draft, first[:, None] * second, q, first)


def draw(case: Sampling, n: int, seed: int) -> tuple[Tensor, int, int]:
    """``n`` seeded generations of 2 tokens with the draft: counts over (t1, t2), drafts, accepted."""
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    drafted = accepted = 0
    torch.manual_seed(seed)
    p = SAMPLING_PROMPT.shape[1]
    for _ in range(n):
        out = case.model.generate(SAMPLING_PROMPT, assistant_model=case.draft, **SAMPLING)
        counts[out[0, p], out[0, p + 1]] += 1
        stats = case.model.last_speculation
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    return counts, drafted, accepted


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_speculative_sampling_keeps_the_target_distribution(sampling, parity_findings):
    """4000 draws of (t1, t2) with a draft model through 2 servers: chi-square against the target's
    exact distribution gives p > 1e-3; the first draft is accepted as often as the rule says
    (sum over t of min(p(t), q(t)), within 5 standard deviations)."""
    tv = float((sampling.first_target - sampling.first_draft).abs().sum() / 2)
    assert tv > 0.3, f"the draft's first-token distribution is too close to the target's (TV {tv:.2f})"
    started = time.perf_counter()
    counts, drafted, accepted = draw(sampling, DRAWS, seed=2026)
    seconds = time.perf_counter() - started
    assert int(counts.sum()) == DRAWS
    p, cells = chi_square_p(counts, sampling.joint * DRAWS)
    # with 2 new tokens, the first round drafts 1 token; a second round (after a rejection) has none to draft
    assert drafted == DRAWS, f"{drafted} drafts in {DRAWS} draws: speculation did not run every time"
    rate = float(torch.minimum(sampling.first_target, sampling.first_draft).sum())
    sigma = (rate * (1 - rate) / DRAWS) ** 0.5
    line = (
        f"speculative sampling: {DRAWS} draws in {seconds:.1f} s, chi-square p {p:.3g} over {cells} cells, "
        f"acceptance {accepted / drafted:.3f} (rule: {rate:.3f})"
    )
    print(line)
    parity_findings.append(line)
    assert p > 1e-3, line
    assert abs(accepted / drafted - rate) < 5 * sigma, line


def accept_every_draft(candidate_input_ids, candidate_logits, candidate_length, new_logits, *args, **kwargs):
    """A wrong rule: keep every draft, then sample the target's next token after them (transformers
    5.17 passes one more argument, ``is_done_candidate``, by position)."""
    drafts = candidate_input_ids[:, -candidate_length:]
    bonus = torch.multinomial(new_logits[:, candidate_length].softmax(dim=-1), num_samples=1)
    return torch.cat([drafts, bonus], dim=1), torch.tensor(candidate_length)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_wrong_acceptance_rule_fails_the_same_test(sampling, monkeypatch):
    """Accepting every draft samples t1 from the draft: the same chi-square test rejects it (p < 1e-6)."""
    monkeypatch.setattr(generation_utils, "_speculative_sampling", accept_every_draft)
    counts, drafted, accepted = draw(sampling, WRONG_DRAWS, seed=7)
    assert drafted == accepted == WRONG_DRAWS
    p, _ = chi_square_p(counts, sampling.joint * WRONG_DRAWS)
    assert p < 1e-6, f"chi-square p {p:.3g}: the test cannot tell the wrong rule from the right one"


# ---- failover ------------------------------------------------------------------------------------


@pytest.fixture
def replicated(served) -> Iterator[tuple[InProcessSwarm, Served]]:
    """Two servers for each of ``[0:2]`` and ``[2:4]`` of the llama checkpoint."""
    case = served["llama"]
    with InProcessSwarm(case.swarm.model_dir, [A, A, B, B]) as swarm:
        yield swarm, case


@pytest.mark.parametrize("victim", [A, B], ids=["first-hop", "second-hop"])
def test_a_server_killed_before_a_verification_is_replaced(replicated, victim, monkeypatch):
    """The route server of ``victim`` is killed in the third round, after drafting and before that
    round's verification: one recovery, whose replacement is replayed exactly the positions the
    session held (accepted tokens only, no rejected draft), and the 64 tokens equal local greedy."""
    swarm, case = replicated
    ids = case.prompts[0]
    expected, _ = case.expected(0)
    model = swarm.connect(refresh_period=0)
    killed: dict[str, Any] = {}
    original = PlannedDrafts.get_candidates

    def get_candidates(self, input_ids, **kwargs):
        out = original(self, input_ids, **kwargs)
        if len(self.stats.rounds) == 2 and not killed:  # the third round has drafted; its step comes next
            peer = next(span.peer_id for span in session.chain if span.blocks == victim)
            killed["server"] = swarm.kill(next(s for s in swarm.servers if s.node.id == peer))
            killed["position"] = session.position
        return out

    monkeypatch.setattr(PlannedDrafts, "get_candidates", get_candidates)
    with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS + 1) as cache:
        session = cache.session
        route = [span.peer_id for span in session.chain]
        got = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=case.draft)
        new_route = [span.peer_id for span in session.chain]
    stats = model.last_speculation
    assert torch.equal(got, expected), f"first mismatch at {(got != expected).nonzero()[0].tolist()}"
    assert "server" in killed, "the kill never ran"
    assert any(r.drafted > r.accepted for r in stats.rounds[:2]), "no rejected draft before the kill"
    first, second = stats.rounds[:2]
    assert killed["position"] == ids.shape[1] + first.accepted + second.accepted + 1  # prompt + 2 rounds' tokens - 1
    (recovery,) = session.recoveries
    assert recovery.failed == killed["server"].node.id and not recovery.drain
    (spare,) = set(new_route) - set(route)
    assert dict(recovery.replayed) == {spare: killed["position"]}, recovery


# ---- regressions ----


def scripted_windows(monkeypatch, windows: list[int]) -> None:
    """Every planner chooses ``windows`` in turn, then the last one for ever."""
    script = iter(windows)
    last = windows[-1]
    monkeypatch.setattr(speculation.WindowPlanner, "choose", lambda self: next(script, last))


def test_a_planner_that_skips_the_first_round_of_a_draft_model(served, monkeypatch):
    """A planner that asks for no drafts in a call's first round (it carries over from an earlier
    call and found drafting too dear), then for 2: the round drafts nothing, and the draft model's
    first run (its prefill, a round later, with mask and positions sized by generate afresh) gives
    the tokens of local greedy."""
    case = served["llama"]
    expected, _ = case.expected(0)
    scripted_windows(monkeypatch, [0, 2])
    model = case.client(2)
    got = model.generate(case.prompts[0], max_new_tokens=16, do_sample=False, assistant_model=case.draft)
    assert torch.equal(got, expected[:, : got.shape[1]])
    stats = model.last_speculation
    assert stats.rounds[0].drafted == 0 and stats.rounds[1].drafted == 2 and stats.failures == 0


def test_assisted_decoding_twice_in_one_inference_session(served):
    """Two calls with the same prompt in one session: the second rolls back to the prompt, sends only
    what the session does not hold, and gives the same tokens."""
    case = served["llama"]
    model, ids = case.client(2), case.prompts[0]
    expected, _ = case.expected(0)
    with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS + WINDOW):
        first = model.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=case.draft)
        before = snapshot(case.swarm)
        second = model.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=case.draft)
        after = snapshot(case.swarm)
    assert torch.equal(first, expected[:, : ids.shape[1] + 16])
    assert torch.equal(second, first)
    stats = model.last_speculation
    # per round its first token (the prompt's last one: the session holds the rest) and its drafts
    sent = len(stats.rounds) + stats.drafted
    on_route = {s.blocks for s in model.blocks.chain}
    processed = [new[0] - old[0] for server, old, new in zip(case.swarm.servers, before, after, strict=True)]
    assert processed == [sent if s.blocks in on_route else 0 for s in case.swarm.servers]


def test_prompt_lookup_drafts_stay_within_the_session(served, monkeypatch):
    """Prompt lookup with its full window near the end of a generation: the session generate opens
    (max_length positions) holds every verification step (transformers' lookup caps its drafts by
    the sequence so far, not by max_length: shoal caps the window)."""
    case = served["mistral"]
    scripted_windows(monkeypatch, [WINDOW])
    expected, _ = case.expected(0)
    got = case.client(2).generate(case.prompts[0], max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=WINDOW)
    assert torch.equal(got, expected[:, : got.shape[1]])
