"""Continuous batching (:mod:`shoal.server.batching`) through a real :class:`SpanBackend` of a tiny llama.

Sessions with different batch sizes, prompt lengths, ``max_length``\\ s and padding step concurrently
through one backend; each session's outputs must equal its solo run (the same span, one session at a
time, each on a cache of its own) within 1e-4 of the outputs' scale in fp32: the tiny model's large
init grows the residual stream to ~100 over 4 blocks, where a batched matmul's different summation
order alone moves values by ~3e-6 of that (measured), while one session through the backend is
bitwise its solo run. (Logits, after the final norm, are held to 1e-4 absolute in the swarm test,
tests/integration/test_batched_swarm.py.) Batching is made deterministic by a gate: a
task holds the compute thread until every session's first step is queued, so the first batch holds
them all. Also: max_batch 1 runs one step per forward; a long prefill runs in chunks that equal the
unchunked run while another session's decode step runs beside the first chunk; a step whose pages
run out is "busy" alone and the server serves afterwards; a step the span refuses is a bad request
alone; an idle server's lone step runs at once; sessions whose chain keeps two of this server's
batches busy run in two groups, a lone server's in one; a failure of the batcher itself fails the
waiting steps and the batcher serves on (those last, with cancelled and pushed steps:
``test_scheduling.py``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from shoal.errors import BadRequest, BusyError
from tests.server.batching.bench import HIDDEN, PLANS, WAIT, Plan, assert_close, solo

pytestmark = pytest.mark.timeout(60)


def test_concurrent_sessions_equal_their_solo_runs_and_run_in_batches(span, server_factory):
    server = server_factory(max_batch=32, prefill_chunk=128)
    outputs = asyncio.run(server.concurrently(PLANS))
    for plan, out in zip(PLANS, outputs, strict=True):
        assert_close(out, solo(span, plan))
    batcher = server.backend.batcher
    steps = sum(1 + p.decode for p in PLANS)
    assert batcher.batched_steps == steps
    assert batcher.batch_steps_max == len(PLANS)  # the first batch: every prefill
    assert batcher.batch_rows_max == sum(p.batch for p in PLANS)
    assert batcher.batches < steps  # steps shared forwards
    assert batcher.prefill_chunks == 0  # nothing was cut
    # nothing was left out, but by a grouping: on a loaded CPU this test's driver can take as long
    # between steps as the tiny span takes for them, a chain two deep, and the sessions split in two
    assert batcher.steps_deferred == 0 or batcher.regroupings > 0
    counters = server.backend.compute_counters()
    assert {k: counters[k] for k in ("batches", "batched_steps", "batch_rows_max", "steps_deferred")} == {
        "batches": batcher.batches, "batched_steps": steps, "batch_rows_max": 7,
        "steps_deferred": batcher.steps_deferred,
    }  # fmt: skip


def test_max_batch_one_runs_every_step_alone(span, server_factory):
    server = server_factory(max_batch=1)
    outputs = asyncio.run(server.concurrently(PLANS))
    for plan, out in zip(PLANS, outputs, strict=True):
        assert_close(out, solo(span, plan))
    batcher, steps = server.backend.batcher, sum(1 + p.decode for p in PLANS)
    assert batcher.batches == batcher.batched_steps == steps
    assert batcher.batch_steps_max == 1 and batcher.batch_rows_max == 3  # a session of 3 rows still runs
    assert batcher.steps_deferred >= len(PLANS) - 1  # the first batch took one of the four queued prefills


def test_a_chunked_prefill_equals_the_unchunked_run_and_a_decode_step_runs_beside_it(span, server_factory):
    """Prefill of 2 rows x 30 tokens with prefill_chunk 8: chunks of 4 tokens, 8 of them. A decode
    step of another session (of the same peer: peers competing keep batches short, see
    test_fairness), queued with the first chunk, is done before the prefill is."""
    long = Plan(batch=2, max_length=40, prompt=30, decode=2, seed=5, padding=(2, 0), peer="peer-a")
    short = Plan(batch=1, max_length=20, prompt=3, decode=1, seed=6, peer="peer-a")
    server = server_factory(max_batch=4, prefill_chunk=8)
    short_cache = server.cache(short)
    hidden, positions, mask, _ = short.steps()[0]
    asyncio.run(server.backend.run(hidden, positions, mask, short_cache, 0, peer=short.peer))  # its prefill: one task

    async def race() -> tuple[list[str], torch.Tensor, torch.Tensor]:
        done: list[str] = []
        release = server.hold()
        prefill = asyncio.create_task(server.drive(long))
        hidden, positions, mask, past = short.steps()[1]
        decode = asyncio.create_task(server.backend.run(hidden, positions, mask, short_cache, past, peer=short.peer))
        for name, task in (("prefill", prefill), ("decode", decode)):
            task.add_done_callback(lambda _, name=name: done.append(name))
        await asyncio.sleep(0)
        release.set()
        return done, *await asyncio.wait_for(asyncio.gather(prefill, decode), WAIT)

    done, out, decoded = asyncio.run(race())
    assert done == ["decode", "prefill"]
    assert_close(out, solo(span, long))
    assert_close(decoded, solo(span, short)[:, -1:])
    batcher = server.backend.batcher
    assert batcher.prefill_chunks == 8
    assert batcher.batch_steps_max == 2  # the first chunk and the decode step shared a forward


def test_a_step_whose_pages_run_out_is_busy_alone_and_the_server_serves_afterwards(span, server_factory):
    """4 pages of 16: the small session's prefill takes 1, the big one's (60 positions) needs 4 more."""
    small = Plan(batch=1, max_length=16, prompt=10, decode=0, seed=7, peer="peer-a")
    big = Plan(batch=1, max_length=64, prompt=60, decode=0, seed=8, peer="peer-b")
    server = server_factory(num_pages=4, max_batch=8, prefill_chunk=128)
    small_cache, big_cache = server.cache(small), server.cache(big)

    async def both() -> list:
        release = server.hold()
        pairs = ((small, small_cache), (big, big_cache))
        tasks = [asyncio.create_task(server.drive(plan, cache)) for plan, cache in pairs]
        await asyncio.sleep(0)
        release.set()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)

    small_out, big_out = asyncio.run(both())
    assert_close(small_out, solo(span, small))
    assert isinstance(big_out, BusyError) and "busy" in str(big_out)
    assert big_cache.length == 0 and big_cache.pages_held() == 0  # all or nothing: it holds no page
    server.executor.submit(small_cache.close).result(WAIT)  # its page goes back
    assert_close(asyncio.run(server.drive(big, big_cache)), solo(span, big))
    assert big_cache.length == 60 and big_cache.pages_held() == 4


def test_a_step_the_span_refuses_is_a_bad_request_alone(span, server_factory):
    """A step at past_length 5 of a cache that holds nothing fails; the step batched with it does not."""
    good = Plan(batch=1, max_length=16, prompt=4, decode=0, seed=9)
    server = server_factory(max_batch=8)
    bad_cache = server.cache(good)

    async def both() -> list:
        release = server.hold()
        hidden = torch.randn(1, 2, HIDDEN, generator=torch.Generator().manual_seed(10))
        bad = asyncio.create_task(server.backend.run(hidden, torch.tensor([[5, 6]]), None, bad_cache, 5, peer="x"))
        ok = asyncio.create_task(server.drive(good))
        await asyncio.sleep(0)
        release.set()
        return await asyncio.wait_for(asyncio.gather(bad, ok, return_exceptions=True), WAIT)

    bad, ok = asyncio.run(both())
    assert isinstance(bad, BadRequest) and "past_length 5" in str(bad)
    assert_close(ok, solo(span, good))


def test_an_idle_servers_lone_step_runs_at_once(span, server_factory):
    """No batching window: a step that finds the compute thread idle is a batch of one, as fast as
    the forward itself (plus the hop to the compute thread)."""
    plan = Plan(batch=1, max_length=16, prompt=1, decode=0, seed=11)
    server = server_factory(max_batch=32)
    hidden, positions, mask, _ = plan.steps()[0]
    cache = server.cache(plan)
    asyncio.run(server.backend.run(hidden, positions, mask, cache, 0))  # warm

    def direct() -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            cache.prepare(0, 1)
            span(hidden, positions, mask, cache=cache, past_length=0)
        return time.perf_counter() - started

    forward = min(server.executor.submit(direct).result(WAIT) for _ in range(5))

    async def timed() -> float:
        started = time.perf_counter()
        await server.backend.run(hidden, positions, mask, cache, 0)
        return time.perf_counter() - started

    through = min(asyncio.run(timed()) for _ in range(5))
    assert through < 3 * forward + 0.02, (through, forward)
    batcher = server.backend.batcher
    assert batcher.batches == batcher.batched_steps == 6 and batcher.steps_deferred == 0
