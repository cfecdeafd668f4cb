"""Training on the client, over in-process blocks (:class:`~shoal.client.local.LocalBlockSequence`):
the HF surface (``inputs_embeds``, ``labels`` -> ``loss``, embeddings), gradients through the head and
the blocks, prompt tuning (ptune, deep_ptune: placement, positions, generation, save and load), and
the routing filter that keeps adapters and the ``train`` capability on the servers that have them.
The reference is the plain ``transformers`` model with the prompts placed by :mod:`tests.helpers.prompts`.
"""

from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from shoal.client.generation.cache import SessionCache
from shoal.client.local import LocalBlockSequence
from shoal.client.model import DistributedModelForCausalLM
from shoal.client.training.prompts import PromptTuning
from shoal.errors import UsageError
from shoal.ids import BlockRange, PeerId
from shoal.models import get_family
from shoal.routing import AdapterChoice, BanList, NoRouteError, RouteInfo, ServerSpan, route_with_bans
from testkit.tiny import tiny_model
from tests.helpers.parity import left_padded
from tests.helpers.prompts import assert_grads_close, reference_generate, reference_logits

pytestmark = pytest.mark.timeout(60)

N_PROMPTS = 3
DIGEST = "ab" * 32


@pytest.fixture(scope="module")
def reference():
    return tiny_model("llama", seed=0)


def make_model(reference, mode: str | None = None, seed: int = 5) -> DistributedModelForCausalLM:
    config, state = reference.config, reference.state_dict()
    head = get_family(config).build_client_head(config, state, torch.float32, "cpu")
    blocks = LocalBlockSequence.from_state_dict(config, state, boundaries=(1, 3))
    prompts = None
    if mode is not None:
        torch.manual_seed(seed)
        prompts = PromptTuning(mode, N_PROMPTS, config.hidden_size, config.num_hidden_layers)
        if prompts.intermediate_prompt_embeddings is not None:  # zeros at first: make the check non-trivial
            with torch.no_grad():
                prompts.intermediate_prompt_embeddings.weight.normal_(0, 0.5)
    return DistributedModelForCausalLM(config, head, blocks, prompts=prompts)


def batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(input_ids, attention_mask, labels): a left-padded pair, or two unpadded rows."""
    if padded:
        ids, mask = left_padded([[5, 6, 7, 9], [8, 9, 10, 11, 12, 13, 14]])
        labels = ids.masked_fill(mask == 0, -100)
        return ids, mask, labels
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    return ids, None, ids.clone()


def test_hf_surface(reference):
    model = make_model(reference)
    assert model.get_input_embeddings() is model.head.embed_tokens
    assert model.get_output_embeddings() is model.head.lm_head
    assert not any(p.requires_grad for p in model.parameters())  # the head is frozen as loaded
    ids, mask, labels = batch(padded=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    want = reference(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.loss is not None and torch.allclose(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.loss, ForCausalLMLoss(out.logits, labels, reference.config.vocab_size))
    with torch.no_grad():
        assert not model(input_ids=ids).logits.requires_grad


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_input_embedding_gradients_equal_local_autograd(reference, padded):
    model = make_model(reference)
    ids, mask, labels = batch(padded)
    embeds = reference.get_input_embeddings()(ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    (got,) = torch.autograd.grad(loss, [embeds])
    want_loss = ForCausalLMLoss(reference_logits(reference, embeds, mask), labels, reference.config.vocab_size)
    (want,) = torch.autograd.grad(want_loss, [embeds])
    assert torch.allclose(loss, want_loss, rtol=1e-5)
    assert_grads_close(got, want, "d loss / d inputs_embeds")


def test_gradients_reach_an_unfrozen_head(reference):
    model = make_model(reference)
    model.head.norm.requires_grad_(True)
    ids, mask, labels = batch(padded=True)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    reference.zero_grad()
    reference(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert_grads_close(model.head.norm.weight.grad, reference.model.norm.weight.grad, "d loss / d norm")
    reference.zero_grad()


@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_prompt_gradients_equal_local_autograd(reference, mode, padded):
    model = make_model(reference, mode)
    ids, mask, labels = batch(padded)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == (2 if mode == "deep_ptune" else 1)  # only the prompts train
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits.shape[:2] == ids.shape  # the prompt positions are dropped
    got = torch.autograd.grad(out.loss, params)
    embeds = reference.get_input_embeddings()(ids).detach()
    logits = reference_logits(reference, embeds, mask, model.ptune)
    want_loss = ForCausalLMLoss(logits, labels, reference.config.vocab_size)
    want = torch.autograd.grad(want_loss, params)
    assert torch.allclose(out.loss, want_loss, rtol=1e-5)
    for name, g, w in zip(["prompt_embeddings", "intermediate_prompt_embeddings"], got, want, strict=False):
        assert_grads_close(g, w, f"d loss / d {name}")


@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
def test_generate_with_prompts_equals_local(reference, mode):
    model = make_model(reference, mode)
    prompt = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(4))
    got = model.generate(prompt, max_new_tokens=16, do_sample=False)
    want = reference_generate(reference, prompt, model.ptune, 16)
    assert torch.equal(got[:, prompt.shape[1] :], want)
    with model.inference_session(max_length=40) as cache:  # the session holds the prompts once
        first = model.generate(prompt, max_new_tokens=8, do_sample=False)
        assert cache.session.position == N_PROMPTS + prompt.shape[1] + 7 and cache.position == prompt.shape[1] + 7
        again = model.generate(first, max_new_tokens=8, do_sample=False)
        assert cache.get_max_cache_shape() == 40
    assert torch.equal(again[0, prompt.shape[1] :], got[0, prompt.shape[1] :])


def test_session_cache_counts_tokens_after_the_prompts(reference):
    session = LocalBlockSequence.from_state_dict(reference.config, reference.state_dict()).open_session(1, 20)
    cache = SessionCache(session, prefix=4)
    assert cache.position == 0 and not cache.holds_prefix and cache.get_max_cache_shape() == 16
    session.step(torch.zeros(1, 6, 64), torch.arange(6).unsqueeze(0), None)  # 4 prompts + 2 tokens
    cache.record(torch.tensor([[7, 8]]), 2)
    assert cache.position == 2 and cache.holds_prefix and cache.token_ids.tolist() == [[7, 8]]
    cache.rollback(0)
    assert session.position == 4 and cache.position == 0  # the prompts stay in the session


def test_prompts_save_and_load(reference, tmp_path):
    model = make_model(reference, "deep_ptune", seed=1)
    path = tmp_path / "prompts.safetensors"
    model.save_prompts(path)
    other = make_model(reference, "deep_ptune", seed=2)
    assert not torch.equal(other.ptune.prompt_embeddings.weight, model.ptune.prompt_embeddings.weight)
    weight = other.ptune.prompt_embeddings.weight
    other.load_prompts(path)
    assert other.ptune.prompt_embeddings.weight is weight  # in place: an optimiser keeps its parameters
    for a, b in zip(other.ptune.parameters(), model.ptune.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(UsageError, match=r"tuning_mode deep_ptune \(this model: ptune\)"):
        make_model(reference, "ptune").load_prompts(path)
    longer = PromptTuning("deep_ptune", N_PROMPTS + 1, 64, 4)
    with pytest.raises(UsageError, match=r"pre_seq_len 3 \(this model: 4\)"):
        longer.load(path)
    with pytest.raises(ValueError, match="no prompts to save"):
        make_model(reference).save_prompts(path)


def test_prompt_tuning_refuses_bad_settings():
    with pytest.raises(UsageError, match="tuning_mode must be None or one of 'ptune', 'deep_ptune', not 'lora'"):
        PromptTuning("lora", 4, 64, 4)
    with pytest.raises(UsageError, match="needs pre_seq_len >= 1"):
        PromptTuning("ptune", 0, 64, 4)
    deep = PromptTuning("deep_ptune", 2, 8, 3)
    assert torch.equal(deep.intermediate_prompt_embeddings.weight, torch.zeros(2, 24))  # zeros, as Petals
    assert deep.deep_prompts().shape == (3, 1, 2, 8) and PromptTuning("ptune", 2, 8, 3).deep_prompts() is None


def test_prompt_positions_follow_the_extended_mask():
    prompts = PromptTuning("ptune", 2, 4, 1)
    hidden = torch.zeros(2, 3, 4)
    mask = torch.tensor([[False, True, True], [True, True, True]])
    out, positions, full = prompts.extend(hidden, None, mask, past=0, prepend=True)
    assert out.shape == (2, 5, 4) and torch.equal(out[:, :2], prompts.input_prompts(2, torch.float32))
    assert positions.tolist() == [[0, 1, 1, 2, 3], [0, 1, 2, 3, 4]] and full[:, :2].all()
    _, positions, _ = prompts.extend(hidden[:, :1], torch.tensor([[3], [5]]), None, past=4, prepend=False)
    assert positions.tolist() == [[5], [7]]  # given positions move by N


def spans_with(*adapters: tuple[tuple[str, str], ...], capabilities=frozenset({"adapters", "train"})):
    return [
        ServerSpan(PeerId(f"peer{i}"), BlockRange(2 * (i % 2), 2 * (i % 2) + 2), None,
                   RouteInfo(capabilities=capabilities, adapters=tuple(a)))
        for i, a in enumerate(adapters)
    ]  # fmt: skip


def route(spans, adapter=None, needs=()):
    return route_with_bans(spans, 0, 4, lambda s, p: 1.0, BanList(), needs=needs, adapter=adapter)


def test_adapter_routing_filter():
    other = "cd" * 32
    spans = spans_with((("x", DIGEST),), (("y", DIGEST),), (), (("x", DIGEST),))
    assert [s.peer_id for s in route(spans, AdapterChoice.parse("x"))] == ["peer0", "peer3"]
    assert [s.peer_id for s in route(spans, AdapterChoice.parse(f"x@{DIGEST}"))] == ["peer0", "peer3"]
    with pytest.raises(NoRouteError, match=r"no server has adapter 'x@cdcdcdcdcdcd' for blocks 0-3; they have "):
        route(spans, AdapterChoice.parse(f"x@{other}"))
    with pytest.raises(NoRouteError, match=r"^no server has adapter 'z' for blocks 0-3"):
        route(spans, AdapterChoice.parse("z"))
    only_first = spans_with((("z", DIGEST),), (), ())
    with pytest.raises(NoRouteError, match=r"^no server has adapter 'z' for blocks 2-3; they have no adapters"):
        route(only_first, AdapterChoice("z"))
    without = spans_with((("x", DIGEST),), (("x", DIGEST),), capabilities=frozenset({"push"}))
    with pytest.raises(NoRouteError, match="no server announcing 'train' hosts blocks 0-3"):
        route(without, needs=("train",))
    with pytest.raises(NoRouteError, match="no server has adapter 'x' for blocks 0-3"):  # not announcing adapters
        route(without, AdapterChoice("x"))
    for bad in ("", "-x", "x@123", f"x@{DIGEST.upper()}"):
        with pytest.raises(UsageError):
            AdapterChoice.parse(bad)
