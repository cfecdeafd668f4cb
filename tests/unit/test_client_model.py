"""DistributedModelForCausalLM over a BlockSequence must behave like the plain transformers model.

The backend is the ``make_blocks`` fixture (in-process spans here); parametrize it with a swarm to
run the same checks remotely.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from shoal.client.blocks import BlockSequence
from shoal.client.local import LocalBlockSequence
from shoal.client.model import DistributedModelForCausalLM
from shoal.models import get_family
from testkit.tiny import char_tokenizer, tiny_model
from tests.helpers.parity import (
    CountingBlocks,
    assert_generate_matches,
    assert_logits_close,
    left_padded,
    min_top2_gap,
)

pytestmark = pytest.mark.timeout(120)

GREEDY = {"do_sample": False}


@pytest.fixture(scope="module")
def reference():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def greedy64(reference, prompt) -> torch.Tensor:
    return reference.generate(prompt, max_new_tokens=64, **GREEDY)


@pytest.fixture(params=["local-2-spans"])
def make_blocks(request) -> Callable[..., BlockSequence]:
    """(config, state_dict, dtype=float32) -> BlockSequence: the backend under test."""

    def make(config, state_dict, dtype: torch.dtype = torch.float32) -> BlockSequence:
        return LocalBlockSequence.from_state_dict(config, state_dict, boundaries=(2,), dtype=dtype)

    return make


@pytest.fixture
def blocks(reference, make_blocks) -> CountingBlocks:
    return CountingBlocks(make_blocks(reference.config, reference.state_dict()))


@pytest.fixture
def model(reference, blocks) -> DistributedModelForCausalLM:
    config, state = reference.config, reference.state_dict()
    head = get_family(config).build_client_head(config, state, torch.float32, "cpu")
    return DistributedModelForCausalLM(config, head, blocks)


def test_weights_are_far_from_ties(reference, prompt):
    assert min_top2_gap(reference, prompt, max_new_tokens=64) > 1e-3


def test_forward_logits(model, reference, prompt):
    assert_logits_close(model, reference, prompt)
    ids, mask = left_padded([[5, 6, 7], [8, 9, 10, 11, 12]])
    assert_logits_close(model, reference, ids, attention_mask=mask)
    assert_logits_close(model, reference, ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    assert model.blocks.forward_calls == 3 and not model.blocks.sessions  # stateless without a session


def test_greedy_64(model, reference, prompt, greedy64, blocks):
    out = model.generate(prompt, max_new_tokens=64, **GREEDY)
    assert torch.equal(out, greedy64)
    (session,) = blocks.sessions
    assert session.consumed == prompt.shape[1] + 63 and session.closed


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.8},
        {"temperature": 1.3, "top_k": 20},
        {"temperature": 0.9, "top_p": 0.8},
        {"top_k": 50, "top_p": 0.95, "num_return_sequences": 2},
    ],
)
def test_sampling(model, reference, prompt, kwargs):
    assert_generate_matches(model, reference, prompt, seed=1234, max_new_tokens=24, do_sample=True, **kwargs)


def test_repetition_penalty(model, reference, prompt):
    assert_generate_matches(model, reference, prompt, max_new_tokens=24, repetition_penalty=1.5, **GREEDY)


@pytest.mark.parametrize("with_eos", [False, True])
def test_left_padded_batch(model, reference, with_eos):
    ids, mask = left_padded([[5, 17, 99, 3, 42], [7, 8, 200, 31, 64, 12, 90, 4, 77], [250] * 3 + [11] * 9])
    kwargs = {"attention_mask": mask, "max_new_tokens": 20, "pad_token_id": 0, **GREEDY}
    if with_eos:  # the first row's 5th new token: rows stop at different steps, then get padded
        kwargs["eos_token_id"] = int(reference.generate(ids, **kwargs)[0, ids.shape[1] + 4])
    out = assert_generate_matches(model, reference, ids, **kwargs)
    assert out.shape[1] <= ids.shape[1] + 20


def test_eos_token(model, reference, prompt, greedy64):
    eos = int(greedy64[0, prompt.shape[1] + 9])
    out = assert_generate_matches(model, reference, prompt, max_new_tokens=64, eos_token_id=eos, **GREEDY)
    assert out[0, -1] == eos and out.shape[1] <= prompt.shape[1] + 10


class _Collect(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.flatten().tolist())

    def end(self) -> None:
        self.chunks.append([])


def test_stop_strings_and_streamer(model, reference, prompt, greedy64):
    tokenizer = char_tokenizer()
    new = greedy64[0, prompt.shape[1] :].tolist()
    stop = tokenizer.decode(new[8:10])
    assert stop not in tokenizer.decode(new[:9])
    streams = []
    for m in (reference, model):
        streams.append(_Collect())
        out = m.generate(prompt, max_new_tokens=64, stop_strings=[stop], tokenizer=tokenizer, streamer=streams[-1])
        assert out.shape[1] == prompt.shape[1] + 10 and tokenizer.decode(out[0]).endswith(stop)
    assert streams[0].chunks == streams[1].chunks


def test_two_generates_in_one_session(model, prompt, greedy64, blocks):
    with model.inference_session(max_length=prompt.shape[1] + 64) as session:
        first = model.generate(prompt, max_new_tokens=32, **GREEDY)
        second = model.generate(first, max_new_tokens=32, **GREEDY)
        assert session.position == prompt.shape[1] + 63
    assert torch.equal(second, greedy64)
    (counted,) = blocks.sessions
    assert counted.consumed == prompt.shape[1] + 63 and counted.closed
    assert counted.steps[0] == prompt.shape[1] and set(counted.steps[1:]) == {1}  # no prefix recompute


def test_rollback_on_divergent_prefix(model, reference, prompt, blocks):
    with model.inference_session(max_length=64) as session:
        first = model.generate(prompt, max_new_tokens=8, **GREEDY)
        assert session.position == prompt.shape[1] + 7
        branch = torch.cat([first[:, :10], torch.tensor([[77, 78, 79]])], dim=1)  # diverges at position 10
        assert_generate_matches(model, reference, branch, max_new_tokens=8, **GREEDY)
        assert blocks.sessions[0].steps[8] == branch.shape[1] - 10  # only the suffix after the common prefix
        assert torch.equal(session.token_ids[0, :10], first[0, :10])
        # resending what the session already holds still leaves one token to run
        again = model.generate(branch, max_new_tokens=8, **GREEDY)
        assert blocks.sessions[0].steps[16] == 1 and again.shape[1] == branch.shape[1] + 8
    assert len(blocks.sessions) == 1


def test_manual_steps_with_session_cache(model, prompt):
    full = model(prompt).logits
    with model.inference_session(max_length=32) as cache:
        head = model(prompt[:, :7], cache=cache).logits
        tail = model(prompt[:, 7:], cache=cache).logits
        assert cache.position == prompt.shape[1]
    torch.testing.assert_close(torch.cat([head, tail], dim=1), full, rtol=0, atol=1e-4)  # 1.3e-5 seen on an EPYC


class _Boom(LogitsProcessor):
    def __init__(self, after: int) -> None:
        self.calls, self.after = 0, after

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("boom")
        return scores


def test_session_closed_after_generate_even_on_error(model, prompt, blocks):
    model.generate(prompt, max_new_tokens=4, **GREEDY)
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(prompt, max_new_tokens=8, logits_processor=LogitsProcessorList([_Boom(3)]), **GREEDY)
    assert len(blocks.sessions) == 2 and all(s.closed for s in blocks.sessions)
    assert model.active_session is None


def test_session_size_checked_before_running(model, prompt, blocks):
    with model.inference_session(max_length=16) as _, pytest.raises(ValueError, match="positions"):
        model.generate(prompt, max_new_tokens=8, **GREEDY)
    with model.inference_session(max_length=64, batch_size=2) as _, pytest.raises(ValueError, match="sequences"):
        model.generate(prompt, max_new_tokens=8, **GREEDY)
    assert all(s.consumed == 0 and s.closed for s in blocks.sessions)
    with pytest.raises(NotImplementedError):
        model.generate(prompt, max_new_tokens=4, num_beams=2)


def test_inputs_embeds(model, reference, prompt, blocks):
    embeds = reference.model.embed_tokens(prompt).detach()
    torch.testing.assert_close(
        model(inputs_embeds=embeds).logits, reference(inputs_embeds=embeds).logits, rtol=0, atol=1e-4
    )
    expected = reference.generate(inputs_embeds=embeds, max_new_tokens=8, **GREEDY)
    assert torch.equal(model.generate(inputs_embeds=embeds, max_new_tokens=8, **GREEDY), expected)
    with model.inference_session(max_length=32) as session:
        model.generate(prompt, max_new_tokens=4, **GREEDY)
        assert torch.equal(model.generate(inputs_embeds=embeds, max_new_tokens=8, **GREEDY), expected)
        assert session.position == prompt.shape[1] + 7  # embeddings cannot be matched: restarted from 0


def test_bfloat16_head_and_blocks(make_blocks):
    reference = tiny_model("llama", seed=0)
    rotary = reference.model.rotary_emb
    inv_freq = rotary.inv_freq.clone()
    reference.to(torch.bfloat16)
    rotary.inv_freq = inv_freq  # stays fp32, as with from_pretrained(dtype=bfloat16)
    config, state = reference.config, reference.state_dict()
    head = get_family(config).build_client_head(config, state, torch.bfloat16, "cpu")
    model = DistributedModelForCausalLM(config, head, make_blocks(config, state, torch.bfloat16))  # fp32 wire
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    assert_logits_close(model, reference, ids, atol=0.05)
    assert_generate_matches(model, reference, ids, max_new_tokens=16, **GREEDY)
