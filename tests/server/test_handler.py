"""The blocks protocol handler (:class:`shoal.server.handler.BlockServer`) under bad input, greedy,
vanishing and idle clients, forged pushes and a drain: every failure is a clear error of the right
type, and the server keeps serving correct results afterwards.

Real servers (:mod:`shoal.server.builder`, what ``shoal serve`` runs) in this process, on an in-memory
network (:class:`shoal.launch.InProcessSwarm`), talked to with raw typed messages from client nodes
of the same network (:mod:`tests.helpers.servers`): the protocol is the point here, not the client.
Each test gets fresh servers (tens of milliseconds), so counters are exact. Unless a test says
otherwise: one server of blocks 1:3 of a tiny random llama, cache budget 256 tokens, at most 3
sessions per peer. "Correct" always means: equal to the same blocks run locally
(:func:`shoal.checkpoints.load_span`).
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch

from shoal.checkpoints import load_span
from shoal.errors import BadRequest, BusyError, ClosedError, NotFound, ShoalError, Unavailable
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LOOPBACK
from shoal.protocols import BLOCKS
from shoal.transport import BaseNode, MessageStream, Ticket
from shoal.verify.tokens import push_token
from shoal.wire import FRAME_DATA, FRAME_HEAD, FRAME_PREFIX, Message
from shoal.wire.schema import (
    BackwardRequest,
    ErrorReply,
    InfoReply,
    OpenReply,
    OpenRequest,
    PushHop,
    PushRequest,
    StepReply,
    StepRequest,
)
from testkit.tiny import tiny_checkpoint
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.servers import Session, forward, info, inputs, local_forward, wait_for_info

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_server_errors")]

HIDDEN = 64
SPAN = (1, 3)
CACHE_TOKENS = 256
PER_PEER = 3
IDLE = 0.3  # the idle timeout of the tests that wait for one (seconds)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-handler"), "llama", seed=1)


@pytest.fixture(scope="module")
def spans(model_dir):
    """Local blocks, by (start, end): what a correct server of that span answers."""
    made = {}

    def get(start: int, end: int):
        if (start, end) not in made:
            made[start, end] = load_span(model_dir, start, end)[0]
        return made[start, end]

    return get


@pytest.fixture(scope="module")
def span(spans):
    return spans(*SPAN)


class Bench:
    """Servers in this process and client nodes of their network; coroutines run on their loop."""

    def __init__(self, swarm: InProcessSwarm):
        self.swarm = swarm
        self.nodes: list[BaseNode] = []

    def ticket(self, index: int = 0) -> Ticket:
        return self.swarm.servers[index].ticket

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        return self.swarm.runtime.run(coro, timeout)

    async def client(self) -> BaseNode:
        """A new client node (its own peer id)."""
        node = await self.swarm.network.start(LOOPBACK)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        async def close_nodes() -> None:
            for node in self.nodes:
                await node.close()

        self.run(close_nodes())
        self.swarm.close()


@pytest.fixture
def serve(model_dir):
    """``serve(spans=[SPAN], **settings)``: a :class:`Bench` with fresh servers, closed after the test."""
    benches: list[Bench] = []

    def make(spans=(SPAN,), **settings) -> Bench:
        settings = dict(cache_tokens=CACHE_TOKENS, max_sessions_per_peer=PER_PEER, session_timeout=30.0) | settings
        bench = Bench(InProcessSwarm(model_dir, [BlockRange(*s) for s in spans], **settings))
        benches.append(bench)
        return bench

    yield make
    for bench in benches:
        bench.close()


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def assert_sessions_add_up(reply: InfoReply) -> None:
    """Every session opened has ended exactly one way, or is still active."""
    c = reply.counters
    ended = c.sessions_closed + c.sessions_abandoned + c.sessions_timed_out
    assert c.sessions_opened == ended + c.sessions_active, c


async def assert_serving(node: BaseNode, ticket: Ticket, span, seed: int = 100) -> None:
    """A stateless forward and a two-step session on ``ticket`` equal the local blocks' results;
    the session it opens is closed again, and the session counters add up."""
    x = inputs(HIDDEN, 5, seed=seed, mask=True)
    assert_same(await forward(node, ticket, x), local_forward(span, x))
    session = await Session.open(node, ticket, max_length=8)
    try:
        cache = span.allocate_cache(1, 8)
        prefill, step = inputs(HIDDEN, 3, seed=seed + 1), inputs(HIDDEN, 1, start=3, seed=seed + 2)
        assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))
        assert_same(await session.step(3, step), local_forward(span, step, cache, 3))
    finally:
        await session.close()
    assert_sessions_add_up(await info(node, ticket))


# ---- bad inputs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bad:
    """Tensors for 3 new tokens at ``position`` that break one rule, and the error that names it."""

    make: Callable[[int], list[torch.Tensor]]
    error: type[ShoalError]
    message: Callable[[int], str]  # regex, given the position


def _replace(i: int, value: Callable[[list[torch.Tensor], int], torch.Tensor]) -> Callable[[int], list[torch.Tensor]]:
    def make(position: int) -> list[torch.Tensor]:
        tensors = inputs(HIDDEN, 3, start=position, seed=7, mask=True)
        tensors[i] = value(tensors, position)
        return tensors

    return make


BAD_INPUTS = {
    "wrong_hidden_size": Bad(
        _replace(0, lambda t, p: torch.randn(1, 3, HIDDEN // 2)),
        BadRequest,
        lambda p: rf"hidden states must be \[batch, tokens, {HIDDEN}\], got \[1, 3, {HIDDEN // 2}\]",
    ),
    "hidden_not_3d": Bad(
        _replace(0, lambda t, p: torch.randn(3, HIDDEN)),
        BadRequest,
        lambda p: rf"hidden states must be \[batch, tokens, {HIDDEN}\], got \[3, {HIDDEN}\]",
    ),
    "int_hidden_states": Bad(
        _replace(0, lambda t, p: torch.ones(1, 3, HIDDEN, dtype=torch.int64)),
        BadRequest,
        lambda p: r"hidden states must be float32, float16 or bfloat16, got torch\.int64",
    ),
    "empty_hidden_states": Bad(
        lambda p: [torch.zeros(1, 0, HIDDEN), torch.zeros(1, 0, dtype=torch.int64)],
        BadRequest,
        lambda p: rf"empty hidden states \[1, 0, {HIDDEN}\]",
    ),
    "float_position_ids": Bad(
        _replace(1, lambda t, p: t[1].float()),
        BadRequest,
        lambda p: r"position_ids must be int64 \[1, 3\], got torch\.float32 \[1, 3\]",
    ),
    "position_ids_wrong_shape": Bad(
        _replace(1, lambda t, p: t[1][:, :2]),
        BadRequest,
        lambda p: r"position_ids must be int64 \[1, 3\], got torch\.int64 \[1, 2\]",
    ),
    "non_bool_mask": Bad(
        _replace(2, lambda t, p: t[2].long()),
        BadRequest,
        lambda p: rf"attention_mask must be bool \[1, {p + 3}\], got torch\.int64 \[1, {p + 3}\]",
    ),
    "mask_too_long": Bad(
        _replace(2, lambda t, p: torch.ones(1, p + 5, dtype=torch.bool)),
        BadRequest,
        lambda p: rf"attention_mask must be bool \[1, {p + 3}\], got torch\.bool \[1, {p + 5}\]",
    ),
    "mask_too_short": Bad(
        _replace(2, lambda t, p: torch.ones(1, 2, dtype=torch.bool)),
        BadRequest,
        lambda p: rf"attention_mask must be bool \[1, {p + 3}\], got torch\.bool \[1, 2\]",
    ),
    "no_position_ids": Bad(
        lambda p: inputs(HIDDEN, 3, start=p)[:1],
        BadRequest,
        lambda p: r"expected \[hidden, position_ids, attention_mask\?\], got 1 tensors",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_is_refused_clearly_and_the_server_keeps_serving(serve, span, case):
    """As a stateless forward and as a session step: the named error; then the same session steps
    on correctly (its cache was not touched) and the server answers correctly."""
    bad = BAD_INPUTS[case]
    bench = serve()

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        with pytest.raises(bad.error, match=bad.message(0)):
            await forward(node, ticket, bad.make(0))

        session = await Session.open(node, ticket, max_length=16)
        cache = span.allocate_cache(1, 16)
        prefill = inputs(HIDDEN, 4, seed=1, mask=True)
        assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))
        with pytest.raises(bad.error, match=bad.message(4)):
            await session.step(4, bad.make(4))
        good = inputs(HIDDEN, 3, start=4, seed=2, mask=True)
        assert_same(await session.step(4, good), local_forward(span, good, cache, 4))
        await session.close()

        await assert_serving(node, ticket, span)
        c = (await info(node, ticket)).counters
        assert c.errors == 2 and c.sessions_active == 0 and c.sessions_closed == 2
        assert c.steps == 4 and c.forward_requests == 1  # the refused ones did not run

    bench.run(go())


def test_unknown_session_ids_are_not_found(serve, span):
    """A step on a fresh stream, and a step naming another session on a session stream: NotFound,
    and the session stream keeps working."""
    bench = serve()

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        with pytest.raises(NotFound, match=r"unknown session 'feedfacefeedface' \(open one on this stream first\)"):
            step = StepRequest(session="feedfacefeedface", position=0)
            await node.request(ticket, BLOCKS, Message("step", 1, step, inputs(HIDDEN, 2)))

        session = await Session.open(node, ticket, max_length=8)
        other = await Session.open(node, ticket, max_length=8)
        cache = span.allocate_cache(1, 8)
        first = inputs(HIDDEN, 2, seed=3)
        assert_same(await session.step(0, first), local_forward(span, first, cache, 0))
        for wrong in (other.id, "nope"):
            with pytest.raises(NotFound, match=rf"unknown session '{wrong}' on this stream"):
                await session.step(2, inputs(HIDDEN, 1, start=2), session_id=wrong)
        second = inputs(HIDDEN, 1, start=2, seed=4)
        assert_same(await session.step(2, second), local_forward(span, second, cache, 2))
        await other.close()
        await session.close()
        await assert_serving(node, ticket, span)
        assert (await info(node, ticket)).counters.errors == 3

    bench.run(go())


def test_open_and_step_arguments_outside_the_session_are_bad_requests(serve, span):
    """Sessions with impossible sizes are refused naming the field, on a stream that stays usable
    (a valid open follows on it); steps past ``max_length``, from a position the session does not
    hold, or of another batch size are refused; the session still works up to its ``max_length``."""
    bench = serve()

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        stream = await node.open_stream(ticket, BLOCKS)
        for meta, message in [
            (OpenRequest(max_length=0), r"invalid open metadata: Expected `int` >= 1 - at `\$.max_length`"),
            (OpenRequest(max_length="8"), r"invalid open metadata: Expected `int`, got `str` - at `\$.max_length`"),
            (OpenRequest(max_length=1 << 21), r"Expected `int` <= 1048576 - at `\$.max_length`"),
            (OpenRequest(max_length=8, batch_size=0), r"Expected `int` >= 1 - at `\$.batch_size`"),
            (OpenRequest(max_length=8, batch_size=1025), r"Expected `int` <= 1024 - at `\$.batch_size`"),
        ]:
            with pytest.raises(BadRequest, match=message):
                await stream.request(Message("open", stream.next_id(), meta))
        assert (await info(node, ticket)).free_cache_tokens == CACHE_TOKENS  # nothing was reserved
        opened = await stream.request(Message("open", stream.next_id(), OpenRequest(max_length=4)))
        session = Session(stream, opened.reply(OpenReply))

        cache = span.allocate_cache(1, 4)
        prefill = inputs(HIDDEN, 3, seed=5)
        assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))
        with pytest.raises(BadRequest, match=r"step to position 5 is past the session's max_length 4"):
            await session.step(3, inputs(HIDDEN, 2, start=3))
        with pytest.raises(BadRequest, match=r"position must be in \[0, 3\] \(what the session holds\)"):
            await session.step(4, inputs(HIDDEN, 1, start=4))
        with pytest.raises(BadRequest, match=r"invalid step metadata: Expected `int` >= 0 - at `\$.position`"):
            await session.step(-1, inputs(HIDDEN, 1, start=3))
        with pytest.raises(BadRequest, match=r"session was opened for batch 1, step has batch 2"):
            await session.step(3, inputs(HIDDEN, 1, start=3, batch=2))
        last = inputs(HIDDEN, 1, start=3, seed=6)
        assert_same(await session.step(3, last), local_forward(span, last, cache, 3))
        with pytest.raises(BadRequest, match=r"step to position 5 is past the session's max_length 4"):
            await session.step(4, inputs(HIDDEN, 1, start=4))
        await session.close()
        await assert_serving(node, ticket, span)
        c = (await info(node, ticket)).counters
        assert c.errors == 10 and c.sessions_opened == 2 and c.sessions_closed == 2

    bench.run(go())


def test_a_session_stream_takes_only_step_migrate_and_close(serve, span):
    """``info``, ``forward`` or a second ``open`` on a session's stream: a bad request naming the
    kind, and the session goes on."""
    bench = serve()

    async def go():
        node = await bench.client()
        session = await Session.open(node, bench.ticket(), max_length=8)
        for kind, meta in [("info", None), ("forward", None), ("open", OpenRequest(max_length=8))]:
            message = Message(kind, session.stream.next_id()) if meta is None else Message(kind, 9, meta)
            with pytest.raises(BadRequest, match=rf"a session stream takes step, migrate or close, not '{kind}'"):
                await session.stream.request(message)
        x = inputs(HIDDEN, 3, seed=8)
        assert_same(await session.step(0, x), local_forward(span, x, span.allocate_cache(1, 8), 0))
        await session.close()
        c = (await info(node, bench.ticket())).counters
        assert c.errors == 3 and c.sessions_opened == 1 and c.sessions_closed == 1

    bench.run(go())


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


# ---- malformed frames ----------------------------------------------------------------------------
def _frame(frame_type: int, payload: bytes) -> bytes:
    return FRAME_PREFIX.pack(len(payload) + 1, frame_type) + payload


def _head(**fields) -> bytes:
    header = {"v": 2, "k": "forward", "id": 5, "m": {}, "t": [], "n": 0, **fields}
    return _frame(FRAME_HEAD, msgspec.msgpack.encode(header))


MALFORMED = {
    "unknown_frame_type": (_frame(9, b"xyz"), "bad_frame_type"),
    "zero_length_frame": (struct.pack(">IB", 0, FRAME_HEAD), "bad_frame"),
    "header_not_msgpack": (_frame(FRAME_HEAD, b"\xc1\xc1\xc1"), "bad_header"),
    "unknown_kind": (_head(k="teleport"), "unknown_kind"),
    "data_without_head": (_frame(FRAME_DATA, b"\0" * 16), "unexpected_frame"),
    "size_mismatch": (_head(t=[["f32", [2, 2], "raw"]], n=3), "size_mismatch"),
    "unknown_dtype": (_head(t=[["f33", [2], "raw"]], n=8), "unknown_dtype"),
    "oversized_frame": (FRAME_PREFIX.pack(1 << 31, FRAME_DATA), "frame_too_large"),
    "oversized_message": (_head(t=[["f32", [1 << 28, 2], "raw"]], n=1 << 31), "message_too_large"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_frame_gets_a_wire_error_and_the_server_keeps_serving(serve, span, case):
    """On a fresh blocks stream and on a session stream: one ``wire`` error naming the problem,
    then the stream ends; a session on that stream is freed; the server keeps serving."""
    data, reason = MALFORMED[case]
    bench = serve()

    async def expect_wire_error(stream: MessageStream) -> None:
        await stream.send_raw(data)
        reply = await stream.recv(5)
        assert reply.kind == "error"
        error = reply.meta
        assert isinstance(error, ErrorReply)
        assert error.code == "wire" and error.reason == reason and error.message.startswith(reason)
        with pytest.raises(ClosedError):
            await stream.recv(5)
        await stream.finish()

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        await expect_wire_error(await node.open_stream(ticket, BLOCKS))
        await assert_serving(node, ticket, span)

        session = await Session.open(node, ticket, max_length=64)
        await session.step(0, inputs(HIDDEN, 2))
        assert (await info(node, ticket)).free_cache_tokens == CACHE_TOKENS - 64
        await expect_wire_error(session.stream)
        reply = await wait_for_info(node, ticket, lambda r: r.counters.sessions_active == 0)
        assert reply.free_cache_tokens == CACHE_TOKENS and reply.counters.sessions_abandoned == 1
        await assert_serving(node, ticket, span)
        assert bench.swarm.servers[0].node.rejected_frames[reason] == 2

    bench.run(go())


# ---- pushes ----------------------------------------------------------------------------------------
async def pending_reply(stream: MessageStream, wait: float = 0.1) -> asyncio.Task:
    """A read of ``stream``'s next message, checked to still be waiting after ``wait`` seconds
    (nothing arrived); await it later for what comes next."""
    task = asyncio.get_running_loop().create_task(stream.recv(10))
    await asyncio.sleep(wait)
    assert not task.done(), f"the session's client was sent {task.result() if not task.exception() else task}"
    return task


def test_pushes_need_the_session_token_and_a_forged_one_changes_nothing(serve, span):
    """Pushes (server-to-server hand-offs) into a session: unknown sessions, wrong, empty or
    non-ASCII tokens, the session's secret itself, the token bound to another peer than the pusher,
    another session's token, a step's token on another step id, position or receipt flag, and stale
    step ids are dropped and counted as rejected; malformed ones are refused to the pusher, naming
    the field. The session's client hears nothing and its cache is untouched (its length did not
    move). A push with the right token is served, answered on the session's own stream under the
    pushed step id; that step id again is stale."""
    bench = serve()

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        session = await Session.open(node, ticket, max_length=8)
        other = await Session.open(node, ticket, max_length=8)
        cache = span.allocate_cache(1, 8)
        prefill = inputs(HIDDEN, 2, seed=4)
        assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))  # step id 2
        pushed = inputs(HIDDEN, 2, start=2, seed=5)

        def bound(step=9, peer=node.id, secret=session.token, position=2, receipt=False) -> str:
            """What the client hands the peer it lets push that step (here its own node)."""
            return push_token(secret, peer, step=step, position=position, n=2, receipt=receipt)

        def push(session_id=session.id, token=None, step=9, position=2, receipt=False) -> PushRequest:
            token = token if token is not None else bound(step)
            return PushRequest(session=session_id, token=token, position=position, step=step, receipt=receipt)

        forged = [
            push(session_id="feedfacefeedface"),
            push(token="0" * 32),
            push(token=""),
            push(token="tökén"),
            push(token=session.token),  # the session's secret is no token
            push(token=bound(peer="ab" * 32)),  # another peer's token: not this pusher's
            push(token=bound(secret=other.token)),
            push(session_id=other.id),  # the right token, for another session
            push(step=10, token=bound(step=9)),  # the token of another step
            push(position=0),  # the step's token, at another position
            push(receipt=True),  # ... or asking another receipt than the client did
            push(step=2),  # the prefill's id: stale
        ]
        malformed = [
            (push(session_id=[session.id]), r"Expected `str`, got `array` - at `\$.session`"),
            (push(step="7"), r"Expected `int`, got `str` - at `\$.step`"),
            (push(step=-1), r"Expected `int` >= 0 - at `\$.step`"),
            (push(step=1 << 32), r"Expected `int` <= 4294967295 - at `\$.step`"),
        ]
        pusher = await node.open_stream(ticket, BLOCKS)
        for meta in forged:
            await pusher.send(Message("push", pusher.next_id(), meta, pushed))
        for meta, message in malformed:  # answered to the pusher: its stream stays usable
            with pytest.raises(BadRequest, match=message):
                await pusher.request(Message("push", pusher.next_id(), meta, pushed))
        await wait_for_info(node, ticket, lambda r: r.counters.pushes_rejected == len(forged))
        waiting = await pending_reply(session.stream)  # nothing reached the session's client
        step_id = await session.send_step(3, inputs(HIDDEN, 1, start=3))  # nor its cache: it still holds 2
        refused = await waiting
        assert refused.kind == "error" and refused.id == step_id
        assert refused.error_info() == ("bad_request", "position must be in [0, 2] (what the session holds)")

        waiting = await pending_reply(session.stream, wait=0)
        await pusher.send(Message("push", pusher.next_id(), push(), pushed))
        reply = await waiting
        assert reply.kind == "result" and reply.id == 9 and reply.reply(StepReply).position == 4
        assert_same(reply.tensors[0], local_forward(span, pushed, cache, 2))
        await pusher.send(Message("push", pusher.next_id(), push(), pushed))  # the same step again: stale
        await wait_for_info(node, ticket, lambda r: r.counters.pushes_rejected == len(forged) + 1)
        waiting = await pending_reply(session.stream)
        step_id = await session.send_step(5, inputs(HIDDEN, 1, start=5))  # it ran once: the session holds 4
        assert (await waiting).error_info()[1] == "position must be in [0, 4] (what the session holds)"

        c = (await info(node, ticket)).counters
        assert c.pushes_received == 1 and c.pushes_rejected == len(forged) + 1 and c.pushes_sent == 0
        assert c.errors == len(malformed) + 2 and c.steps == 2
        await session.close()
        await other.close()
        await pusher.finish()
        await assert_serving(node, ticket, span)

    bench.run(go())


def test_a_late_push_overtaken_while_it_waited_for_the_lock_never_overwrites_the_newer_step(serve, span):
    """The previous server's push of step s1 passes the first check (s1 is newer than the prefill)
    and waits for the session's lock behind the client's direct retry s2 of the same position. Once
    s2 ran, s1 is stale: checked again under the lock, it is dropped (counted as rejected), so the
    cache holds what s2 wrote and the next step equals the local blocks fed the prefill and s2."""
    bench = serve()

    async def waiting_for(lock: asyncio.Lock, count: int) -> None:
        async with asyncio.timeout(5.0):
            while len(lock._waiters or ()) < count:  # queued on the session's lock (FIFO)
                await asyncio.sleep(0.005)

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        session = await Session.open(node, ticket, max_length=8)
        cache = span.allocate_cache(1, 8)
        prefill = inputs(HIDDEN, 2, seed=4)
        assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))  # step id 2
        late_id = session.stream.next_id()  # s1 = 3: the step the previous server pushes, late
        served = bench.swarm.servers[0].server._sessions[session.id]
        pusher = await node.open_stream(ticket, BLOCKS)
        retry, late = inputs(HIDDEN, 1, start=2, seed=6), inputs(HIDDEN, 1, start=2, seed=5)
        await served.lock.acquire()  # a step of the session is running: what arrives now waits
        try:
            retry_id = await session.send_step(2, retry)  # s2 = 4: the client drives the hop itself
            await waiting_for(served.lock, 1)
            token = push_token(session.token, node.id, step=late_id, position=2, n=1, receipt=False)
            meta = PushRequest(session=session.id, token=token, position=2, step=late_id)
            await pusher.send(Message("push", pusher.next_id(), meta, late))
            await waiting_for(served.lock, 2)
        finally:
            served.lock.release()
        _, out = await session.result(retry_id)
        assert_same(out, local_forward(span, retry, cache, 2))
        await wait_for_info(node, ticket, lambda r: r.counters.pushes_rejected == 1)
        following = inputs(HIDDEN, 1, start=3, seed=7)  # the cache holds the prefill and s2, not s1
        assert_same(await session.step(3, following), local_forward(span, following, cache, 3))
        c = (await info(node, ticket)).counters
        assert (c.pushes_received, c.pushes_rejected, c.steps, c.errors) == (0, 1, 3, 0)
        await session.close()
        await pusher.finish()

    bench.run(go())


CHAIN = [(0, 1), (1, 2), (2, 4)]  # three servers, every block of the tiny llama


async def open_chain(bench: Bench, node: BaseNode, max_length: int = 16) -> list[Session]:
    return [await Session.open(node, server.ticket, max_length) for server in bench.swarm.servers]


def test_a_pushed_chain_answers_every_hop_to_the_client_and_counts_each_push(serve, spans):
    """A step sent to the first of three servers with the other two as its push route: each server
    hands its output to the next and answers the client on its own session stream, under the
    client's step id; every output equals the local blocks up to that server. Counters: each push
    sent once and received once, one step per server per client step."""
    bench = serve(CHAIN)

    async def go():
        node = await bench.client()
        sessions = await open_chain(bench, node)
        caches = [spans(0, end).allocate_cache(1, 16) for _, end in CHAIN]
        position = 0
        for n, seed in [(4, 1), (1, 2), (1, 3)]:
            x = inputs(HIDDEN, n, start=position, seed=seed)
            step_id = sessions[0].stream.next_id()
            route = tuple(s.push_hop(bench.ticket(i), bench.ticket(i - 1).peer_id, step=step_id, position=position, n=n)
                          for i, s in enumerate(sessions) if i)  # fmt: skip
            await sessions[0].send_step(position, x, push=route, step_id=step_id)
            for i, (session, (_, end)) in enumerate(zip(sessions, CHAIN, strict=True)):
                meta, out = await session.result(step_id)
                assert meta.position == position + n
                assert meta.pushed is (None if i == len(CHAIN) - 1 else True)
                assert_same(out, local_forward(spans(0, end), x, caches[i], position))
            position += n
        for i, server in enumerate(bench.swarm.servers):
            c = server.server.counters
            assert c.steps == 3 and c.positions_processed == 6, (i, c)
            assert (c.pushes_sent, c.pushes_received) == [(3, 0), (3, 3), (0, 3)][i], (i, c)
            assert c.pushes_failed == c.pushes_rejected == c.errors == 0
        for session in sessions:
            await session.close()

    bench.run(go())


def test_a_push_that_cannot_be_delivered_says_so_and_the_client_drives_the_hop(serve, spans):
    """A push route naming a peer that does not serve blocks: the step is served, its reply says
    ``pushed: false`` (counted as a failed push), and the client sends the next server the step
    itself; the session continues correctly."""
    bench = serve(CHAIN[:2])

    async def go():
        node = await bench.client()
        first, second = await open_chain(bench, node)
        token = push_token(second.token, bench.ticket(0).peer_id, step=2, position=0, n=3, receipt=False)
        nowhere = PushHop(ticket=str(node.ticket()), session=second.id, token=token)  # a client: no blocks
        x = inputs(HIDDEN, 3, seed=1)
        meta, out = await first.result(await first.send_step(0, x, push=(nowhere,)))
        assert meta.pushed is False
        assert_same(out, local_forward(spans(0, 1), x))
        assert_same(await second.step(0, [out, *x[1:]]), local_forward(spans(0, 2), x))
        c = bench.swarm.servers[0].server.counters
        assert (c.pushes_failed, c.pushes_sent) == (1, 0)
        assert bench.swarm.servers[1].server.counters.pushes_received == 0

    bench.run(go())


def test_pushes_keep_a_session_alive_that_its_client_never_talks_to(serve, spans):
    """Idle timeout 0.3 s; for 0.5 s the client steps only the first server, which pushes to the
    second: the second's session is not idle (pushes count) and is not timed out, while a session
    nobody steps is."""
    bench = serve(CHAIN[:2], session_timeout=IDLE)

    async def go():
        node = await bench.client()
        first, second = await open_chain(bench, node)
        forgotten = await Session.open(node, bench.ticket(1), max_length=16)
        cache = spans(0, 2).allocate_cache(1, 16)
        for position in range(10):  # 10 x 0.05 s
            x = inputs(HIDDEN, 1, start=position, seed=position)
            step_id = first.stream.next_id()
            route = (second.push_hop(bench.ticket(1), bench.ticket(0).peer_id, step=step_id, position=position, n=1),)
            await first.send_step(position, x, push=route, step_id=step_id)
            await first.result(step_id)
            _, out = await second.result(step_id)
            assert_same(out, local_forward(spans(0, 2), x, cache, position))
            await asyncio.sleep(0.05)
        c = (await info(node, bench.ticket(1))).counters
        assert c.sessions_timed_out == 1 and c.sessions_active == 1 and c.pushes_received == 10
        with pytest.raises(ClosedError):
            await forgotten.step(0, inputs(HIDDEN, 1))
        await first.close()
        await second.close()

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
