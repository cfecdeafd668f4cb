"""The prefix cache (shoal.server.prefix) on a real page pool with a toy span: a "model" whose output at a
position is its input plus the sum of every earlier visible input read back from the KV pages, so a page
adopted with the wrong contents, or written while shared, shows in the outputs."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from shoal.models.base import CacheGeometry
from shoal.models.kv import PagedCache, PagePool, PagesExhausted
from shoal.server.prefix import PrefixIndex, SessionPrefix, prefix_seed
from shoal.verify.state import chain_states

P = 4  # positions a page
H = 3  # hidden size


class ToySpan:
    """Writes each position's input into the pool's keys and answers input + sum of visible earlier keys."""

    def __init__(self, pool: PagePool):
        self.pool, self.computed = pool, 0

    def run_for(self, cache: PagedCache):
        async def run(hidden, position_ids, mask, past):
            n = hidden.shape[1]
            cache.prepare(past, past + n)
            keys = self.pool.keys[0]
            out = torch.empty_like(hidden)
            for r in range(hidden.shape[0]):
                for i in range(n):
                    p = past + i
                    keys[cache.tables[r][p // P] * P + p % P, 0] = hidden[r, i]
                    seen = [cache.tables[r][j // P] * P + j % P for j in range(p) if mask is None or mask[r, j]]
                    out[r, i] = hidden[r, i] + (keys[seen, 0].sum(0) if seen else 0)
            cache.length = past + n
            self.computed += n
            return out

        return run


def pool_of(pages: int) -> PagePool:
    return PagePool(1, CacheGeometry(1, H, torch.float32), P, pages, "cpu")


def seed(dtype: torch.dtype) -> bytes:
    return prefix_seed(0, 2, None, dtype, H)


def inputs(n: int, batch: int = 1, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + salt)
    return torch.randn(batch, n, H, generator=g), torch.arange(n).repeat(batch, 1)


class Swarmless:
    """One server's pool, index and toy span; sessions on it."""

    def __init__(self, pages: int = 32):
        self.pool = pool_of(pages)
        self.index = PrefixIndex(self.pool)
        self.span = ToySpan(self.pool)

    def open(self, peer: str = "a", batch: int = 1, share: int = 0) -> tuple[PagedCache, SessionPrefix]:
        return PagedCache(self.pool, batch, 64), SessionPrefix(batch, P, seed, peer, share)

    def step(self, session, position, hidden, position_ids, mask=None):
        cache, prefix = session
        return asyncio.run(
            prefix.step(self.index, cache, position, hidden, position_ids, mask, self.span.run_for(cache))
        )


def alone(hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The toy span's answer without any cache sharing."""
    server = Swarmless()
    session = server.open(batch=hidden.shape[0])
    session[1].page_size = 10**6  # no full page ever: nothing registered or looked up
    return server.step(session, 0, hidden, position_ids)[0]


def test_page_digest_is_the_row_chain_at_the_page_end() -> None:
    hidden, positions = inputs(8)
    server = Swarmless()
    session = server.open()
    server.step(session, 0, hidden, positions)
    chain = chain_states(seed(torch.float32), hidden, positions, None)
    assert chain[(P - 1) * 16 : P * 16] in server.index and chain[(2 * P - 1) * 16 :] in server.index
    assert len(server.index) == 2
    seeds = {
        prefix_seed(0, 2, None, torch.float32, H),
        prefix_seed(0, 3, None, torch.float32, H),
        prefix_seed(0, 2, "lora", torch.float32, H),
        prefix_seed(0, 2, None, torch.float16, H),
    }
    assert len(seeds) == 4
    expected = hashlib.sha256(b"shoal/prefix/1\x000:2\x00\x00torch.float32\x003").digest()[:16]
    assert seed(torch.float32) == expected


def test_repeated_prefix_reuses_full_pages_and_answers_the_same_bytes() -> None:
    hidden, positions = inputs(10)
    server = Swarmless()
    first = server.open()
    out_first, reused = server.step(first, 0, hidden, positions)
    assert reused == 0 and server.span.computed == 10
    assert torch.allclose(out_first, alone(hidden, positions))
    pages = first[0].tables[0][:2]
    first[0].close()
    assert server.index.cached_pages() == 2 and server.pool.in_use == 2
    second = server.open()
    out_second, reused = server.step(second, 0, hidden, positions)
    assert reused == 2 * P and server.span.computed == 10 + 2  # only positions 8, 9 computed
    assert second[0].tables[0][:2] == pages and second[0].length == 10
    assert torch.equal(out_second, out_first)
    assert server.index.cached_pages() == 0  # the live session holds them too


def test_pages_filled_one_token_at_a_time_are_registered_with_their_outputs() -> None:
    hidden, positions = inputs(9)
    server = Swarmless()
    first = server.open()
    outs = [server.step(first, i, hidden[:, i : i + 1], positions[:, i : i + 1])[0] for i in range(9)]
    assert len(server.index) == 2
    second = server.open()
    out, reused = server.step(second, 0, hidden, positions)
    assert reused == 8
    assert torch.equal(out, torch.cat(outs, dim=1))


def test_forged_prefix_is_not_reused() -> None:
    hidden, positions = inputs(8)
    server = Swarmless()
    server.step(server.open(), 0, hidden, positions)
    forged = hidden.clone()
    forged[0, 5, 1] += 1.0  # page 1 differs: same positions, other hidden states
    out, reused = server.step(server.open(), 0, forged, positions)
    assert reused == P
    assert torch.allclose(out, alone(forged, positions))
    moved = server.step(server.open(), 0, hidden, positions + 1)[1]  # same bytes, other positions
    assert moved == 0


def test_other_peers_reuse_only_shared_pages() -> None:
    hidden, positions = inputs(8)
    server = Swarmless()
    server.step(server.open("a", share=P), 0, hidden, positions)  # page 0 shared, page 1 not
    out, reused = server.step(server.open("b"), 0, hidden, positions)
    assert reused == P
    assert torch.allclose(out, alone(hidden, positions))
    assert server.step(server.open("a"), 0, hidden, positions)[1] == 2 * P  # its own pages, shared or not
    # b computed page 1 itself: from now on b may reuse it, c still may not
    assert server.step(server.open("b"), 0, hidden, positions)[1] == 2 * P
    assert server.step(server.open("c"), 0, hidden, positions)[1] == P


def test_an_unshared_prefix_another_peer_sent_first_counts_as_new() -> None:
    """Two peers send the same inputs unshared: each keeps pages of its own, so what the counters
    show (pages cached) is the same whether or not someone sent that prefix before."""
    hidden, positions = inputs(8)
    alone, after = Swarmless(pages=64), Swarmless(pages=64)
    server_seen = []
    for server, peers in ((alone, ["attacker"]), (after, ["victim", "attacker"])):
        for peer in peers:
            cache, _ = session = server.open(peer)
            before = server.index.cached_pages()
            _, reused = server.step(session, 0, hidden, positions)
            cache.close()
            assert reused == 0
        server_seen.append(server.index.cached_pages() - before)
    assert server_seen[0] == server_seen[1] > 0


def test_a_hit_needs_every_row() -> None:
    hidden, positions = inputs(8, batch=2)
    server = Swarmless()
    server.step(server.open(batch=2), 0, hidden, positions)
    assert len(server.index) == 4
    mixed = hidden.clone()
    mixed[1, 2] += 1.0  # row 1's page 0 differs: no page hits (row 0 alone would)
    out, reused = server.step(server.open(batch=2), 0, mixed, positions)
    assert reused == 0
    assert torch.allclose(out, alone(mixed, positions))
    out, reused = server.step(server.open(batch=2), 0, hidden, positions)
    assert reused == 2 * P and torch.allclose(out, alone(hidden, positions))


def test_reclaim_frees_least_recently_used_deepest_pages_first() -> None:
    server = Swarmless(pages=6)
    old, new = inputs(8, salt=1), inputs(8, salt=2)
    for hidden, positions in (old, new):
        session = server.open()
        server.step(session, 0, hidden, positions)
        session[0].close()
    assert server.index.cached_pages() == 4 and server.pool.free_pages == 2
    live = server.open()
    server.step(live, 0, *inputs(12, salt=3))  # 3 pages: takes the 2 free ones and the LRU page
    assert server.pool.free_pages == 0 and len(server.index) == 3 + 3
    # the old chain lost its second page (deepest first), kept its first
    assert server.step(server.open(), 0, *old)[1] == P
    # the pool is full of live and cached pages: a live session's pages are never reclaimed
    assert server.index.reclaim(10) > 0
    assert all(server.pool.refcount(page) >= 1 for page in live[0].tables[0])
    assert server.step(live, 12, *[t[:, 12:] for t in inputs(16, salt=3)])[0].shape == (1, 4, H)


def test_pool_exhausted_when_only_live_pages_are_left() -> None:
    server = Swarmless(pages=2)
    live = server.open()
    server.step(live, 0, *inputs(8))
    with pytest.raises(PagesExhausted):
        server.step(server.open(), 0, *inputs(4, salt=5))
    assert len(server.index) == 2 and live[0].length == 8


def test_rollback_into_a_shared_page_copies_it() -> None:
    hidden, positions = inputs(8)
    server = Swarmless()
    first = server.open()
    out_first = server.step(first, 0, hidden, positions)[0]
    second = server.open()
    assert server.step(second, 0, hidden, positions)[1] == 2 * P
    shared = second[0].tables[0][1]
    other = inputs(8, salt=9)[0]
    out, reused = server.step(second, 6, other[:, 6:], positions[:, 6:])  # into page 1, other inputs
    assert reused == 0 and second[0].tables[0][1] != shared
    assert torch.allclose(out, alone(torch.cat([hidden[:, :6], other[:, 6:]], 1), positions)[:, 6:])
    # the first session and the cache still see the original page
    assert server.pool.refcount(shared) == 2
    nxt = torch.randn(1, 1, H, generator=torch.Generator().manual_seed(7))
    got = server.step(first, 8, nxt, torch.tensor([[8]]))[0]
    assert torch.allclose(got, alone(torch.cat([hidden, nxt], 1), torch.arange(9)[None])[:, 8:])
    third = server.open()
    assert torch.equal(server.step(third, 0, hidden, positions)[0], out_first)
    # the rolled-back session's new page 1 is registered too, its first rows from the page it replaced
    replaced = torch.cat([hidden[:, :6], other[:, 6:]], 1)
    out, reused = server.step(server.open(), 0, replaced, positions)
    assert reused == 2 * P and torch.allclose(out, alone(replaced, positions))


def test_a_changed_past_mask_or_dtype_stops_the_chain() -> None:
    hidden, positions = inputs(8)
    server = Swarmless()
    session = server.open()
    server.step(session, 0, hidden[:, :4], positions[:, :4])
    assert len(server.index) == 1
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, 1] = False  # position 1 was computed visible: keys/values from here differ from the chain's
    server.step(session, 4, hidden[:, 4:], positions[:, 4:], mask)
    assert len(server.index) == 1 and session[1].known == 4
    server.step(session, 8, *inputs(4, salt=3))  # past what the chain knows: untracked
    assert len(server.index) == 1
    server.step(session, 4, hidden[:, 4:], positions[:, 4:])  # rolled back before the break: tracked again
    assert len(server.index) == 2
    half = server.open()
    server.step(half, 0, hidden[:, :4], positions[:, :4])
    server.step(half, 4, hidden[:, 4:].half().float().half(), positions[:, 4:])  # fp16 bytes: another dtype
    assert half[1].known == 4


def test_a_failed_step_keeps_the_chain_at_its_position() -> None:
    hidden, positions = inputs(8)
    server = Swarmless()
    first = server.open()
    server.step(first, 0, hidden, positions)
    first[0].close()
    cache, prefix = server.open()

    async def broken(*args):
        raise RuntimeError("compute failed")

    with pytest.raises(RuntimeError):
        asyncio.run(prefix.step(server.index, cache, 0, hidden[:, :6], positions[:, :6], None, broken))
    assert cache.length == 0 and cache.pages_held() == 0 and prefix.known == 0  # the hit page went back
    assert server.index.cached_pages() == 2 and server.pool.in_use == 2


def test_clear_gives_every_page_back() -> None:
    server = Swarmless()
    session = server.open()
    server.step(session, 0, *inputs(8))
    session[0].close()
    server.index.clear()
    assert len(server.index) == 0 and server.pool.free_pages == server.pool.num_pages
