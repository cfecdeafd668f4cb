"""The blocks protocol handler under greedy, vanishing and idle clients and a drain: a session that
does not fit is busy, a gone or idle client's cache is freed, a draining server finishes what it
has and takes nothing new; the server keeps serving correct results afterwards (the setting:
``tests/server/handler/test_inputs.py``)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from shoal.errors import BusyError, ClosedError, Unavailable
from shoal.protocols import BLOCKS
from shoal.wire import Message
from shoal.wire.schema import BackwardRequest
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.servers import Session, forward, info, inputs, local_forward, wait_for_info
from tests.server.handler.bench import CACHE_TOKENS, HIDDEN, IDLE, PER_PEER, assert_same, assert_serving

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_server_errors")]


# ---- capacity --------------------------------------------------------------------------------------
def test_sessions_that_do_not_fit_the_cache_budget_are_busy(serve, span):
    """Budget 256 tokens = 16 pages of 16: a session commits the pages of its max_length (200: 13),
    then 100 (7 pages) do not fit (BusyError naming what is free) while 48 (3 pages) still do;
    closing the 200 makes room for the 100 again; the budget ends full. Each session steps once it
    is open, as clients do (one that never stepped gives its reservation to the next open that
    needs it: tests/attacks/test_peer_limits.py)."""
    bench = serve()

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        assert (await info(node, ticket)).free_cache_tokens == CACHE_TOKENS
        x = inputs(HIDDEN, 3, seed=8)
        big = await Session.open(node, ticket, max_length=200)
        await big.step(0, x)
        assert (await info(node, ticket)).free_cache_tokens == CACHE_TOKENS - 13 * 16
        with pytest.raises(BusyError, match=r"busy: a session of 1 x 100 positions needs 7 KV pages of 16, 3 of 16"):
            await Session.open(node, ticket, max_length=100)
        with pytest.raises(BusyError, match=r"busy: a session of 2 x 50 positions needs 8 KV pages of 16, 3 of 16"):
            await Session.open(node, ticket, max_length=50, batch_size=2)
        rest = await Session.open(node, ticket, max_length=48)
        await rest.step(0, x)
        assert (await info(node, ticket)).free_cache_tokens == 0
        with pytest.raises(BusyError, match=r"needs 1 KV pages of 16, 0 of 16 are free"):
            await Session.open(node, ticket, max_length=1)

        # the sessions that fit work
        assert_same(await rest.step(0, x), local_forward(span, x, span.allocate_cache(1, 48), 0))
        assert_same(await big.step(0, x), local_forward(span, x, span.allocate_cache(1, 4), 0))

        await big.close()
        again = await Session.open(node, ticket, max_length=100)
        assert (await info(node, ticket)).free_cache_tokens == CACHE_TOKENS - (3 + 7) * 16
        await again.close()
        await rest.close()

        after = await info(node, ticket)
        assert after.free_cache_tokens == CACHE_TOKENS
        assert after.counters.sessions_active == 0 and after.counters.sessions_rejected_busy == 3
        await assert_serving(node, ticket, span)

    bench.run(go())


def test_a_long_session_holds_only_the_pages_its_positions_need(serve, span):
    """A session opened for 4,096 positions (committed under --kv-overcommit) holds one page for its
    first 3 positions and a second once it passes 16; closing it gives back all but its full page."""
    bench = serve(cache_tokens=512, kv_overcommit=8.0)  # 32 pages: 4096 positions commit 256 of 256

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        long = await Session.open(node, ticket, max_length=4096)
        held = lambda reply: (reply.counters.kv_pages_in_use, reply.counters.kv_pages_total)  # noqa: E731
        assert held(await info(node, ticket)) == (0, 32)
        cache = span.allocate_cache(1, 40)
        x = inputs(HIDDEN, 3, seed=4)
        assert_same(await long.step(0, x), local_forward(span, x, cache, 0))
        assert held(await info(node, ticket)) == (1, 32)
        y = inputs(HIDDEN, 15, start=3, seed=5)
        assert_same(await long.step(3, y), local_forward(span, y, cache, 3))
        assert held(await info(node, ticket)) == (2, 32)
        await long.close()  # its one full page stays as prefix cache, the partial one goes back
        reply = await info(node, ticket)
        assert held(reply) == (1, 32) and reply.counters.prefix_cache_pages == 1

    bench.run(go())


def test_a_step_that_finds_no_page_is_busy_and_the_server_serves_on(serve, span):
    """Overcommitted 4x: three sessions of 64 positions are admitted to 8 pages. Two fill them; the
    third's first step finds no page and is answered "busy" (the session stays usable: once one of the
    others closed, its pages, kept as prefix cache, are reclaimed and the same step works), and the
    server serves on."""
    bench = serve(cache_tokens=128, kv_overcommit=4.0)  # 8 pages, 32 committable

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        first, second, third = [await Session.open(node, ticket, max_length=64) for _ in range(3)]
        await first.step(0, inputs(HIDDEN, 64, seed=6))  # 4 pages
        await second.step(0, inputs(HIDDEN, 64, seed=7))  # 4 pages: all 8 held
        x = inputs(HIDDEN, 2, seed=8)
        with pytest.raises(BusyError, match="busy"):
            await third.step(0, x)
        reply = await info(node, ticket)
        assert (reply.counters.kv_pages_in_use, reply.counters.kv_pages_total) == (8, 8)
        await first.close()  # its full pages stay as prefix cache, given back when a session needs them
        assert_same(await third.step(0, x), local_forward(span, x, span.allocate_cache(1, 2), 0))
        reply = await info(node, ticket)
        assert reply.counters.kv_pages_in_use == 8 and reply.counters.prefix_cache_pages == 3
        for session in (second, third):
            await session.close()
        await assert_serving(node, ticket, span)

    bench.run(go())


def test_more_sessions_than_the_per_peer_limit_are_busy(serve, span):
    """A peer's 4th session is refused (BusyError naming the limit) while another peer still gets
    one; closing one of the three frees a slot."""
    bench = serve()

    async def go():
        node, other_node = await bench.client(), await bench.client()
        ticket = bench.ticket()
        sessions = [await Session.open(node, ticket, max_length=8) for _ in range(PER_PEER)]
        with pytest.raises(BusyError, match=rf"peer already has {PER_PEER} open sessions \(limit {PER_PEER}\)"):
            await Session.open(node, ticket, max_length=8)
        other = await Session.open(other_node, ticket, max_length=8)
        x = inputs(HIDDEN, 2, seed=9)
        assert_same(await other.step(0, x), local_forward(span, x, span.allocate_cache(1, 8), 0))
        await other.close()

        await sessions.pop().close()
        sessions.append(await Session.open(node, ticket, max_length=8))
        assert_same(await sessions[-1].step(0, x), local_forward(span, x, span.allocate_cache(1, 8), 0))
        with pytest.raises(BusyError, match=r"limit 3"):
            await Session.open(node, ticket, max_length=8)
        for session in sessions:
            await session.close()
        reply = await info(node, ticket)
        assert reply.counters.sessions_active == 0 and reply.counters.sessions_rejected_busy == 2
        assert reply.free_cache_tokens == CACHE_TOKENS
        await assert_serving(node, ticket, span)

    bench.run(go())


# ---- vanishing and idle clients ----------------------------------------------------------------
def test_client_node_closed_mid_session_frees_its_cache(serve, span):
    """A client whose node closes abruptly (as a killed process's connection ends) while holding
    two sessions, one of them mid-use: both count as abandoned, their cache tokens are free again,
    and the server serves on."""
    bench = serve()

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        leaver = await bench.client()
        used = await Session.open(leaver, ticket, max_length=100)
        unused = await Session.open(leaver, ticket, max_length=20)
        await used.step(0, inputs(HIDDEN, 3))
        reply = await info(node, ticket)
        assert reply.free_cache_tokens == CACHE_TOKENS - (7 + 2) * 16 and reply.counters.sessions_active == 2
        assert reply.counters.kv_pages_in_use == 1  # what the 3 positions stepped hold
        await leaver.close()

        reply = await wait_for_info(node, ticket, lambda r: r.counters.sessions_abandoned == 2)
        for session in (used, unused):
            with pytest.raises(ClosedError):
                await session.step(0, inputs(HIDDEN, 1))
        assert reply.free_cache_tokens == CACHE_TOKENS
        assert reply.counters.sessions_active == 0 and reply.counters.sessions_closed == 0
        assert reply.counters.sessions_timed_out == 0
        await assert_serving(node, ticket, span)

    bench.run(go())


@pytest.mark.parametrize("how", ["abort", "finish"])
def test_a_session_stream_ended_without_close_frees_its_cache(serve, span, how):
    """A client that resets its session's stream (what a client does to a server it gives up on)
    or just finishes it without ``close``: the session counts as abandoned and is freed."""
    bench = serve()

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        session = await Session.open(node, ticket, max_length=64)
        await session.step(0, inputs(HIDDEN, 2))
        await getattr(session.stream, how)()
        reply = await wait_for_info(node, ticket, lambda r: r.counters.sessions_abandoned == 1)
        assert reply.free_cache_tokens == CACHE_TOKENS and reply.counters.sessions_active == 0
        await assert_serving(node, ticket, span)

    bench.run(go())


def test_idle_session_times_out_and_active_ones_do_not(serve, span):
    """Idle timeout 0.3 s: a session left idle (a client gone silent, no goodbye) is freed about
    0.3 s after its last message (counted as timed out) and its stream ends, while a session
    stepping every 0.05 s meanwhile outlives the timeout and keeps returning correct results; new
    sessions work."""
    bench = serve(session_timeout=IDLE)

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        busy = await Session.open(node, ticket, max_length=16)
        idle = await Session.open(node, ticket, max_length=16)
        await idle.step(0, inputs(HIDDEN, 2))
        idle_since = time.monotonic()
        c = (await info(node, ticket)).counters
        assert c.sessions_active == 2 and c.sessions_timed_out == 0
        cache = span.allocate_cache(1, 16)

        async def keep_busy() -> None:
            for position in range(10):  # 10 x 0.05 s > the timeout
                x = inputs(HIDDEN, 1, start=position, seed=position)
                assert_same(await busy.step(position, x), local_forward(span, x, cache, position))
                await asyncio.sleep(0.05)

        async def idle_freed_after() -> float:
            await wait_for_info(node, ticket, lambda r: r.counters.sessions_timed_out == 1, timeout=5)
            return time.monotonic() - idle_since

        _, elapsed = await asyncio.gather(keep_busy(), idle_freed_after())
        assert IDLE - 0.1 <= elapsed < IDLE + 0.5
        reply = await info(node, ticket)
        assert reply.counters.sessions_active == 1 and reply.counters.sessions_timed_out == 1
        assert reply.free_cache_tokens == CACHE_TOKENS - 16  # less the busy session
        with pytest.raises(ClosedError):
            await idle.step(2, inputs(HIDDEN, 1, start=2))
        await idle.stream.finish()

        x = inputs(HIDDEN, 1, start=10, seed=10)
        assert_same(await busy.step(10, x), local_forward(span, x, cache, 10))
        await busy.close()
        reply = await info(node, ticket)
        assert reply.counters.sessions_active == 0 and reply.free_cache_tokens == CACHE_TOKENS
        assert reply.counters.sessions_closed == 1 and reply.counters.sessions_timed_out == 1
        await assert_serving(node, ticket, span)

    bench.run(go())


# ---- draining --------------------------------------------------------------------------------------
def test_a_draining_server_refuses_new_work_and_serves_open_sessions_until_they_leave(serve, span):
    """Drain with a 5 s timeout: new sessions, forwards and backwards get ``unavailable``; the open session's
    steps are still served, correct and flagged ``draining``; ``info`` says draining; once the
    client closes its session, the drain ends at once (nothing was cut off)."""
    bench = serve()
    server = bench.swarm.servers[0].server

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        session = await Session.open(node, ticket, max_length=8)
        cache = span.allocate_cache(1, 8)
        x = inputs(HIDDEN, 3, seed=1)
        assert_same(await session.step(0, x), local_forward(span, x, cache, 0))
        started = time.monotonic()
        drain = asyncio.get_running_loop().create_task(server.drain(5.0))
        await asyncio.sleep(0.05)
        assert (await info(node, ticket)).draining
        with pytest.raises(Unavailable, match=r"server is draining \(leaving the swarm\): open the session elsewhere"):
            await Session.open(node, ticket, max_length=8)
        with pytest.raises(Unavailable, match=r"server is draining \(leaving the swarm\): use another server"):
            await forward(node, ticket, inputs(HIDDEN, 2))
        with pytest.raises(Unavailable, match=r"server is draining \(leaving the swarm\): use another server"):
            backward = Message("backward", 1, BackwardRequest(), [*inputs(HIDDEN, 2), torch.ones(1, 2, HIDDEN)])
            await node.request(ticket, BLOCKS, backward)
        x = inputs(HIDDEN, 1, start=3, seed=2)
        meta, out = await session.result(await session.send_step(3, x))
        assert meta.draining and meta.position == 4
        assert_same(out, local_forward(span, x, cache, 3))
        await session.close()
        await asyncio.wait_for(drain, 2.0)
        assert time.monotonic() - started < 1.0
        c = server.counters
        assert c.sessions_closed == 1 and c.sessions_drained == 0 and c.sessions_active == 0

    bench.run(go())


def test_a_drain_closes_what_is_left_when_it_times_out(serve, span):
    """Drain with a 0.2 s timeout and a session that never leaves: after the timeout the session is
    closed (counted as drained), its stream ends and its cache is free."""
    bench = serve()
    server = bench.swarm.servers[0].server

    async def go():
        node = await bench.client()
        session = await Session.open(node, bench.ticket(), max_length=8)
        await session.step(0, inputs(HIDDEN, 2))
        started = time.monotonic()
        await server.drain(0.2)
        assert 0.2 <= time.monotonic() - started < 1.0
        with pytest.raises(ClosedError):
            await session.step(2, inputs(HIDDEN, 1, start=2))
        c = server.counters
        assert c.sessions_drained == 1 and c.sessions_active == 0 and server.budget.free_tokens == CACHE_TOKENS
        assert c.sessions_opened == c.sessions_abandoned == 1  # cut off: it did not end by itself

    bench.run(go())
