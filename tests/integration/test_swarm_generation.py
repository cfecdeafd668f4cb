"""Generation through a real swarm (``shoal serve`` processes on loopback) equals local transformers.

Each model gets one swarm of 4 servers, e.g. for 4 blocks ``[0:2] [2:4] [0:1] [1:2]``: a client given
``[0:2], [2:4]`` routes over 2 servers, one given ``[0:1], [1:2], [2:4]`` over 3. Models: random tiny
``llama`` (GQA), ``mistral`` (GQA, sliding window shorter than the generation) and ``qwen2`` (GQA,
q/k/v biases, sliding window on the upper layers), initialised so greedy choices are far from ties;
and the real SmolLM2-135M-Instruct (fetched once with ``shoal models fetch smollm2``).

The reference is ``AutoModelForCausalLM.from_pretrained(checkpoint)`` in fp32, one torch thread; its
outputs are computed once per model and shared by both routes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from shoal.checkpoints import fetch_model, is_fetched, load_config
from shoal.models import get_family
from tests.helpers.parity import assert_logits_close, char_tokenizer, greedy_with_gap, left_padded, tiny_causal_lm
from tests.helpers.swarm import Span, Swarm, start_swarm, two_and_three_hop_spans, write_checkpoint

pytestmark = pytest.mark.timeout(300)

MODEL_ORDER = ("llama", "mistral", "qwen2", "smollm2")
HOPS = (2, 3)
CASES = [pytest.param(name, hops, id=f"{name}-{hops}hops") for name in MODEL_ORDER for hops in HOPS]
# batch, sampling and session tests: every route for the tiny models, the 3-hop route for SmolLM2 (whose
# tokens cost ~0.1 s each here; the 2-hop route is covered by its greedy and logits tests)
FEATURE_CASES = [c for c in CASES if c.values[0] != "smollm2" or c.values[1] == 3]
TINY_SEEDS = {"llama": 0, "mistral": 1, "qwen2": 2}
MIN_GAP = 1e-3  # smallest top-2 logit gap of the reference's greedy runs: far above fp32 noise (~1e-5)
ATOL = 1e-4
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


@dataclass
class Case:
    """One model: its swarm, its local reference, prompts, and memoised reference outputs."""

    name: str
    swarm: Swarm
    chains: dict[int, list[Span]]
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

    def client(self, hops: int):
        if hops not in self.clients:
            model = self.swarm.connect(self.chains[hops])
            route = [(s.start, s.end) for s in model.blocks.chain]
            assert route == self.chains[hops], f"route {route} != {self.chains[hops]}"
            self.clients[hops] = model
        return self.clients[hops]

    def close(self) -> None:
        self.clients.clear()
        self.swarm.close(graceful=False)  # SIGKILL: nothing to flush, and graceful exits cost seconds


def _chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def tiny_checkpoint(name: str, workdir: Path) -> Path:
    """The random tiny ``name`` model as a sharded checkpoint, with a one-char-per-token tokenizer."""
    path = workdir / name
    if not (path / "config.json").is_file():
        write_checkpoint(tiny_causal_lm(name, seed=TINY_SEEDS[name]), path, tokenizer=char_tokenizer())
    return path


def hop_chains(model_dir: Path) -> dict[int, list[Span]]:
    config = load_config(model_dir)
    two, three = two_and_three_hop_spans(get_family(config).num_blocks(config))
    return {2: two, 3: three}


def build_case(name: str, model_dir: Path, swarm: Swarm) -> Case:
    """Prompts and the local reference for ``name``, over its running ``swarm``."""
    if name == "smollm2":
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        prompt = tokenizer(_chat(tokenizer, SMOLLM2_PROMPT), return_tensors="pt").input_ids
        tokenizer.padding_side = "left"
        enc = tokenizer([_chat(tokenizer, q) for q in SMOLLM2_BATCH], return_tensors="pt", padding=True)
        batch = (enc.input_ids, enc.attention_mask)
        new_tokens = {"batch": 16, "sampling": 12}
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        rng = torch.Generator().manual_seed(100 + TINY_SEEDS[name])
        prompt = torch.randint(3, 256, (1, 12), generator=rng)
        batch = left_padded([torch.randint(3, 256, (n,), generator=rng).tolist() for n in (5, 12, 9)])
        new_tokens = {"batch": 24, "sampling": 24}
    lengths = batch[1].sum(dim=1).tolist()
    assert len(set(lengths)) == 3 and bool(batch[1][:, -1].all()), (
        f"need 3 left-padded rows of distinct lengths: {lengths}"
    )
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return Case(name, swarm, hop_chains(model_dir), reference, tokenizer, prompt, batch, new_tokens)


class CasePool:
    """Keeps the swarm of one model at a time (tests run grouped by model; see conftest), and starts
    the next model's swarm in the background while the current model's tests run."""

    def __init__(self, workdir: Path, order: list[str]):
        self.workdir = workdir
        self.order = order
        self.current: Case | None = None
        self._starting: dict[str, Future[Swarm]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarm-start")

    def _model_dir(self, name: str) -> Path | None:
        """Checkpoint of ``name``; None for a SmolLM2 not fetched (its tests fail via ``smollm2_dir``)."""
        if name == "smollm2":
            return fetch_model("smollm2", progress=False) if is_fetched("smollm2") else None
        return tiny_checkpoint(name, self.workdir)  # in this thread: it seeds torch's global RNG

    def _start(self, name: str, model_dir: Path) -> None:
        if name not in self._starting:
            spans = sorted({span for chain in hop_chains(model_dir).values() for span in chain})
            self._starting[name] = self._executor.submit(start_swarm, model_dir, spans)

    def get(self, name: str, smollm2_dir: Callable[[], Path]) -> Case:
        if self.current is not None and self.current.name != name:
            case, self.current = self.current, None
            case.close()
        if self.current is None:
            model_dir = smollm2_dir() if name == "smollm2" else self._model_dir(name)
            self._start(name, model_dir)
            swarm = self._starting.pop(name).result()
            later = self.order[self.order.index(name) + 1 :] if name in self.order else []
            next_dir = self._model_dir(later[0]) if later else None
            if next_dir is not None:
                self._start(later[0], next_dir)
            try:
                self.current = build_case(name, model_dir, swarm)
            except BaseException:
                swarm.close(graceful=False)
                raise
        return self.current

    def close(self) -> None:
        case, self.current = self.current, None
        if case is not None:
            case.close()
        for future in self._starting.values():
            try:
                future.result().close(graceful=False)
            except Exception:  # it failed to start: start_swarm stopped its servers
                pass
        self._starting.clear()
        self._executor.shutdown(wait=True)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, model_order):
    pool = CasePool(tmp_path_factory.mktemp("swarm-models"), [n for n in model_order if n in MODEL_ORDER])
    yield pool
    pool.close()


@pytest.fixture
def case(pool: CasePool, name: str, request) -> Case:
    return pool.get(name, lambda: request.getfixturevalue("smollm2_dir"))


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


@pytest.mark.parametrize(("name", "hops"), FEATURE_CASES)
def test_left_padded_batch(case, model):
    """3 prompts of different lengths, left-padded: batched greedy generation equals local."""
    ids, mask = case.batch
    n = case.new_tokens["batch"]
    expected, gap = case.expected(
        "batch", lambda: greedy_with_gap(case.reference, ids, attention_mask=mask, max_new_tokens=n)
    )
    assert gap > MIN_GAP, f"reference batch run has a near-tie (top-2 gap {gap:.2e})"
    got = model.generate(ids, attention_mask=mask, max_new_tokens=n, **GREEDY)
    assert got.shape == expected.shape
    mismatch = (got != expected).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at (row, col) {mismatch[0].tolist()}"


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


@pytest.mark.parametrize(("name", "hops"), FEATURE_CASES)
def test_two_generates_in_one_session(case, model, hops):
    """32 + 32 tokens in one ``inference_session`` equal 64 at once; each server on the route opened
    exactly one session for it and processed len(prompt) + 63 positions (no prefix recomputed)."""
    expected, _ = case.greedy64()
    p = case.prompt.shape[1]
    before = model.blocks.server_infos()
    with model.inference_session(max_length=p + 64) as session:
        first = model.generate(case.prompt, max_new_tokens=32, **GREEDY)
        second = model.generate(first, max_new_tokens=32, **GREEDY)
        assert session.position == p + 63
    after = model.blocks.server_infos()
    assert torch.equal(second, expected)
    assert [(i["start"], i["end"]) for i in after] == case.chains[hops]
    keys = ("sessions_opened", "sessions_closed", "positions_processed", "forward_requests", "steps")
    for old, new in zip(before, after, strict=True):
        delta = {key: new["counters"][key] - old["counters"][key] for key in keys}
        where = f"server [{new['start']}:{new['end']}) counter deltas {delta}"
        assert delta["sessions_opened"] == 1, where
        assert delta["sessions_closed"] == 1, where
        assert delta["positions_processed"] == p + 63, where
        assert delta["forward_requests"] == 0, where


# --- SmolLM2 with its tokenizer: eos, stop strings, repetition penalty, streamer ------------------

SMOLLM2 = [pytest.param("smollm2", 3, id="smollm2-3hops")]


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


@pytest.mark.parametrize(("name", "hops"), SMOLLM2)
def test_smollm2_repetition_penalty(case, model):
    args = {"max_new_tokens": 24, "repetition_penalty": 1.3, **GREEDY}
    expected = case.expected("penalty", lambda: case.reference.generate(case.prompt, **args))
    greedy64, _ = case.greedy64()
    assert not torch.equal(expected, greedy64[:, : expected.shape[1]]), "the penalty changed nothing: test is void"
    assert torch.equal(model.generate(case.prompt, **args), expected)


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
