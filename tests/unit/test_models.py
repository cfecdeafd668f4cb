"""Spans of transformers' own layers, loaded slice-wise from a per-block checkpoint, must reproduce
the full transformers model: prefill, cached decode, left padding, rollback and the client head."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from shoal.checkpoints import load_config, load_tensors, span_tensor_filter
from shoal.client.generation.cache import CACHE_KEY
from shoal.models import UnsupportedModelError, get_family
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

# testkit.tiny's configs, changed where these tests want it. llama: plain MHA with tied embeddings (as
# SmolLM2); mistral: GQA, sliding window on all layers; qwen2: GQA, q/k/v biases, sliding window on
# layers >= 2 only; qwen3, qwen3_moe and mixtral as testkit.tiny makes them (q/k norms; experts, stored
# per expert as on the Hub); gemma3 as testkit.tiny makes it (sliding and full layers, a rotary per layer
# type, scaled embeddings, final soft-capping). Windows (6) are shorter than the sequences below, so the sliding
# path is really run.
OVERRIDES = {
    "llama": {"num_key_value_heads": 4, "tie_word_embeddings": True},
    "mistral": {"sliding_window": 6},
    "qwen2": {"sliding_window": 6},
    "qwen3": {"sliding_window": 6},
    "qwen3_moe": {"sliding_window": 6},
    "mixtral": {"sliding_window": 6},
    "gemma3": {"sliding_window": 6},
}
# Llama's own init: hidden states ~4 in size, where the tiny default's large init (made for greedy
# parity) grows them to ~100 and an absolute tolerance would mean 25x less
USUAL_INIT = 0.02
SPANS = [(0, 1), (1, 3), (3, 4)]
ATOL = 1e-4  # fp32: chunked and full passes are not bitwise equal, and differ across CPUs


@pytest.fixture(scope="module", params=sorted(OVERRIDES))
def checkpoint(request, tmp_path_factory):
    family = request.param
    return tiny_checkpoint(tmp_path_factory.mktemp(family), family, initializer_range=USUAL_INIT, **OVERRIDES[family])


@pytest.fixture(params=["sdpa", "eager"])
def setup(request, checkpoint):
    """(full transformers model, spans built from their own shards, client head) for one attn impl."""
    impl = request.param
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), attn_implementation=impl).eval()
    config = load_config(checkpoint)
    config._attn_implementation = impl
    family = get_family(config)
    spans = []
    for start, end in SPANS:
        tensors = load_tensors(checkpoint, span_tensor_filter(config, start, end))
        spans.append(family.build_span(config, start, end, tensors, torch.float32, "cpu"))
    head_tensors = load_tensors(checkpoint, family.client_tensor_names(config))
    head = family.build_client_head(config, head_tensors, torch.float32, "cpu")
    return model, spans, head


def run_spans(spans, hidden, position_ids, mask, caches, past):
    """Hidden states after each span (the wire values between servers)."""
    outs = []
    for span, cache in zip(spans, caches, strict=True):
        hidden = span(hidden, position_ids, mask, cache, past)
        outs.append(hidden)
    return outs


def check_against(model, outs, full_hidden_states) -> float:
    """Max |diff| between span outputs and transformers' per-layer hidden states. transformers'
    last entry is after the final norm, so the last span's output is normed first."""
    diffs = [
        (out - full_hidden_states[end]).abs().max().item() for out, (_, end) in zip(outs[:-1], SPANS[:-1], strict=True)
    ]
    diffs.append((model.model.norm(outs[-1]) - full_hidden_states[-1]).abs().max().item())
    assert max(diffs) <= ATOL, diffs
    return max(diffs)


def decode_and_compare(model, spans, ids, mask, steps):
    """Prefill then greedy-decode ``steps`` tokens through both the full model (DynamicCache) and the
    spans (their own caches), comparing hidden states at every step; returns the worst difference."""
    batch, n = ids.shape
    mask_long = mask if mask is not None else torch.ones(batch, n, dtype=torch.long)
    position_ids = (mask_long.cumsum(-1) - 1).masked_fill(mask_long == 0, 1)  # as generate() does
    cache = DynamicCache(config=model.config)
    caches = [span.allocate_cache(batch, n + steps) for span in spans]
    worst, past, tokens = 0.0, 0, ids
    for _ in range(steps + 1):
        with torch.no_grad():
            full = model(
                tokens,
                attention_mask=mask,
                position_ids=position_ids,
                **{CACHE_KEY: cache},  # past_key_values before transformers 5.24
                use_cache=True,
                output_hidden_states=True,
            )
            outs = run_spans(
                spans,
                model.model.embed_tokens(tokens),
                position_ids,
                None if mask is None else mask.bool(),
                caches,
                past,
            )
        worst = max(worst, check_against(model, outs, full.hidden_states))
        past += tokens.shape[1]
        tokens = full.logits[:, -1:].argmax(-1)
        position_ids = position_ids[:, -1:] + 1
        if mask is not None:
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
    assert all(c.length == past for c in caches)
    return worst


def test_prefill_then_decode_matches_transformers(setup):
    model, spans, _ = setup
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 7))
    decode_and_compare(model, spans, ids, None, steps=8)  # 15 positions > sliding window 6


def test_left_padded_batch_matches_transformers(setup):
    model, spans, _ = setup
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :6] = 0
    decode_and_compare(model, spans, ids, mask, steps=5)


def test_rollback_reproduces_steps(setup):
    model, spans, _ = setup
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (1, 12))
    embed = model.model.embed_tokens
    pos = torch.arange(12)[None]
    caches = [span.allocate_cache(1, 16) for span in spans]
    prefix = run_spans(spans, embed(ids[:, :6]), pos[:, :6], None, caches, 0)
    steps = [run_spans(spans, embed(ids[:, i : i + 1]), pos[:, i : i + 1], None, caches, i)[-1] for i in range(6, 10)]
    # roll back to position 7 and replay: same results, stale positions 8..9 are ignored
    for i in range(7, 10):
        again = run_spans(spans, embed(ids[:, i : i + 1]), pos[:, i : i + 1], None, caches, i)[-1]
        assert torch.equal(again, steps[i - 6])
    # a different token at position 7 equals a fresh session with the same history up to there
    other = torch.tensor([[(ids[0, 7].item() + 1) % 256]])
    rolled = run_spans(spans, embed(other), pos[:, 7:8], None, caches, 7)[-1]
    assert all(c.length == 8 for c in caches)
    fresh = [span.allocate_cache(1, 16) for span in spans]
    run_spans(spans, embed(ids[:, :6]), pos[:, :6], None, fresh, 0)
    run_spans(spans, embed(ids[:, 6:7]), pos[:, 6:7], None, fresh, 6)
    assert torch.equal(rolled, run_spans(spans, embed(other), pos[:, 7:8], None, fresh, 7)[-1])
    assert prefix[-1].shape == (1, 6, 64)


def test_client_head_matches_transformers(setup):
    model, spans, head = setup
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        full = model(ids, output_hidden_states=True)
    hidden = head.embed(ids)
    assert torch.equal(hidden, full.hidden_states[0])
    for span in spans:
        hidden = span(hidden, torch.arange(5).expand(2, -1), None)
    assert (head.logits(hidden) - full.logits).abs().max().item() <= ATOL
    tied = model.config.tie_word_embeddings
    assert (head.lm_head.weight is head.embed_tokens.weight) == tied


def test_span_dtype_and_cache_budget(checkpoint):
    config = load_config(checkpoint)
    family = get_family(config)
    tensors = load_tensors(checkpoint, span_tensor_filter(config, 1, 3))
    span = family.build_span(config, 1, 3, tensors, torch.bfloat16, "cpu")
    assert {p.dtype for p in span.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta or p.requires_grad for p in span.parameters())
    cache = span.allocate_cache(batch_size=2, max_length=10)
    per_token = family.cache_geometry(config, torch.bfloat16).bytes_per_token_per_block()
    assert cache.nbytes() == 0  # paged: nothing is held before a position is written
    out = span(torch.randn(2, 4, 64), torch.arange(4).expand(2, -1), None, cache, 0)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 64)
    page = cache.pool.page_size
    assert cache.nbytes() == 2 * page * 2 * per_token  # one page per row, two blocks


def test_span_rejects_bad_calls(checkpoint):
    config = load_config(checkpoint)
    family = get_family(config)
    tensors = load_tensors(checkpoint, span_tensor_filter(config, 0, 2))
    with pytest.raises(ValueError, match="missing tensors"):
        family.build_span(config, 0, 3, tensors, torch.float32, "cpu")
    span = family.build_span(config, 0, 2, tensors, torch.float32, "cpu")
    cache = span.allocate_cache(1, 8)
    hidden, pos = torch.randn(1, 3, 64), torch.arange(3)[None]
    with pytest.raises(ValueError, match="past_length"):
        span(hidden, pos + 2, None, cache, past_length=2)  # nothing cached yet
    with pytest.raises(ValueError, match="attention_mask"):
        span(hidden, pos, torch.ones(1, 5, dtype=torch.bool), cache, 0)
    with pytest.raises(ValueError, match="exceed"):
        span(torch.randn(1, 9, 64), torch.arange(9)[None], None, cache, 0)


def test_unsupported_family_names_supported_ones():
    with pytest.raises(UnsupportedModelError, match="llama, mistral, mixtral"):
        get_family(type("Config", (), {"model_type": "gpt2"})())
