"""The gateway's engine without a network: text streaming with stop strings, sampling, cancellation,
context checks, and concurrent ``generate`` calls sharing one client model (each thread gets its
own session). The blocks run in-process (:class:`~shoal.client.local.LocalBlockSequence`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shoal.client.local import LocalBlockSequence
from shoal.client.model import DistributedModelForCausalLM
from shoal.gateway.engine import Engine, GatewayError, Sampling, TextStream
from shoal.models import get_family
from tests.gateway.support import reference_answer, reference_continuation

pytestmark = pytest.mark.timeout(120)


class SlowBlocks:
    """A block sequence whose session steps yield the GIL (sleep), so threads interleave."""

    def __init__(self, inner: LocalBlockSequence):
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.sessions = 0

    def forward(self, hidden, position_ids, attention_mask):
        return self.inner.forward(hidden, position_ids, attention_mask)

    def open_session(self, batch_size: int, max_length: int):
        self.sessions += 1
        session = self.inner.open_session(batch_size, max_length)
        step = session.step

        def slow_step(*args):
            time.sleep(0.002)
            return step(*args)

        session.step = slow_step
        return session


def local_model(reference, tokenizer) -> DistributedModelForCausalLM:
    config, state = reference.config, reference.state_dict()
    head = get_family(config).build_client_head(config, state, torch.float32, "cpu")
    blocks = SlowBlocks(LocalBlockSequence.from_state_dict(config, state, boundaries=(3,)))
    model = DistributedModelForCausalLM(config, head, blocks)
    model.generation_config = reference.generation_config
    model.tokenizer = tokenizer
    return model


@pytest.fixture(scope="module")
def engine(chat_model) -> Engine:
    _, reference, tokenizer = chat_model
    return Engine(local_model(reference, tokenizer), "tinychat")


# ---- TextStream --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(chat_model):
    return chat_model[2]


def stream_all(tokenizer, text: str, stop=()) -> tuple[list[str], str]:
    """Push ``text``'s tokens one at a time; the deltas and the final text."""
    stream = TextStream(tokenizer, stop)
    deltas = [stream.push([t]) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    deltas.append(stream.finish())
    return deltas, stream.final()


def test_text_stream_joins_to_the_decoded_text(tokenizer):
    text = "Hello world 🙂 — naïve café, 東京 and more"
    deltas, final = stream_all(tokenizer, text)
    assert final == text and "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas), "a half character was sent"
    assert sum(bool(d) for d in deltas) > 5


def test_text_stream_stops_before_the_stop_string(tokenizer):
    deltas, final = stream_all(tokenizer, "one two three four five", stop=["ee fo", "zzz"])
    assert final == "one two thr" and "".join(deltas) == final
    # a prefix of a stop string is held back until it cannot be one any more
    stream = TextStream(tokenizer, ["three"])
    sent = "".join(stream.push([t]) for t in tokenizer("one th", add_special_tokens=False)["input_ids"])
    assert sent == "one "
    sent += "".join(stream.push([t]) for t in tokenizer("ing", add_special_tokens=False)["input_ids"])
    assert sent + stream.finish() == "one thing"


# ---- generation ----------------------------------------------------------------------------------
def test_greedy_completion_equals_transformers(engine, chat_model):
    _, reference, tokenizer = chat_model
    messages = [{"role": "user", "content": "Say something."}]
    expected, ids = reference_answer(reference, tokenizer, messages, 20)
    deltas: list[str] = []
    done = engine.complete(engine.chat_prompt(messages), Sampling(20, temperature=0), on_text=deltas.append)
    assert done.text == expected and "".join(deltas) == expected
    assert done.completion_tokens == len(ids)
    assert done.finish_reason == ("stop" if ids[-1] == tokenizer.eos_token_id else "length")


def test_cancel_stops_at_the_next_token(engine):
    cancel = threading.Event()
    deltas: list[str] = []

    def on_text(delta: str) -> None:
        deltas.append(delta)
        if len(deltas) == 3:
            cancel.set()

    done = engine.complete(engine.text_prompt("Once upon a time"), Sampling(200, 0.0), on_text, cancel)
    assert done.finish_reason == "cancelled"
    assert done.completion_tokens <= 5
    assert "".join(deltas) == done.text


def test_context_checks(engine):
    prompt = engine.text_prompt("hi")
    assert engine.budget(prompt, None, "prompt") == 512  # the default answer length
    assert engine.budget(prompt, 2048 - len(prompt), "prompt") == 2048 - len(prompt)
    with pytest.raises(GatewayError) as caught:
        engine.budget(prompt, 2049 - len(prompt), "prompt")
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "context_length_exceeded", "prompt")
    with pytest.raises(GatewayError):
        engine.budget(list(range(2048)), None, "messages")


def test_concurrent_generate_calls_each_get_their_own_session(engine, chat_model):
    """Six threads generate at once on one model (greedy and seeded sampling), while a seventh holds
    an ``inference_session``: every answer is what it would be alone."""
    _, reference, tokenizer = chat_model
    prompts = [engine.text_prompt(f"Story {i}: the") for i in range(4)]
    expected = [reference_continuation(reference, tokenizer, p, 12)[0] for p in prompts]
    seeded = Sampling(12, temperature=1.0, top_p=0.9, seed=3)
    alone = engine.complete(prompts[0], seeded).text
    model, blocks = engine.model, engine.model.blocks
    opened = blocks.sessions
    results: dict[str, object] = {}
    barrier = threading.Barrier(7)

    def greedy(i: int) -> None:
        barrier.wait(10)
        results[f"greedy{i}"] = engine.complete(prompts[i], Sampling(12, 0.0)).text

    def sampled(name: str) -> None:
        barrier.wait(10)
        results[name] = engine.complete(prompts[0], seeded).text

    def holder() -> None:
        with model.inference_session(max_length=64) as session:
            barrier.wait(10)
            out = model.generate(torch.tensor([prompts[1]]), max_new_tokens=12, do_sample=False)
            text = tokenizer.decode(out[0, len(prompts[1]) :], skip_special_tokens=True)
            results["session"] = (text, session.position)

    threads = [threading.Thread(target=greedy, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=sampled, args=(n,)) for n in ("sampled0", "sampled1")]
    threads.append(threading.Thread(target=holder))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [results[f"greedy{i}"] for i in range(4)] == expected
    assert results["sampled0"] == results["sampled1"] == alone
    assert results["session"] == (expected[1], len(prompts[1]) + 11)
    assert blocks.sessions - opened == 7
    assert model.active_session is None
