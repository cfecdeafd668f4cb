"""Fair sharing of a server by peers: the compute thread's classes round-robin by peer
(:class:`~shoal.server.scheduler.ComputeScheduler`), and batches filled round-robin by peer
(:class:`~shoal.server.step_queue.StepQueue`), so one peer with 24 sessions cannot starve another's one.

Order is made deterministic as in test_scheduler: a gate holds the worker until everything is queued.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from shoal.checkpoints import load_span
from shoal.models.kv import PagedCache
from shoal.server.backend import SpanBackend, compute_thread
from shoal.server.scheduler import ComputeScheduler, Priority
from shoal.server.step_queue import PendingStep, StepQueue
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.timeout(60)
WAIT = 10.0
INF, F, T = Priority.INFERENCE, Priority.FORWARD, Priority.TRAINING


@pytest.fixture
def scheduler():
    scheduler = ComputeScheduler(num_threads=1)
    yield scheduler
    scheduler.shutdown(wait=True, cancel_futures=True)


def hold(executor) -> threading.Event:
    """Hold the worker until the returned event is set."""
    entered, release = threading.Event(), threading.Event()
    executor.submit(lambda: (entered.set(), release.wait(WAIT)))
    assert entered.wait(WAIT)
    return release


def test_a_class_is_shared_round_robin_by_peer_each_peers_tasks_in_order(scheduler):
    """Peer a queues 4 forwards, then b 1 and c 2: b's and c's first run right after a's first,
    not after all of a's; anonymous work (no peer) takes turns as one more peer."""
    ran: list[str] = []
    release = hold(scheduler)
    queued = [("a", "a1"), ("a", "a2"), ("a", "a3"), ("a", "a4"), ("b", "b1"), ("c", "c1"), ("c", "c2"), (None, "n1")]
    futures = [scheduler.submit_as(F, ran.append, label, peer=peer) for peer, label in queued]
    assert scheduler.queued(F) == len(queued)
    release.set()
    for future in futures:
        future.result(WAIT)
    assert ran == ["a1", "b1", "c1", "n1", "a2", "c2", "a3", "a4"]


def test_priority_still_comes_before_peers_and_jumps_count_any_peers_oldest(scheduler):
    """A training chunk of peer a queued first, then forwards of b, then a step of c: the step runs
    first, then the forwards, then the chunk; each jumped the chunk (the oldest waiting training
    task, whichever peer's)."""
    ran: list[str] = []
    release = hold(scheduler)
    futures = [
        scheduler.submit_as(T, ran.append, "t-a", peer="a"),
        scheduler.submit_as(F, ran.append, "f-b1", peer="b"),
        scheduler.submit_as(F, ran.append, "f-b2", peer="b"),
        scheduler.submit_as(INF, ran.append, "i-c", peer="c"),
    ]
    release.set()
    for future in futures:
        future.result(WAIT)
    assert ran == ["i-c", "f-b1", "f-b2", "t-a"]
    jumped = scheduler.counts().jumped
    assert {pair: n for pair, n in jumped.items() if n} == {(INF, F): 1, (INF, T): 1, (F, T): 2}


class Cache:
    """What the queue reads of a session's cache: its identity and its page pool."""

    pool = "pool"


def pending(peer: str, rows: int = 1, tokens: int = 1, adapter: str | None = None, prompts: bool = False,
            cache: Cache | None = None) -> PendingStep:  # fmt: skip
    return PendingStep(torch.zeros(rows, tokens, 4), torch.zeros(rows, tokens, dtype=torch.long), None,
                       cache or Cache(), 0, torch.zeros(1) if prompts else None, adapter, peer)  # fmt: skip


def test_a_scarce_batch_is_shared_round_robin_by_peer():
    """24 waiting steps of one peer, 1 of another, 8 rows a batch: the lone step joins the first
    batch beside 7 of the big peer's; every later batch takes the lone peer's next step too (it is
    back in the queue before each), and the lone peer is never deferred."""
    queue = StepQueue()
    big = [pending("big") for _ in range(24)]
    for step in big:
        queue.add(step)
    for batch_index in range(3):
        lone = pending("lone")
        queue.add(lone)
        batch = queue.take(max_rows=8, max_positions=100)
        assert lone in batch and len(batch) == 8
        assert [s for s in batch if s is not lone] == big[7 * batch_index : 7 * (batch_index + 1)]  # FIFO per peer
        for step in big[7 * batch_index : 7 * (batch_index + 1)]:  # the big peer's sessions step again
            queue.add(step)
    assert queue.deferred_by_peer == {"big": 17 * 3}
    assert queue.deferred == 51


def test_a_batch_takes_one_adapter_no_deep_prompts_no_cache_twice_within_its_limits():
    queue = StepQueue()
    shared = Cache()
    steps = {
        "first": pending("a", rows=2, tokens=3, cache=shared),
        "same-cache": pending("a", cache=shared),  # the session's next chunk cannot run beside its first
        "other-adapter": pending("b", adapter="lora"),
        "prompts": pending("c", prompts=True),
        "too-many-rows": pending("d", rows=7),
        "too-many-positions": pending("e", rows=1, tokens=7),
        "fits": pending("f", rows=2, tokens=2),
    }
    for step in steps.values():
        queue.add(step)
    batch = queue.take(max_rows=8, max_positions=12)
    assert batch == [steps["first"], steps["fits"]]
    assert queue.deferred == len(steps) - 2
    alone = queue.take(max_rows=8, max_positions=12)  # peer a went to the back: b's adapter step leads
    assert alone == [steps["other-adapter"]]
    assert queue.take(max_rows=8, max_positions=12) == [steps["prompts"]]  # deep prompts: alone
    over = queue.take(max_rows=4, max_positions=4)  # the first step always runs, even past the limits
    assert over == [steps["too-many-rows"]]


def test_a_cancelled_step_leaves_the_queue_uncounted():
    queue = StepQueue()
    gone, kept = pending("a"), pending("b")
    queue.add(gone)
    queue.add(kept)
    assert gone.future.cancel()
    assert queue.take(max_rows=8, max_positions=8) == [kept] and len(queue) == 0 and queue.deferred == 0


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    span, _ = load_span(tiny_checkpoint(tmp_path_factory.mktemp("tiny-fairness")), 0, 2)
    return span


def test_one_peer_with_24_sessions_cannot_starve_another_peers_one(span):
    """Through a real backend, max_batch 8: 24 sessions of one peer and 1 of another decode 5 steps
    each, all at once. Whenever the lone session's step waits, it joins the next batch: it is never
    deferred, while the big peer's steps are; its outputs equal its run alone."""
    executor = compute_thread(1)
    backend = SpanBackend(span, 64, executor=executor, max_batch=8)
    pool = executor.submit(span.allocate_pool, 25, 16).result(WAIT)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 6, 64, generator=generator) * 0.3 for _ in range(25)]

    async def session(index: int, peer: str, cache: PagedCache) -> torch.Tensor:
        outs = []
        for position in range(6):
            hidden = inputs[index][:, position : position + 1]
            outs.append(await backend.run(hidden, torch.tensor([[position]]), None, cache, position, peer=peer))
        return torch.cat(outs, dim=1)

    async def everyone() -> list[torch.Tensor]:
        release = hold(executor)
        caches = [PagedCache(pool, 1, 16) for _ in range(25)]
        tasks = [asyncio.create_task(session(i, "big", caches[i])) for i in range(24)]
        tasks.append(asyncio.create_task(session(24, "lone", caches[24])))
        await asyncio.sleep(0)
        release.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), WAIT)

    try:
        outputs = asyncio.run(everyone())
        deferred = backend.batcher.deferred_by_peer
        alone_cache = span.allocate_cache(1, 16)
        with torch.inference_mode():
            alone_cache.prepare(0, 6)
            alone = span(inputs[24], torch.arange(6)[None], None, cache=alone_cache, past_length=0)
    finally:
        backend.shutdown()
    assert deferred.get("lone", 0) == 0 and deferred["big"] > 0
    assert backend.batcher.batch_rows_max == 8
    scale = float(alone.abs().max())
    assert float((outputs[24] - alone).abs().max()) <= 1e-4 * max(1.0, scale)


def test_contended_batches_stay_within_their_cost_in_lone_steps():
    """BatchCosts: a lone step measured at 10 ms, 2 positions at 12, 4 at 14, 8 at 22: at 1.5x a lone
    step batches may take 4 positions (8 cost 2.2x); unmeasured sizes are allowed (trying measures
    them); nothing measured yet: no limit but the batcher's own."""
    from shoal.server.pacing import BatchCosts

    costs = BatchCosts()
    assert costs.limit(1.5, 32) == 32
    for positions, seconds in ((1, 0.010), (2, 0.012), (3, 0.014), (8, 0.022)):
        costs.record(positions, seconds)
    assert costs.limit(1.5, 32) == 4
    assert costs.limit(3.0, 32) == 32  # 16 and 32 not measured: allowed
    assert costs.limit(3.0, 8) == 8
    costs.record(16, 0.040)
    assert costs.limit(3.0, 32) == 8


def test_a_peer_whose_queue_emptied_is_first_when_it_is_back():
    """Peer b's single session is away (on the rest of the chain) while a's many steps run; when b's
    next step comes back, the round starts with b, served least recently, not behind a."""
    queue = StepQueue()
    many = [pending("a") for _ in range(4)]
    lone = pending("b")
    for step in [*many, lone]:
        queue.add(step)
    assert queue.take(max_rows=2, max_positions=2) == [many[0], lone]
    assert queue.take(max_rows=1, max_positions=1) == [many[1]]  # b away: a alone
    back = pending("b")
    queue.add(back)  # queued after a's, served first
    assert queue.take(max_rows=1, max_positions=1) == [back]
