"""Speculative decoding behind the OpenAI API (``shoal api MODEL --draft DRAFT | --prompt-lookup N``):
greedy answers are exactly the tokens plain decoding gives, ``usage`` carries what speculation did,
and the gateway's ``/metrics`` counters grow by exactly those numbers.

The tiny chat model of :mod:`tests.gateway.support` served by an :class:`~shoal.launch.InProcessSwarm`
(two servers, in-memory network); each gateway is :func:`shoal.gateway.app.build_app` over an
:class:`~shoal.gateway.engine.Engine` of that swarm's client, served by uvicorn in a thread. Drafts:
prompt lookup; a draft model equal to the target (every draft token is accepted); a different tiny
llama (most are rejected); and one with another tokenizer (transformers maps between the two).
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from shoal.client.generation.speculation import WindowPlanner
from shoal.gateway.app import build_app
from shoal.gateway.engine import Engine, Sampling, Speculation, load_draft
from shoal.gateway.swarm import Watchers
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LOOPBACK
from testkit.tiny import char_tokenizer, save_checkpoint, tiny_model
from tests.gateway.conftest import MODEL_ID
from tests.gateway.support import reference_answer, scrape, wait_for

pytestmark = pytest.mark.timeout(120)

NEW = 24  # tokens per answer: long enough for several verification rounds
MESSAGES = [{"role": "user", "content": "Say hello hello hello hello"}]
COUNTERS = {
    "rounds": "shoal_speculation_rounds_total",
    "drafted_tokens": "shoal_speculation_drafted_tokens_total",
    "accepted_tokens": "shoal_speculation_accepted_tokens_total",
}


@pytest.fixture(scope="module")
def client(chat_model):
    """The client model over an in-process swarm of the tiny chat model (blocks 0:3 and 3:6)."""
    with InProcessSwarm(chat_model[0], [BlockRange(0, 3), BlockRange(3, 6)]) as swarm:
        yield swarm.connect()


def draft_checkpoint(out_dir: Path, tokenizer, seed: int, **shape) -> Path:
    """A tiny random llama drafting for the chat model, saved with ``tokenizer``."""
    model = tiny_model("llama", seed=seed, max_position_embeddings=2048, **shape)
    return save_checkpoint(model, out_dir, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def drafts(chat_model, tmp_path_factory) -> dict[str, Path]:
    """Draft directories: ``same`` (the chat model's own weights: build_chat_model's seed and shape),
    ``other`` (another seed, 2 blocks) and ``chars`` (another tokenizer: 256 characters)."""
    tokenizer, root = chat_model[2], tmp_path_factory.mktemp("drafts")
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    special["pad_token_id"] = tokenizer.pad_token_id
    vocab = len(tokenizer)
    return {
        "same": draft_checkpoint(root / "same", tokenizer, 11, vocab_size=vocab, num_hidden_layers=6, **special),
        "other": draft_checkpoint(root / "other", tokenizer, 5, vocab_size=vocab, num_hidden_layers=2, **special),
        "chars": draft_checkpoint(root / "chars", char_tokenizer(), 3),
    }


@pytest.fixture(scope="module")
def expected(chat_model) -> tuple[str, list[int]]:
    """Plain transformers' greedy answer to :data:`MESSAGES`: (text, token ids)."""
    _, reference, tokenizer = chat_model
    return reference_answer(reference, tokenizer, MESSAGES, NEW)


@contextmanager
def serving(engine: Engine) -> Iterator[str]:
    """The gateway app over ``engine`` on a free loopback port, in a thread; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    app = build_app(engine, Watchers(LOOPBACK), max_concurrency=2)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 20, 0.02, what="the gateway started")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def chat(url: str, **extra) -> dict:
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": NEW, "temperature": 0, **extra}
    return post(f"{url}/v1/chat/completions", body)


def stream_usage(url: str) -> tuple[str, dict]:
    """A streamed greedy chat answer with ``include_usage``: (its text, the usage chunk's usage)."""
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": NEW, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        events = [line[6:] for line in reply.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]


def assert_consistent(summary: dict) -> None:
    """Accepted <= drafted; acceptance and mean window are the ratios of the counts (as rounded)."""
    assert set(summary) == {"rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_window"}
    rounds, drafted, accepted = summary["rounds"], summary["drafted_tokens"], summary["accepted_tokens"]
    assert rounds >= 1 and 0 <= accepted <= drafted
    assert summary["mean_window"] == round(drafted / rounds, 3)
    assert summary["acceptance_rate"] == (round(accepted / drafted, 4) if drafted else 0.0)


def speculation_metrics(url: str) -> dict[str, float]:
    samples = scrape(f"{url}/metrics")
    names = [*COUNTERS.values(), "shoal_completion_tokens_total"]
    names += ["shoal_speculation_acceptance_rate", "shoal_speculation_mean_window"]
    return {name: samples[name] for name in names}


def served_with_speculation(engine: Engine, expected: tuple[str, list[int]]) -> list[dict]:
    """Two greedy answers (the second streamed) through the API: each is exactly ``expected``, has a
    consistent speculation summary in ``usage``, and grows the counters of ``/metrics`` by exactly
    its numbers. Returns the two summaries.

    Each answer comes from its own app over ``engine`` (the counters are the engine's), so each runs
    in a fresh worker thread: see test_a_draft_model_may_start_a_call_without_drafting."""
    text, ids = expected
    with serving(engine) as url:
        start = speculation_metrics(url)
        answer = chat(url)
    assert start[COUNTERS["rounds"]] == 0 and start["shoal_completion_tokens_total"] == 0
    assert answer["choices"][0]["message"]["content"] == text
    assert answer["usage"]["completion_tokens"] == len(ids)
    with serving(engine) as url:
        streamed, usage = stream_usage(url)
        after = speculation_metrics(url)
    assert streamed == text and usage["completion_tokens"] == len(ids)
    summaries = [answer["usage"]["speculation"], usage["speculation"]]
    for summary in summaries:
        assert_consistent(summary)
    for key, name in COUNTERS.items():
        assert after[name] - start[name] == sum(s[key] for s in summaries), name
    assert after["shoal_completion_tokens_total"] == 2 * len(ids)
    drafted, accepted = after[COUNTERS["drafted_tokens"]], after[COUNTERS["accepted_tokens"]]
    assert after["shoal_speculation_acceptance_rate"] == pytest.approx(accepted / drafted if drafted else 0.0)
    assert after["shoal_speculation_mean_window"] == pytest.approx(drafted / after[COUNTERS["rounds"]])
    return summaries


def test_without_speculation_usage_has_nothing_new(client, expected):
    engine = Engine(client, MODEL_ID)
    with serving(engine) as url:
        answer = chat(url)
        metrics = speculation_metrics(url)
    assert answer["choices"][0]["message"]["content"] == expected[0]
    assert set(answer["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert metrics["shoal_completion_tokens_total"] == len(expected[1])
    assert all(metrics[name] == 0 for name in COUNTERS.values())


def test_prompt_lookup_answers_the_same_tokens(client, expected):
    served_with_speculation(Engine(client, MODEL_ID, speculation=Speculation(prompt_lookup=3)), expected)


def test_a_draft_equal_to_the_model_has_every_draft_accepted(client, chat_model, drafts, expected):
    speculation = load_draft(drafts["same"], chat_model[2])
    assert speculation.draft_tokenizer is None  # the same vocabulary: no mapping between tokenizers
    summaries = served_with_speculation(Engine(client, MODEL_ID, speculation=speculation), expected)
    assert all(s["drafted_tokens"] > 0 and s["accepted_tokens"] == s["drafted_tokens"] for s in summaries)


def test_another_draft_model_answers_the_same_tokens(client, chat_model, drafts, expected):
    speculation = load_draft(drafts["other"], chat_model[2])
    summaries = served_with_speculation(Engine(client, MODEL_ID, speculation=speculation), expected)
    assert any(s["drafted_tokens"] > 0 for s in summaries)


def test_a_draft_with_another_tokenizer_answers_the_same_tokens(client, chat_model, drafts, expected):
    speculation = load_draft(drafts["chars"], chat_model[2])
    assert speculation.draft_tokenizer is not None  # universal assisted decoding: tokenizer and assistant_tokenizer
    assert speculation.generate_kwargs(chat_model[2]).keys() == {"assistant_model", "tokenizer", "assistant_tokenizer"}
    served_with_speculation(Engine(client, MODEL_ID, speculation=speculation), expected)


def test_a_seed_gives_the_same_sampled_answer_with_or_without_speculation(client, chat_model, drafts):
    """Every draw is seeded by (seed, position): the target's token at each position is the same
    whatever windows speculation chose, and a draft equal to the target draws the same tokens."""
    sampling = Sampling(NEW, temperature=1.0, top_p=0.95, seed=7)
    plain = Engine(client, MODEL_ID)
    prompt = plain.chat_prompt(MESSAGES)
    expected = plain.complete(prompt, sampling).text
    for name in ("same", "other"):
        engine = Engine(client, MODEL_ID, speculation=load_draft(drafts[name], chat_model[2]))
        done = engine.complete(prompt, sampling)
        assert done.text == expected, name
        assert done.speculation["drafted_tokens"] > 0, name
        if name == "same":
            assert done.speculation["accepted_tokens"] == done.speculation["drafted_tokens"]
    lookup = Engine(client, MODEL_ID, speculation=Speculation(prompt_lookup=3))
    assert lookup.complete(prompt, sampling).text == expected


def test_sampled_answers_report_speculation_too(client, chat_model, drafts):
    """Temperature > 0: the engine's seeded sampler picks the target's tokens, which the drafts are
    compared with (the distribution stays the target's); usage tells the rounds all the same."""
    engine = Engine(client, MODEL_ID, speculation=load_draft(drafts["other"], chat_model[2]))
    with serving(engine) as url:
        answer = chat(url, temperature=0.8, seed=3)
    assert answer["usage"]["completion_tokens"] >= 1
    assert_consistent(answer["usage"]["speculation"])


def test_a_draft_model_may_start_a_call_without_drafting(client, chat_model, drafts, monkeypatch):
    """What a thread's second call meets when its planner (kept across calls) measured that drafting
    does not pay: the planner says 0 for round 1. A draft model's first round is its prefill, so it
    drafts anyway (at least one token), and the call completes."""
    chosen: dict[int, int] = {}

    def plain_first(planner: WindowPlanner) -> int:
        chosen[id(planner)] = chosen.get(id(planner), 0) + 1
        return 0 if chosen[id(planner)] == 1 else 2

    monkeypatch.setattr(WindowPlanner, "choose", plain_first)
    engine = Engine(client, MODEL_ID, speculation=load_draft(drafts["other"], chat_model[2]))
    done = engine.complete(engine.chat_prompt(MESSAGES), Sampling(NEW, temperature=0))
    assert_consistent(done.speculation)
    assert done.speculation["drafted_tokens"] > 0
