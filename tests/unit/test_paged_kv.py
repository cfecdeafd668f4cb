"""The paged KV cache and batched steps: pages taken as a session grows, shared and copied on write,
and one batched forward of sessions at different positions (with different token counts, batch sizes
and masks) equal to each session's steps alone, for every family layout (plain, sliding windows,
Gemma's per-type rotary, Falcon's alibi and grouped heads)."""

from __future__ import annotations

import pytest
import torch

from shoal.checkpoints import load_config, load_tensors, span_tensor_filter
from shoal.models import get_family
from shoal.models.base import CacheGeometry
from shoal.models.kv import CachedStep, PackedSteps, PagedCache, PagePool, PagesExhausted
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

ATOL = 1e-4  # fp32, hidden states of order 1 (the usual init)
GEOMETRY = CacheGeometry(num_kv_heads=2, head_dim=4, dtype=torch.float32)
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 6},
    "gemma3": {"sliding_window": 6},
    "falcon_alibi": {},
    "falcon_new_arch": {},
}


def test_pool_hands_out_zeroed_pages_and_takes_them_back():
    pool = PagePool(2, GEOMETRY, page_size=4, num_pages=3, device="cpu")
    first = pool.allocate()
    pool.keys[0][first * 4 : first * 4 + 4] = float("nan")  # a session's garbage
    pool.release(first)
    assert pool.free_pages == 3 and pool.in_use == 0
    again = [pool.allocate() for _ in range(3)]
    assert sorted(again) == [1, 2, 3] and pool.free_pages == 0
    assert all(torch.isfinite(pool.keys[0][p * 4 : p * 4 + 4]).all() for p in again)  # zeroed when handed out
    with pytest.raises(PagesExhausted, match="all 3 KV pages of 4 positions are in use"):
        pool.allocate()
    with pytest.raises(ValueError, match="released more often than held"):
        pool.release(again[0]) or pool.release(again[0])


def test_cache_takes_pages_as_it_grows_all_or_nothing():
    pool = PagePool(1, GEOMETRY, page_size=4, num_pages=5, device="cpu")
    cache = PagedCache(pool, batch_size=2, max_length=4096)
    assert cache.pages_held() == 0
    cache.prepare(0, 5)  # 2 pages per row
    assert [len(t) for t in cache.tables] == [2, 2] and pool.free_pages == 1
    cache.length = 5
    with pytest.raises(PagesExhausted, match="needs 2 more KV pages"):
        cache.prepare(5, 9)  # one more page per row: 2 needed, 1 free
    assert [len(t) for t in cache.tables] == [2, 2] and pool.free_pages == 1  # nothing taken
    cache.truncate(3)  # back into the first page: the second goes back
    assert [len(t) for t in cache.tables] == [1, 1] and cache.length == 3 and pool.free_pages == 3
    cache.close()
    assert pool.free_pages == 5 and cache.nbytes() == 0


def test_a_shared_page_is_copied_before_it_is_written():
    pool = PagePool(1, GEOMETRY, page_size=4, num_pages=4, device="cpu")
    owner = PagedCache(pool, 1, 16)
    owner.prepare(0, 4)
    page = owner.tables[0][0]
    pool.keys[0][page * 4 : page * 4 + 4] = 7.0
    owner.length = 4
    reader = PagedCache(pool, 1, 16)
    reader.adopt(0, [page])
    reader.length = 4
    assert pool.refcount(page) == 2
    reader.prepare(2, 3)  # rolls back into the shared page: a private copy, the owner's stays
    copy = reader.tables[0][0]
    assert copy != page and pool.refcount(page) == 1
    assert torch.equal(pool.keys[0][copy * 4 : copy * 4 + 4], pool.keys[0][page * 4 : page * 4 + 4])
    with pytest.raises(ValueError, match="partial page"):
        reader.adopt(0, [page])  # length 2 after the rollback: not on a page boundary


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def spans(request, tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, initializer_range=0.02,
                           **FAMILIES[request.param])  # fmt: skip
    config = load_config(path)
    family = get_family(config)
    return [family.build_span(config, a, b, load_tensors(path, span_tensor_filter(config, a, b)), torch.float32,
                              "cpu") for a, b in [(0, 2), (2, 4)]]  # fmt: skip


def _prefill(span, hidden, mask, pool, max_length):
    """A session of ``span`` on ``pool`` with ``hidden`` prefilled (solo)."""
    cache = PagedCache(pool, hidden.shape[0], max_length)
    positions = torch.arange(hidden.shape[1]).expand(hidden.shape[0], -1)
    span(hidden, positions, mask, cache, 0)
    return cache


def test_one_batched_forward_equals_each_session_alone(spans):
    """Three sessions on one pool: a left-padded batch of 2 mid-decode, a lone session prefilling a
    chunk of 9 past 5, one decoding past a page boundary. One forward_steps of all three equals each
    step run alone on a copy of its session (all through the same pool)."""
    span = spans[0]
    torch.manual_seed(0)
    width = span.config.hidden_size
    pool = span.allocate_pool(64, 4)
    mask_a = torch.ones(2, 12, dtype=torch.bool)
    mask_a[1, :3] = False  # left padding
    setups = [  # (prompt, prompt mask, step tokens, step mask or None)
        (torch.randn(2, 11, width), mask_a[:, :11], 1, mask_a),
        (torch.randn(1, 5, width), None, 9, None),
        (torch.randn(1, 16, width), None, 1, None),
    ]
    solo_out, steps = [], []
    for prompt, prompt_mask, n, step_mask in setups:
        batch, past = prompt.shape[0], prompt.shape[1]
        new = torch.randn(batch, n, width)
        positions = torch.arange(past, past + n).expand(batch, -1)
        alone = _prefill(span, prompt, prompt_mask, pool, 32)
        solo_out.append(span(new, positions, step_mask, alone, past))
        together = _prefill(span, prompt, prompt_mask, pool, 32)
        steps.append(CachedStep(new, positions, step_mask, together, past))
    outs = span.forward_steps(steps)
    for out, want, step in zip(outs, solo_out, steps, strict=True):
        assert out.shape == want.shape
        assert (out - want).abs().max().item() <= ATOL
        assert step.cache.length == step.past_length + step.hidden.shape[1]
    # the batched sessions go on alone exactly as the solo ones do (their caches hold the same)
    again = torch.randn(1, 1, width)
    nxt = steps[2]
    got = span(again, torch.tensor([[17]]), None, nxt.cache, 17)
    solo_cache = _prefill(span, setups[2][0], None, pool, 32)
    span(nxt.hidden, nxt.position_ids, None, solo_cache, 16)
    assert (got - span(again, torch.tensor([[17]]), None, solo_cache, 17)).abs().max().item() <= ATOL


def test_steps_of_different_pools_or_dtypes_do_not_batch(spans):
    span = spans[0]
    caches = [PagedCache(span.allocate_pool(4, 4), 1, 8) for _ in range(2)]
    width = span.config.hidden_size
    steps = [CachedStep(torch.randn(1, 1, width), torch.zeros(1, 1, dtype=torch.long), None, c, 0) for c in caches]
    with pytest.raises(ValueError, match="share a page pool"):
        span.forward_steps(steps)
    pool = span.allocate_pool(4, 4)
    mixed = [CachedStep(torch.randn(1, 1, width, dtype=dtype), torch.zeros(1, 1, dtype=torch.long), None,
                        PagedCache(pool, 1, 8), 0) for dtype in (torch.bfloat16, torch.float32)]  # fmt: skip
    with pytest.raises(ValueError, match="same dtype"):  # one input buffer would round the fp32 step
        span.forward_steps(mixed)


def test_a_step_stores_the_pools_heads_and_hands_back_what_it_was_given():
    """A layer may hand over one key/value per kv head, or each repeated for its query heads (Falcon's
    new architecture in older transformers): the pool keeps one per kv head either way, and ``update``
    returns the same heads it was given; a count that is no multiple of the pool's is refused."""
    pool = PagePool(1, GEOMETRY, page_size=4, num_pages=4, device="cpu")
    grouped = torch.randn(1, 2, 3, 4)  # [rows, kv heads, new positions, head dim]
    repeated = grouped.repeat_interleave(3, dim=1)  # 6 query heads, 3 to a group
    returned = {}
    for name, keys in (("grouped", grouped), ("repeated", repeated)):
        cache = PagedCache(pool, 1, 8)
        step = CachedStep(torch.zeros(1, 3, 8), torch.arange(3)[None], None, cache, 0)
        out_keys, out_values = PackedSteps([step], "cpu").cache_step(0).update(keys, -keys, 0)
        assert out_keys.shape[1] == keys.shape[1] and torch.equal(out_keys[:, :, :3], keys)
        assert torch.equal(out_values[:, :, :3], -keys)
        slots = [cache.tables[0][0] * 4 + i for i in range(3)]
        assert torch.equal(pool.keys[0][slots], grouped[0].transpose(0, 1))  # one per kv head stored
        returned[name] = out_keys
        cache.close()
    assert torch.equal(returned["repeated"], returned["grouped"].repeat_interleave(3, dim=1))
    cache = PagedCache(pool, 1, 8)
    step = CachedStep(torch.zeros(1, 3, 8), torch.arange(3)[None], None, cache, 0)
    with pytest.raises(ValueError, match="3 kv heads handed to a cache of 2 heads"):
        PackedSteps([step], "cpu").cache_step(0).update(torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4), 0)


def test_cli_page_size_default_is_the_kv_default():
    from shoal.cli.args import DEFAULT_PAGE_SIZE as CLI_DEFAULT
    from shoal.models.kv import DEFAULT_PAGE_SIZE

    assert CLI_DEFAULT == DEFAULT_PAGE_SIZE
