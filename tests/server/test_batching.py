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
waiting steps and the batcher serves on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from shoal.checkpoints import load_span
from shoal.errors import BadRequest, BusyError
from shoal.models.kv import PagedCache
from shoal.server.backend import SpanBackend, compute_thread
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.timeout(60)
HIDDEN = 64
PAGE = 16
ATOL = 1e-4
WAIT = 10.0
SCALE = 0.3  # the tiny model's embedding scale (its init)


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    span, _ = load_span(tiny_checkpoint(tmp_path_factory.mktemp("tiny-batching")), 0, 4)
    return span


@dataclass
class Plan:
    """One session: its rows, max_length, prompt and decode steps (random hidden states, seeded),
    the rows' left padding (masked out), and the peer it belongs to."""

    batch: int
    max_length: int
    prompt: int
    decode: int
    seed: int
    padding: tuple[int, ...] = ()
    peer: str = "peer-a"

    def steps(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]]:
        """``(hidden, position_ids, mask, past_length)`` of the prefill, then of each decode step."""
        generator = torch.Generator().manual_seed(self.seed)
        total = self.prompt + self.decode
        hidden = torch.randn(self.batch, total, HIDDEN, generator=generator) * SCALE
        mask = torch.ones(self.batch, total, dtype=torch.bool)
        for row, pad in enumerate(self.padding):
            mask[row, :pad] = False
        masked = bool(self.padding)
        bounds = [(0, self.prompt)] + [(p, p + 1) for p in range(self.prompt, total)]
        return [
            (hidden[:, a:b], torch.arange(a, b).expand(self.batch, -1), mask[:, :b] if masked else None, a)
            for a, b in bounds
        ]


PLANS = [
    Plan(batch=1, max_length=40, prompt=5, decode=6, seed=1),
    Plan(batch=2, max_length=64, prompt=24, decode=4, seed=2, padding=(0, 3)),
    Plan(batch=3, max_length=20, prompt=1, decode=8, seed=3),
    Plan(batch=1, max_length=50, prompt=33, decode=3, seed=4),
]


def pages_for(plans: list[Plan]) -> int:
    return sum(p.batch * -(-p.max_length // PAGE) for p in plans)


def solo(span, plan: Plan) -> torch.Tensor:
    """The session alone: every step through the span on a cache of its own, concatenated."""
    cache = span.allocate_cache(plan.batch, plan.max_length)
    outs = []
    with torch.inference_mode():
        for hidden, positions, mask, past in plan.steps():
            cache.prepare(past, past + hidden.shape[1])
            outs.append(span(hidden, positions, mask, cache=cache, past_length=past))
    return torch.cat(outs, dim=1)


class Server:
    """A backend on its own compute thread, its sessions' caches on one page pool."""

    def __init__(self, span, num_pages: int, **limits: int):
        self.executor = compute_thread(1)
        self.backend = SpanBackend(span, HIDDEN, executor=self.executor, **limits)
        self.pool = self.executor.submit(span.allocate_pool, num_pages, PAGE).result(WAIT)

    def cache(self, plan: Plan) -> PagedCache:
        return PagedCache(self.pool, plan.batch, plan.max_length)

    def hold(self) -> threading.Event:
        """Hold the compute thread until the returned event is set (steps queue up meanwhile)."""
        entered, release = threading.Event(), threading.Event()
        self.executor.submit(lambda: (entered.set(), release.wait(WAIT)))
        assert entered.wait(WAIT)
        return release

    async def drive(
        self, plan: Plan, cache: PagedCache | None = None, away: float | None = None, pushed: bool = False
    ) -> torch.Tensor:
        """The plan's session, step after step; ``away``: it spends that long after each step on the
        rest of its chain; ``pushed``: its steps come from a previous server, not its client."""
        cache = cache if cache is not None else self.cache(plan)
        outs = []
        for hidden, positions, mask, past in plan.steps():
            outs.append(await self.backend.run(hidden, positions, mask, cache, past, peer=plan.peer, pushed=pushed))
            if away is not None:
                await asyncio.sleep(away)
        return torch.cat(outs, dim=1)

    async def concurrently(
        self, plans: list[Plan], return_exceptions: bool = False, timeout: float = WAIT, **driving
    ) -> list[torch.Tensor]:
        """Every plan's session at once (:meth:`drive` with ``driving``), their first steps queued
        behind a held compute thread (``return_exceptions``: a session that failed gives its error
        instead of raising it)."""
        release = self.hold()
        tasks = [asyncio.create_task(self.drive(plan, **driving)) for plan in plans]
        await asyncio.sleep(0)  # every task queued its first step
        assert len(self.backend.batcher._queue) == len(plans)
        release.set()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=return_exceptions), timeout)

    def close(self) -> None:
        self.backend.shutdown()


@pytest.fixture
def server_factory(span):
    made: list[Server] = []

    def make(num_pages: int = pages_for(PLANS), **limits: int) -> Server:
        made.append(Server(span, num_pages, **limits))
        return made[-1]

    yield make
    for server in made:
        server.close()


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within :data:`ATOL` of the outputs' scale (their largest magnitude, at least 1)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    scale = max(1.0, float(expected.abs().max()))
    err = float((got - expected).abs().max())
    assert err <= ATOL * scale, f"max |diff| {err} > {ATOL} x {scale:.1f}"


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
