"""Generation through a swarm of real block servers equals local transformers.

Each model gets one :class:`~shoal.launch.InProcessSwarm` of 4 servers (the handler, sessions and push
chain ``shoal serve`` runs, on an in-memory network), e.g. for 4 blocks ``[0:2] [2:4] [0:1] [1:2]``:
a client given ``[0:2], [2:4]`` routes over 2 servers, one given ``[0:1], [1:2], [2:4]`` over 3.
Models: random tiny ``llama`` (GQA), ``mistral`` (GQA, sliding window shorter than the generation)
and ``qwen2`` (GQA, q/k/v biases, sliding window on the upper layers) from :mod:`testkit.tiny`, whose
large init keeps greedy choices far from ties; ``qwen3`` (q/k norms, biases, head_dim apart from the
hidden size, per-layer sliding windows), and the mixtures of experts ``qwen3_moe`` and ``mixtral`` (4
experts, top-2, written in the Hub's per-expert layout; their seeds keep router choices 1e-2 from
ties); ``phi3`` (fused projections, rotary on half of each head, sliding window), ``falcon_alibi``
(alibi, multi-head, sequential, biases) and ``falcon_new_arch`` (grouped kv heads, ``ln_attn`` and
``ln_mlp``, rotary); ``olmo2`` (norms after attention and MLP, q/k norms) and ``granite`` (every
multiplier off 1), which have no adapter and go the generic path; ``gemma3`` (sliding and full layers,
a rotary per layer type, a window shorter than the prompt, scaled embeddings, final soft-capping;
real Gemma 3 weights: ``test_gemma3``); and the real SmolLM2-135M-Instruct
(fetched once with ``shoal models fetch smollm2``). One test runs the tiny llama through 2 ``shoal serve``
processes over iroh (:class:`~shoal.launch.LocalSwarm`): the CLI and the cross-process push chain.

The reference is ``AutoModelForCausalLM.from_pretrained(checkpoint)`` in fp32, one torch thread; its
outputs are computed once per model and shared by both routes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from shoal.checkpoints import load_config
from shoal.client import AutoDistributedModelForCausalLM
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm, LocalSwarm, even_spans
from shoal.launch.inprocess import LOOPBACK
from shoal.models import get_family
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.moe import min_router_margin
from tests.helpers.parity import assert_logits_close, greedy_with_gap, left_padded

pytestmark = pytest.mark.timeout(120)

MODEL_ORDER = (
    "llama",
    "mistral",
    "qwen2",
    "gemma3",
    "phi3",
    "falcon_alibi",
    "falcon_new_arch",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "olmo2",
    "granite",
    "smollm2",
)
HOPS = (2, 3)
# module-scoped parameters: pytest runs each model's tests together, with one swarm alive at a time
CASES = [pytest.param(name, hops, id=f"{name}-{hops}hops") for name in MODEL_ORDER for hops in HOPS]
# batch, sampling and session tests: every route for the tiny models, the 3-hop route for SmolLM2 (whose
# tokens cost ~0.1 s each here; the 2-hop route is covered by its greedy and logits tests)
FEATURE_CASES = [c for c in CASES if c.values[0] != "smollm2" or c.values[1] == 3]
TINY_SEEDS = {
    "llama": 0,
    "mistral": 1,
    "qwen2": 2,
    "gemma3": 15,
    "phi3": 25,
    "falcon_alibi": 23,
    "falcon_new_arch": 22,
    "qwen3": 7,
    "qwen3_moe": 28,
    "mixtral": 21,
    "olmo2": 30,
    "granite": 34,
}
MOE_MODELS = ("qwen3_moe", "mixtral")
ROUTER_MARGIN = 1e-2  # smallest gap between a token's k-th and (k+1)-th router logit in the reference's runs
MIN_GAP = 1e-3  # smallest top-2 logit gap of the reference's greedy runs: far above fp32 noise (~1e-5)
ATOL = 1e-4
COUNTED = (  # server counters whose change over a session the tests check
    "sessions_opened",
    "sessions_closed",
    "positions_processed",
    "steps",
    "forward_requests",
    "pushes_sent",
    "pushes_received",
    "pushes_failed",
    "pushes_rejected",
    "errors",
)
GREEDY = {"do_sample": False}
SAMPLING = [
    pytest.param({"temperature": 0.8}, id="temp"),
    pytest.param({"temperature": 1.3, "top_k": 20}, id="topk"),
    pytest.param({"temperature": 0.9, "top_p": 0.8}, id="topp"),
    pytest.param({"temperature": 0.7, "top_k": 40, "top_p": 0.95, "num_return_sequences": 2}, id="mixed-2seq"),
]
SMOLLM2_PROMPT = "Explain how rainbows form."  # its 64 greedy tokens hold no eos; min top-2 gap ~0.09
SMOLLM2_BATCH = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the sea, and say why sailors love it so much.",
]


def hop_chains(num_blocks: int) -> dict[int, list[BlockRange]]:
    """A 2-hop chain ``[0:h], [h:n]`` and a 3-hop chain ``[0:q], [q:h], [h:n]`` sharing the last server."""
    two = even_spans(num_blocks, 2)
    half = two[0].end
    quarter = max(1, half // 2)
    return {2: two, 3: [BlockRange(0, quarter), BlockRange(quarter, half), two[1]]}


@dataclass
class Case:
    """One model: its swarm, its local reference, prompts, and memoised reference outputs."""

    name: str
    swarm: InProcessSwarm
    chains: dict[int, list[BlockRange]]
    reference: Any
    tokenizer: Any
    prompt: torch.Tensor  # [1, P]
    batch: tuple[torch.Tensor, torch.Tensor]  # left-padded ids, attention mask: 3 rows of different lengths
    new_tokens: dict[str, int]  # per test kind, kept short for the real model where the spec allows
    clients: dict[int, Any] = field(default_factory=dict)
    memo: dict[Any, Any] = field(default_factory=dict)

    def expected(self, key, compute: Callable[[], Any]):
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def greedy64(self) -> tuple[torch.Tensor, float]:
        return self.expected("greedy64", lambda: greedy_with_gap(self.reference, self.prompt, max_new_tokens=64))

    def batch_greedy(self) -> tuple[torch.Tensor, float]:
        ids, mask = self.batch
        n = self.new_tokens["batch"]
        return self.expected(
            "batch", lambda: greedy_with_gap(self.reference, ids, attention_mask=mask, max_new_tokens=n)
        )

    def client(self, hops: int):
        if hops not in self.clients:
            model = self.swarm.connect(self.chains[hops])
            route = [s.blocks for s in model.blocks.chain]
            assert route == self.chains[hops], f"route {route} != {self.chains[hops]}"
            self.clients[hops] = model
        return self.clients[hops]


def _chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def build_case(name: str, model_dir: Path) -> Case:
    """The swarm, prompts and local reference of ``name``."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if name == "smollm2":
        prompt = tokenizer(_chat(tokenizer, SMOLLM2_PROMPT), return_tensors="pt").input_ids
        tokenizer.padding_side = "left"
        enc = tokenizer([_chat(tokenizer, q) for q in SMOLLM2_BATCH], return_tensors="pt", padding=True)
        batch = (enc.input_ids, enc.attention_mask)
        new_tokens = {"batch": 16, "sampling": 12}
    else:
        rng = torch.Generator().manual_seed(100 + TINY_SEEDS[name])
        prompt = torch.randint(3, 256, (1, 12), generator=rng)
        batch = left_padded([torch.randint(3, 256, (n,), generator=rng).tolist() for n in (5, 12, 9)])
        new_tokens = {"batch": 24, "sampling": 24}
    lengths = batch[1].sum(dim=1).tolist()
    assert len(set(lengths)) == 3 and bool(batch[1][:, -1].all()), (
        f"need 3 left-padded rows of distinct lengths: {lengths}"
    )
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    config = load_config(model_dir)
    chains = hop_chains(get_family(config).num_blocks(config))
    swarm = InProcessSwarm(model_dir, sorted({span for chain in chains.values() for span in chain}))
    return Case(name, swarm, chains, reference, tokenizer, prompt, batch, new_tokens)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each tiny model as a sharded checkpoint with a one-char-per-token tokenizer."""
    root = tmp_path_factory.mktemp("swarm-models")
    return {
        name: tiny_checkpoint(root / name, name, seed, tokenizer=char_tokenizer()) for name, seed in TINY_SEEDS.items()
    }


class Cases:
    """Keeps the case of one model at a time: tests run grouped by model (see conftest), so each
    model's swarm is built once and closed before the next model's is."""

    def __init__(self, tiny_dirs: dict[str, Path]):
        self.tiny_dirs = tiny_dirs
        self.current: Case | None = None

    def get(self, name: str, smollm2_dir: Callable[[], Path]) -> Case:
        if self.current is not None and self.current.name != name:
            self.close()
        if self.current is None:
            self.current = build_case(name, smollm2_dir() if name == "smollm2" else self.tiny_dirs[name])
        return self.current

    def close(self) -> None:
        case, self.current = self.current, None
        if case is not None:
            case.swarm.close()


@pytest.fixture(scope="module")
def cases(tiny_dirs):
    cases = Cases(tiny_dirs)
    yield cases
    cases.close()


@pytest.fixture
def case(cases: Cases, name: str, request) -> Case:
    return cases.get(name, lambda: request.getfixturevalue("smollm2_dir"))


@pytest.fixture
def model(case: Case, hops: int):
    return case.client(hops)


# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "hops"), CASES)
def test_greedy_64_tokens(case, model, hops):
    """64 greedy tokens through 2 / 3 servers equal local transformers, token for token."""
    assert len(model.blocks.chain) == hops
    expected, gap = case.greedy64()
    assert gap > MIN_GAP, f"reference greedy run has a near-tie (top-2 gap {gap:.2e}): choose other weights/prompt"
    assert expected.shape[1] == case.prompt.shape[1] + 64, "the reference stopped early: no 64-token run"
    got = model.generate(case.prompt, max_new_tokens=64, **GREEDY)
    assert got.shape == expected.shape
    mismatch = (got != expected).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at (row, col) {mismatch[0].tolist()}"


@pytest.mark.parametrize(("name", "hops"), CASES)
def test_forward_logits(case, model, hops, parity_findings):
    """Stateless forward logits (one prompt; a left-padded batch) within 1e-4 of local, fp32."""
    err, bitwise = assert_logits_close(model, case.reference, case.prompt, atol=ATOL)
    ids, mask = case.batch
    err_b, bitwise_b = assert_logits_close(model, case.reference, ids, atol=ATOL, attention_mask=mask)
    line = (
        f"{case.name} {hops} hops: forward logits max|diff| {err:.3g} (bitwise equal: {bitwise}); "
        f"left-padded batch {err_b:.3g} (bitwise equal: {bitwise_b})"
    )
    print(line)
    parity_findings.append(line)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_router_margins(case):
    """In every sparse layer, each token of the greedy run and of the padded batch run (pads aside)
    ranks its top-2 experts at least 1e-2 above the next in router logits: fp32 noise (~1e-5) cannot
    send a token to other experts, so the MoE models' equality tests are fair."""
    greedy64, _ = case.greedy64()
    batch_run, _ = case.batch_greedy()
    ids, mask = case.batch
    batch_mask = torch.cat([mask, torch.ones(mask.shape[0], batch_run.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    margins = (min_router_margin(case.reference, greedy64), min_router_margin(case.reference, batch_run, batch_mask))
    assert min(margins) >= ROUTER_MARGIN, f"router near-tie (margins {margins}): choose another seed"


@pytest.mark.parametrize(("name", "hops"), FEATURE_CASES)
def test_left_padded_batch(case, model):
    """3 prompts of different lengths, left-padded: batched greedy generation equals local."""
    ids, mask = case.batch
    expected, gap = case.batch_greedy()
    assert gap > MIN_GAP, f"reference batch run has a near-tie (top-2 gap {gap:.2e})"
    got = model.generate(ids, attention_mask=mask, max_new_tokens=case.new_tokens["batch"], **GREEDY)
    assert got.shape == expected.shape
    mismatch = (got != expected).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at (row, col) {mismatch[0].tolist()}"


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", SAMPLING)
@pytest.mark.parametrize(("name", "hops"), FEATURE_CASES)
def test_seeded_sampling(case, model, kwargs):
    """``torch.manual_seed`` before each call: sampled sequences equal local seeded sampling."""
    n = case.new_tokens["sampling"]
    args = {"max_new_tokens": n, "do_sample": True, **kwargs}

    def sample(m) -> torch.Tensor:
        torch.manual_seed(1234)
        return m.generate(case.prompt, **args)

    expected = case.expected(("sampling", tuple(sorted(kwargs.items()))), lambda: sample(case.reference))
    greedy64, _ = case.greedy64()
    p = case.prompt.shape[1]
    assert (expected[:, p:] != greedy64[:, p : p + n]).any(), "sampling equals greedy here: the RNG is not exercised"
    got = sample(model)
    assert got.shape == expected.shape
    assert torch.equal(got, expected), f"first mismatch at (row, col) {(got != expected).nonzero()[0].tolist()}"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "hops"), FEATURE_CASES)
def test_two_generates_in_one_session(case, model, hops):
    """32 + 32 tokens in one ``inference_session`` equal 64 at once; each server on the route opened
    exactly one session for it and processed len(prompt) + 63 positions in 64 steps (no prefix
    recomputed), and every step went server to server by push: each server but the last pushed all
    64 on, each but the first received all 64 that way, none failed or was rejected."""
    expected, _ = case.greedy64()
    p = case.prompt.shape[1]
    before = model.blocks.server_infos()
    with model.inference_session(max_length=p + 64) as session:
        first = model.generate(case.prompt, max_new_tokens=32, **GREEDY)
        # a generated pad id (0) must not be masked: the reference is one run that never masks it
        second = model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=32, **GREEDY)
        assert session.position == p + 63
    after = model.blocks.server_infos()
    assert torch.equal(second, expected)
    assert [i.span.blocks for i in after] == case.chains[hops]
    steps = 2 * 32  # a prefill and 31 decode steps per generate
    for k, (old, new) in enumerate(zip(before, after, strict=True)):
        delta = {key: getattr(new.counters, key) - getattr(old.counters, key) for key in COUNTED}
        first_hop, last_hop = k == 0, k == hops - 1
        assert delta == {
            "sessions_opened": 1,
            "sessions_closed": 1,
            "positions_processed": p + 63,
            "steps": steps,
            "forward_requests": 0,
            "pushes_sent": 0 if last_hop else steps,
            "pushes_received": 0 if first_hop else steps,
            "pushes_failed": 0,
            "pushes_rejected": 0,
            "errors": 0,
        }, f"server {new.span.blocks} counter deltas {delta}"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "hops"), [pytest.param("llama", 2, id="llama-2hops")])
def test_greedy_through_shoal_serve_processes(case, hops):
    """The same 64 greedy tokens through 2 ``shoal serve`` processes over iroh on loopback: the CLI
    loads its span, prints its ticket, serves it, and the first server pushes every step to the
    second across the process boundary."""
    expected, _ = case.greedy64()
    spans = [(span.start, span.end) for span in case.chains[hops]]  # serve_args takes tuples only, for now
    with LocalSwarm(case.swarm.model_dir, spans, extra_args=["--num-threads", "1"]) as servers:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(case.swarm.model_dir), initial_peers=servers.tickets, transport=LOOPBACK
        )
        try:
            assert [s.blocks for s in model.blocks.chain] == case.chains[hops]
            assert torch.equal(model.generate(case.prompt, max_new_tokens=64, **GREEDY), expected)
            counters = [info.counters for info in model.blocks.server_infos()]
        finally:
            model.close()
    assert [(c.steps, c.pushes_sent, c.pushes_received, c.pushes_failed) for c in counters] == [
        (64, 64, 0, 0),
        (64, 0, 64, 0),
    ]


# --- SmolLM2 with its tokenizer: eos, stop strings, repetition penalty, streamer ------------------

SMOLLM2 = [pytest.param("smollm2", 3, id="smollm2-3hops")]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "hops"), SMOLLM2)
def test_smollm2_eos(case, model):
    """The model's own eos (<|im_end|>) ends a short answer where local transformers does; and with
    ``eos_token_id`` set to a token of the 64-token greedy run, generation stops at its first
    occurrence, exactly where the local run (a prefix of the local greedy run) stops."""
    tok = case.tokenizer
    short = tok(_chat(tok, "What is the capital of France?"), return_tensors="pt").input_ids
    expected = case.expected("eos", lambda: case.reference.generate(short, max_new_tokens=32, **GREEDY))
    assert expected[0, -1] == tok.eos_token_id and expected.shape[1] < short.shape[1] + 32
    assert torch.equal(model.generate(short, max_new_tokens=32, **GREEDY), expected)

    greedy64, _ = case.greedy64()
    p = case.prompt.shape[1]
    eos = int(greedy64[0, p + 9])
    forced = model.generate(case.prompt, max_new_tokens=64, eos_token_id=eos, **GREEDY)
    first = int((greedy64[0, p:] == eos).nonzero()[0])  # the reference would stop there
    assert torch.equal(forced, greedy64[:, : p + first + 1])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "hops"), SMOLLM2)
def test_smollm2_stop_strings(case, model):
    """``stop_strings`` (matched on the SmolLM2 tokenizer's text) stop where they stop locally."""
    stop = "optics"
    greedy64, _ = case.greedy64()
    p = case.prompt.shape[1]
    assert stop in case.tokenizer.decode(greedy64[0, p:]), "the reference text changed: pick another stop string"
    args = {"max_new_tokens": 64, "stop_strings": [stop], "tokenizer": case.tokenizer, **GREEDY}
    expected = case.expected("stop", lambda: case.reference.generate(case.prompt, **args))
    assert expected.shape[1] < p + 64 and case.tokenizer.decode(expected[0, p:]).endswith(stop)
    assert torch.equal(model.generate(case.prompt, **args), expected)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "hops"), SMOLLM2)
def test_smollm2_repetition_penalty(case, model):
    args = {"max_new_tokens": 24, "repetition_penalty": 1.3, **GREEDY}
    expected = case.expected("penalty", lambda: case.reference.generate(case.prompt, **args))
    greedy64, _ = case.greedy64()
    assert not torch.equal(expected, greedy64[:, : expected.shape[1]]), "the penalty changed nothing: test is void"
    assert torch.equal(model.generate(case.prompt, **args), expected)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "hops"), SMOLLM2)
def test_smollm2_text_streamer(case, model, capsys):
    """A ``TextStreamer`` prints the same text through the swarm as locally."""
    printed = []
    for m in (case.reference, model):
        capsys.readouterr()
        out = m.generate(
            case.prompt, max_new_tokens=20, streamer=TextStreamer(case.tokenizer, skip_prompt=True), **GREEDY
        )
        printed.append(capsys.readouterr().out)
        assert printed[-1].strip() == case.tokenizer.decode(out[0, case.prompt.shape[1] :]).strip()
    assert printed[0] and printed[0] == printed[1]
