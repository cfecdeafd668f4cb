"""Falcon and Phi-3 spans, loaded slice-wise from a per-block checkpoint, reproduce transformers.

The swarm tests run one alibi and one new-architecture Falcon and a Phi-3; here the other layouts the
config can pick (multi-query, alibi with a head count that is not a power of two, one shared LayerNorm
in the new architecture, tied embeddings), each with sdpa and eager attention, through a left-padded
prefill and cached greedy steps, and the KV cache geometry each layout must have.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from shoal.checkpoints import load_config, load_tensors, span_tensor_filter
from shoal.client.generation.cache import CACHE_KEY
from shoal.models import get_family
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

USUAL_INIT = 0.02  # hidden states of order 1, so the absolute tolerance means what it says
ATOL = 1e-4
SPANS = [(0, 1), (1, 3), (3, 4)]
# (testkit.tiny builder, overrides, kv heads a block's cache holds)
VARIANTS = {
    "falcon-7b-multi-query": ("falcon", {}, 1),
    "falcon-rw-alibi-6-heads-tied": (
        "falcon_alibi",
        {"hidden_size": 96, "num_attention_heads": 6, "tie_word_embeddings": True},
        6,
    ),
    "falcon-new-arch-2-groups": ("falcon_new_arch", {}, 2),
    "falcon-new-arch-one-layernorm-bias": ("falcon_new_arch", {"num_ln_in_parallel_attn": 1, "bias": True}, 2),
    "phi3-window-6": ("phi3", {"sliding_window": 6}, 2),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    builder, overrides, kv_heads = VARIANTS[request.param]
    path = tiny_checkpoint(tmp_path_factory.mktemp(request.param), builder, initializer_range=USUAL_INIT, **overrides)
    return path, kv_heads


@pytest.fixture(params=["sdpa", "eager"])
def setup(request, variant):
    """(transformers model, spans each built from only its own blocks' tensors, client head)."""
    path, _ = variant
    impl = request.param
    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=impl).eval()
    config = load_config(path)
    config._attn_implementation = impl
    family = get_family(config)
    spans = []
    for start, end in SPANS:
        tensors = load_tensors(path, span_tensor_filter(config, start, end))
        prefixes = tuple(family.block_tensor_prefix(config, i) for i in range(start, end))
        assert tensors and all(name.startswith(prefixes) for name in tensors)
        spans.append(family.build_span(config, start, end, tensors, torch.float32, "cpu"))
    head = family.build_client_head(
        config, load_tensors(path, family.client_tensor_names(config)), torch.float32, "cpu"
    )
    return model, spans, head


def through(spans, head, ids, position_ids, mask, caches, past) -> torch.Tensor:
    hidden = head.embed(ids)
    for span, cache in zip(spans, caches, strict=True):
        hidden = span(hidden, position_ids, mask, cache, past)
    return head.logits(hidden)


def test_padded_prefill_and_cached_steps_match_transformers(setup):
    """3 left-padded rows, a 10-token prefill and 8 greedy steps (18 positions > the window of 6):
    the spans' logits at every real position are within 1e-4 of transformers' cached run."""
    model, spans, head = setup
    torch.manual_seed(5)
    ids = torch.randint(3, 256, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :7] = 0
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() does
    reference_cache = DynamicCache(config=model.config)
    caches = [span.allocate_cache(3, 18) for span in spans]
    past, tokens, worst = 0, ids, 0.0
    with torch.no_grad():
        for _ in range(9):
            full = model(
                tokens, attention_mask=mask, position_ids=position_ids, use_cache=True, **{CACHE_KEY: reference_cache}
            )
            got = through(spans, head, tokens, position_ids, mask.bool(), caches, past)
            real = mask[:, past:].bool()
            worst = max(worst, (got - full.logits).abs()[real].max().item())
            past += tokens.shape[1]
            tokens = full.logits[:, -1:].argmax(-1)
            position_ids = position_ids[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
    assert worst <= ATOL, worst
    assert all(cache.length == 18 for cache in caches)


def test_stateless_forward_is_bitwise(setup):
    """Without a cache or padding the spans compute exactly what the full model does without one."""
    model, spans, head = setup
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    got = through(spans, head, ids, torch.arange(9).expand(2, -1), None, [None] * len(spans), 0)
    assert torch.equal(got, expected)
    assert (head.lm_head.weight is head.embed_tokens.weight) == model.config.tie_word_embeddings


def test_rollback_replays_steps(setup):
    """Stepping again from an earlier position (alibi and rotary alike) gives the same logits."""
    _, spans, head = setup
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(10)[None]
    caches = [span.allocate_cache(1, 10) for span in spans]
    through(spans, head, ids[:, :6], pos[:, :6], None, caches, 0)
    steps = [through(spans, head, ids[:, i : i + 1], pos[:, i : i + 1], None, caches, i) for i in range(6, 10)]
    for i in range(7, 10):
        assert torch.equal(through(spans, head, ids[:, i : i + 1], pos[:, i : i + 1], None, caches, i), steps[i - 6])


def test_cache_geometry_matches_what_the_layers_cache(variant):
    """Multi-query caches one kv head, the new architecture one per group (not one per query head),
    the old multi-head layout one per head; the budget equals the bytes of the pages held."""
    path, kv_heads = variant
    config = load_config(path)
    family = get_family(config)
    geometry = family.cache_geometry(config, torch.bfloat16)
    assert geometry.num_kv_heads == kv_heads
    span = family.build_span(config, 1, 3, load_tensors(path, span_tensor_filter(config, 1, 3)), torch.bfloat16, "cpu")
    cache = span.allocate_cache(batch_size=2, max_length=10)
    assert cache.pool.keys[0].shape[1] == kv_heads
    hidden = torch.randn(2, 4, config.hidden_size)
    out = span(hidden, torch.arange(4).expand(2, -1), None, cache, 0)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, config.hidden_size)
    page = cache.pool.page_size  # one page per row held, two blocks
    assert cache.nbytes() == 2 * page * 2 * geometry.bytes_per_token_per_block()
