"""When the batcher runs what (the setting: ``test_batches.py``): a cancelled step ends after its
batch, sessions due back join the next batch, sessions run in as many groups as their chain keeps
busy, a failure of the batcher fails only the waiting steps, and pushed steps run in their bursts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tests.server.batching.bench import WAIT, Plan, assert_close, solo

pytestmark = pytest.mark.timeout(60)


def test_a_step_cancelled_while_its_batch_runs_ends_only_after_the_batch(span, server_factory):
    """A session torn down mid-step (its task cancelled: the client vanished, the server leaves)
    frees its pages only once the compute thread stopped writing them: the cancelled step waits
    for its batch to end, then ends cancelled. A step cancelled while still queued never runs."""
    plan = Plan(batch=1, max_length=16, prompt=3, decode=0, seed=12)
    server = server_factory(max_batch=8)
    batcher = server.backend.batcher
    entered, release = threading.Event(), threading.Event()

    class HeldSpan:
        """The span, its batched forward held until ``release`` (so the batch is running)."""

        def __getattr__(self, name):
            return getattr(span, name)

        def forward_steps(self, steps):
            entered.set()
            assert release.wait(WAIT)
            return span.forward_steps(steps)

    batcher.span = HeldSpan()
    hidden, positions, mask, past = plan.steps()[0]

    async def scenario() -> None:
        running = asyncio.create_task(server.backend.run(hidden, positions, mask, server.cache(plan), past))
        assert await asyncio.to_thread(entered.wait, WAIT)
        queued = asyncio.create_task(server.backend.run(hidden, positions, mask, server.cache(plan), past))
        await asyncio.sleep(0)  # queued behind the running batch
        queued.cancel()
        running.cancel()
        await asyncio.sleep(0.1)
        assert queued.cancelled() and not running.done()  # waits for the compute thread
        release.set()
        await asyncio.wait_for(asyncio.wait([running]), WAIT)
        assert running.cancelled()

    asyncio.run(scenario())
    assert batcher.batches == 1 and batcher.batched_steps == 1  # the queued step was dropped unrun


class SlowSpan:
    """The span, each batched forward made to take at least ``seconds`` (a lone step's cost the
    merge wait is counted in)."""

    def __init__(self, span, seconds: float):
        self.span, self.seconds = span, seconds

    def __getattr__(self, name):
        return getattr(self.span, name)

    def forward_steps(self, steps):
        time.sleep(self.seconds)
        return self.span.forward_steps(steps)


def test_sessions_due_back_join_the_batch_a_free_thread_would_start_without_them(span, server_factory):
    """Three sessions of one peer were away about 30 ms each; this round the first comes back on
    time and the others 30 ms late. The free compute thread waits for them (they were due) and runs
    the three as ONE batch, each still its solo output. A lone step never waits: nobody is due."""
    plans = [Plan(batch=1, max_length=16, prompt=1, decode=3 if i == 0 else 2, seed=20 + i) for i in range(3)]
    server = server_factory(max_batch=8, merge_wait=4.0)  # a window of 4 lone steps (~0.2 s here)
    batcher = server.backend.batcher
    batcher.span = SlowSpan(span, 0.05)
    caches = [server.cache(plan) for plan in plans]
    pending = [iter(plan.steps()) for plan in plans]
    outs: list[list[torch.Tensor]] = [[] for _ in plans]

    async def step(i: int, delay: float = 0.0) -> None:
        await asyncio.sleep(delay)
        hidden, positions, mask, past = next(pending[i])
        outs[i].append(await server.backend.run(hidden, positions, mask, caches[i], past, peer="one-peer"))

    async def held_round() -> None:
        """Every session's next step, queued behind a held thread: one batch."""
        release = server.hold()
        tasks = [asyncio.create_task(step(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT)

    async def scenario() -> int:
        await step(0)  # alone: a lone step's cost measured, nobody due: no wait
        assert batcher.merge_waits == 0
        await held_round()
        await asyncio.sleep(0.03)
        await held_round()  # every session away ~30 ms
        before = batcher.batches
        await asyncio.wait_for(asyncio.gather(step(0, 0.03), step(1, 0.06), step(2, 0.06)), WAIT)
        return before

    before = asyncio.run(scenario())
    assert batcher.batches == before + 1 and batcher.merge_waits == 1
    for plan, out in zip(plans, outs, strict=True):
        assert_close(torch.cat(out, dim=1), solo(span, plan))


class CostlySpan:
    """The span, each batched forward made to take ``base + per_row * rows`` seconds at least: a
    CPU's costs, where more rows cost more (the tiny model itself takes about a millisecond)."""

    def __init__(self, span, base: float, per_row: float):
        self.span, self.base, self.per_row = span, base, per_row
        self.rows: list[int] = []  # each batch's rows, in order

    def __getattr__(self, name):
        return getattr(self.span, name)

    def forward_steps(self, steps):
        rows = sum(step.hidden.shape[0] for step in steps)
        self.rows.append(rows)
        time.sleep(self.base + self.per_row * rows)
        return self.span.forward_steps(steps)


@pytest.mark.parametrize(("away", "groups"), [(0.14, 2), (0.0, 1)], ids=["two-server-chain", "lone-server"])
def test_sessions_run_in_as_many_groups_as_their_chain_keeps_busy(span, server_factory, away, groups):
    """Four sessions whose steps are away as long as a batch of all four takes here (a second
    server like this one) split into two groups of two: while one group is away, the other runs
    (two batches of 2 cost 2 x 0.05 s a round, one of 4 then idle on the other server 2 x 0.07 s).
    A lone server's sessions, back at once, stay one batch of four. Each output is its solo run's."""
    plans = [Plan(batch=1, max_length=16, prompt=2, decode=10, seed=30 + i) for i in range(4)]
    server = server_factory(max_batch=8)
    batcher = server.backend.batcher
    batcher.span = costly = CostlySpan(span, base=0.06, per_row=0.02)
    outputs = asyncio.run(server.concurrently(plans, timeout=4 * WAIT, away=away))  # one peer's sessions
    for plan, out in zip(plans, outputs, strict=True):
        assert_close(out, solo(span, plan))
    assert batcher.groups == groups
    assert costly.rows[-6:-1] == [4 // groups] * 5, costly.rows  # the last rounds (the very last may be cut short)
    assert batcher.counters()["batch_groups"] == groups
    assert batcher.regroupings == (groups > 1)


def test_a_failure_of_the_batcher_itself_fails_the_waiting_steps_and_it_serves_on(span, server_factory):
    """Not a step's error (those fail their own step): the batcher's own bookkeeping raising. Every
    step waiting then fails with that error instead of hanging, and the next step runs as usual."""
    plans = [Plan(batch=1, max_length=16, prompt=3, decode=0, seed=40 + i) for i in range(3)]
    server = server_factory(max_batch=8)
    batcher = server.backend.batcher
    broken = RuntimeError("bookkeeping broke")

    def depth(now: float) -> float:
        raise broken

    batcher.arrivals.depth = depth  # the next batch's grouping raises
    outcomes = asyncio.run(server.concurrently(plans, return_exceptions=True))
    assert all(outcome is broken for outcome in outcomes), outcomes
    del batcher.arrivals.depth
    plan = plans[0]
    assert_close(asyncio.run(server.drive(plan)), solo(span, plan))


def test_steps_pushed_by_the_previous_server_run_in_the_bursts_they_come_in(span, server_factory):
    """The server a chain's client talks to groups its sessions; the next one follows: the same four
    sessions as in a two-server chain, their steps pushed on together, run as one batch each time
    (no grouping of its own that the first server's could contradict)."""
    plans = [Plan(batch=1, max_length=16, prompt=2, decode=10, seed=30 + i) for i in range(4)]
    server = server_factory(max_batch=8)
    batcher = server.backend.batcher
    batcher.span = costly = CostlySpan(span, base=0.06, per_row=0.02)
    outputs = asyncio.run(server.concurrently(plans, timeout=4 * WAIT, away=0.14, pushed=True))
    for plan, out in zip(plans, outputs, strict=True):
        assert_close(out, solo(span, plan))
    assert costly.rows[-6:-1] == [4] * 5, costly.rows
    assert batcher.groups == 1 and batcher.regroupings == 0
