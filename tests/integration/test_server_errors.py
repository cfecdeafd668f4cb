"""A ``shoal serve`` process under bad input, greedy and vanishing clients: every failure is a clear
error of the right type, and the server keeps serving correct results afterwards.

Two servers of blocks 1:3 of a tiny random llama, each in its own process:

* ``server``: cache budget 256 tokens, at most 3 sessions per peer, the default 300 s idle timeout;
* ``short_timeout_server``: sessions idle for 2 s are freed.

"Correct" always means: equal to the same blocks run locally (:func:`shoal.checkpoints.load_span`).
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import pytest
import torch

from shoal.checkpoints import load_span, save_sharded
from shoal.errors import BadRequest, BusyError, ClosedError, NotFound, ShoalError
from shoal.protocols import BLOCKS
from shoal.transport import Node, Ticket
from shoal.wire import FRAME_DATA, FRAME_HEAD, FRAME_PREFIX, Message
from tests.helpers.aio import run
from tests.helpers.parity import tiny_llama
from tests.helpers.servers import (
    CLIENT_CONFIG,
    Session,
    SessionHolder,
    forward,
    info,
    inputs,
    local_forward,
    start_server,
    stop_server,
    wait_for_info,
)

pytestmark = pytest.mark.timeout(300)

HIDDEN = 64
BLOCKS_SPAN = "1:3"
CACHE_TOKENS = 256
PER_PEER = 3
SHORT_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tiny_llama(seed=1)
    return save_sharded(model, model.config, tmp_path_factory.mktemp("tiny-errors"))


@pytest.fixture(scope="module")
def span(model_dir):
    span, _ = load_span(model_dir, 1, 3)
    return span


@pytest.fixture(scope="module")
def server(model_dir):
    flags = ["--cache-tokens", str(CACHE_TOKENS), "--max-sessions-per-peer", str(PER_PEER)]
    process = start_server(model_dir, BLOCKS_SPAN, *flags)
    yield process
    stop_server(process)


@pytest.fixture(scope="module")
def short_timeout_server(model_dir):
    process = start_server(model_dir, BLOCKS_SPAN, "--session-timeout", str(SHORT_TIMEOUT))
    yield process
    stop_server(process)


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def assert_sessions_add_up(meta: dict) -> None:
    """Every session opened has ended exactly one way, or is still active."""
    c = meta["counters"]
    ended = c["sessions_closed"] + c["sessions_abandoned"] + c["sessions_timed_out"]
    assert c["sessions_opened"] == ended + c["sessions_active"], c


async def assert_serving(node: Node, ticket: Ticket, span, seed: int = 100) -> None:
    """A stateless forward and a two-step session on ``ticket`` equal the local blocks' results;
    every session it opens is closed again, and the session counters add up."""
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
def test_bad_input_is_refused_clearly_and_the_server_keeps_serving(server, span, case):
    """As a stateless forward and as a session step: the named error; then the same session steps
    on correctly (its cache was not touched) and the server answers correctly."""
    bad = BAD_INPUTS[case]

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            errors_before = (await info(node, server.ticket))["counters"]["errors"]
            with pytest.raises(bad.error, match=bad.message(0)):
                await forward(node, server.ticket, bad.make(0))

            session = await Session.open(node, server.ticket, max_length=16)
            cache = span.allocate_cache(1, 16)
            prefill = inputs(HIDDEN, 4, seed=1, mask=True)
            assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))
            with pytest.raises(bad.error, match=bad.message(4)):
                await session.step(4, bad.make(4))
            good = inputs(HIDDEN, 3, start=4, seed=2, mask=True)
            assert_same(await session.step(4, good), local_forward(span, good, cache, 4))
            await session.close()

            await assert_serving(node, server.ticket, span)
            meta = await info(node, server.ticket)
            assert meta["counters"]["errors"] == errors_before + 2
            assert meta["counters"]["sessions_active"] == 0

    run(go())


def test_unknown_session_ids_are_not_found(server, span):
    """A step on a fresh stream, and a step naming another session on a session stream: NotFound,
    and the session stream keeps working."""

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            step = Message("step", 1, {"session": "feedfacefeedface", "position": 0}, inputs(HIDDEN, 2))
            with pytest.raises(NotFound, match=r"unknown session 'feedfacefeedface' \(open one on this stream first\)"):
                await node.request(server.ticket, BLOCKS, step)

            session = await Session.open(node, server.ticket, max_length=8)
            other = await Session.open(node, server.ticket, max_length=8)
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
            await assert_serving(node, server.ticket, span)

    run(go())


def test_open_and_step_arguments_outside_the_session_are_bad_requests(server, span):
    """Steps past ``max_length`` or from a position the session does not hold, and sessions with
    impossible sizes, are refused; the session still works up to its ``max_length``."""

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            for meta, message in [
                ({"max_length": 0}, r"max_length must be an int in \[1, \d+\], got 0"),
                ({"max_length": "8"}, r"max_length must be an int in \[1, \d+\], got '8'"),
                ({"max_length": 8, "batch_size": 0}, r"batch_size must be an int in \[1, 1024\], got 0"),
            ]:
                with pytest.raises(BadRequest, match=message):
                    await node.request(server.ticket, BLOCKS, Message("open", 1, meta))

            session = await Session.open(node, server.ticket, max_length=4)
            cache = span.allocate_cache(1, 4)
            prefill = inputs(HIDDEN, 3, seed=5)
            assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))
            with pytest.raises(BadRequest, match=r"step to position 5 is past the session's max_length 4"):
                await session.step(3, inputs(HIDDEN, 2, start=3))
            with pytest.raises(BadRequest, match=r"position must be an int in \[0, 3\] \(what the session holds\)"):
                await session.step(4, inputs(HIDDEN, 1, start=4))
            with pytest.raises(BadRequest, match=r"session was opened for batch 1, step has batch 2"):
                await session.step(3, inputs(HIDDEN, 1, start=3, batch=2))
            last = inputs(HIDDEN, 1, start=3, seed=6)
            assert_same(await session.step(3, last), local_forward(span, last, cache, 3))
            with pytest.raises(BadRequest, match=r"step to position 5 is past the session's max_length 4"):
                await session.step(4, inputs(HIDDEN, 1, start=4))
            await session.close()
            await assert_serving(node, server.ticket, span)

    run(go())


# ---- capacity --------------------------------------------------------------------------------------
def test_sessions_that_do_not_fit_the_cache_budget_are_busy(server, span):
    """Budget 256 tokens: 200 fit, then 100 do not (BusyError naming what is free) while 56 still
    do; closing the 200 makes room for the 100 again; the budget ends full."""

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            before = await info(node, server.ticket)
            assert before["free_cache_tokens"] == CACHE_TOKENS
            big = await Session.open(node, server.ticket, max_length=200)
            assert (await info(node, server.ticket))["free_cache_tokens"] == CACHE_TOKENS - 200
            with pytest.raises(BusyError, match=r"session needs 100 cache tokens, 56 of 256 are free"):
                await Session.open(node, server.ticket, max_length=100)
            with pytest.raises(BusyError, match=r"session needs 100 cache tokens, 56 of 256 are free"):
                await Session.open(node, server.ticket, max_length=50, batch_size=2)
            rest = await Session.open(node, server.ticket, max_length=56)
            assert (await info(node, server.ticket))["free_cache_tokens"] == 0
            with pytest.raises(BusyError, match=r"session needs 1 cache tokens, 0 of 256 are free"):
                await Session.open(node, server.ticket, max_length=1)

            cache = span.allocate_cache(1, 56)  # the sessions that fit work
            x = inputs(HIDDEN, 3, seed=8)
            assert_same(await rest.step(0, x), local_forward(span, x, cache, 0))
            assert_same(await big.step(0, x), local_forward(span, x, span.allocate_cache(1, 4), 0))

            await big.close()
            again = await Session.open(node, server.ticket, max_length=100)
            assert (await info(node, server.ticket))["free_cache_tokens"] == CACHE_TOKENS - 156
            await again.close()
            await rest.close()

            after = await info(node, server.ticket)
            assert after["free_cache_tokens"] == CACHE_TOKENS
            assert after["counters"]["sessions_active"] == 0
            rejected = after["counters"]["sessions_rejected_busy"] - before["counters"]["sessions_rejected_busy"]
            assert rejected == 3
            await assert_serving(node, server.ticket, span)

    run(go())


def test_more_sessions_than_the_per_peer_limit_are_busy(server, span):
    """A peer's 4th session is refused (BusyError naming the limit) while another peer still gets
    one; closing one of the three frees a slot."""

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node, await Node.start(CLIENT_CONFIG) as other_node:
            sessions = [await Session.open(node, server.ticket, max_length=8) for _ in range(PER_PEER)]
            with pytest.raises(BusyError, match=rf"peer already has {PER_PEER} open sessions \(limit {PER_PEER}\)"):
                await Session.open(node, server.ticket, max_length=8)
            other = await Session.open(other_node, server.ticket, max_length=8)
            x = inputs(HIDDEN, 2, seed=9)
            assert_same(await other.step(0, x), local_forward(span, x, span.allocate_cache(1, 8), 0))
            await other.close()

            await sessions.pop().close()
            sessions.append(await Session.open(node, server.ticket, max_length=8))
            assert_same(await sessions[-1].step(0, x), local_forward(span, x, span.allocate_cache(1, 8), 0))
            with pytest.raises(BusyError, match=r"limit 3"):
                await Session.open(node, server.ticket, max_length=8)
            for session in sessions:
                await session.close()
            meta = await info(node, server.ticket)
            assert meta["counters"]["sessions_active"] == 0
            assert meta["free_cache_tokens"] == CACHE_TOKENS
            await assert_serving(node, server.ticket, span)

    run(go())


# ---- vanishing and idle clients ----------------------------------------------------------------
def test_client_node_closed_mid_session_frees_its_cache(server, span):
    """A client whose endpoint closes without closing its session: counted as abandoned, its
    cache tokens are free again."""

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            before = await info(node, server.ticket)
            leaver = await Node.start(CLIENT_CONFIG)
            session = await Session.open(leaver, server.ticket, max_length=100)
            await session.step(0, inputs(HIDDEN, 3))
            meta = await info(node, server.ticket)
            assert meta["free_cache_tokens"] == CACHE_TOKENS - 100
            assert meta["counters"]["sessions_active"] == before["counters"]["sessions_active"] + 1
            await leaver.close()

            abandoned = before["counters"]["sessions_abandoned"] + 1
            meta = await wait_for_info(node, server.ticket, lambda m: m["counters"]["sessions_abandoned"] == abandoned)
            assert meta["free_cache_tokens"] == CACHE_TOKENS
            assert meta["counters"]["sessions_active"] == 0
            assert meta["counters"]["sessions_closed"] == before["counters"]["sessions_closed"]
            await assert_serving(node, server.ticket, span)

    run(go())


def test_killed_client_process_mid_session_frees_its_cache(server, span):
    """A client process SIGKILLed while holding a session (nothing is closed, no packet says
    goodbye): once QUIC notices the dead connection (its idle timeout, ~30 s), the session counts
    as abandoned and its cache tokens are free again."""

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            before = await info(node, server.ticket)
            holder = SessionHolder(server.ticket, max_length=120, hidden_size=HIDDEN)
            try:
                meta = await info(node, server.ticket)
                assert meta["free_cache_tokens"] == CACHE_TOKENS - 120
                assert meta["counters"]["sessions_active"] == 1
            finally:
                holder.kill()
            killed = time.monotonic()
            abandoned = before["counters"]["sessions_abandoned"] + 1
            meta = await wait_for_info(
                node, server.ticket, lambda m: m["counters"]["sessions_abandoned"] == abandoned, timeout=120, interval=1
            )
            assert meta["free_cache_tokens"] == CACHE_TOKENS
            assert meta["counters"]["sessions_active"] == 0
            assert meta["counters"]["sessions_timed_out"] == before["counters"]["sessions_timed_out"]
            await assert_serving(node, server.ticket, span)
            return time.monotonic() - killed

    elapsed = run(go(), timeout=180)
    assert elapsed < 120


def test_idle_session_times_out_and_active_ones_do_not(short_timeout_server, span):
    """``--session-timeout 2``: a session left idle is freed about 2 s after its last message
    (counted as timed out) and its stream ends, while a session stepping every 0.4 s meanwhile
    outlives the timeout and keeps returning correct results; new sessions work."""
    ticket = short_timeout_server.ticket

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            busy = await Session.open(node, ticket, max_length=16)
            idle = await Session.open(node, ticket, max_length=16)
            await idle.step(0, inputs(HIDDEN, 2))
            idle_since = time.monotonic()
            meta = await info(node, ticket)
            assert meta["counters"]["sessions_active"] == 2 and meta["counters"]["sessions_timed_out"] == 0
            cache = span.allocate_cache(1, 16)

            async def keep_busy() -> None:
                for position in range(8):  # 8 x 0.4 s > the timeout
                    x = inputs(HIDDEN, 1, start=position, seed=position)
                    assert_same(await busy.step(position, x), local_forward(span, x, cache, position))
                    await asyncio.sleep(0.4)

            async def idle_freed_after() -> float:
                await wait_for_info(node, ticket, lambda m: m["counters"]["sessions_timed_out"] == 1, timeout=30)
                return time.monotonic() - idle_since

            _, elapsed = await asyncio.gather(keep_busy(), idle_freed_after())
            assert SHORT_TIMEOUT - 0.2 <= elapsed < SHORT_TIMEOUT + 10
            meta = await info(node, ticket)
            assert meta["counters"]["sessions_active"] == 1 and meta["counters"]["sessions_timed_out"] == 1
            assert meta["free_cache_tokens"] == 8192 - 16  # the server's default budget, less the busy session
            with pytest.raises(ClosedError):
                await idle.step(2, inputs(HIDDEN, 1, start=2))
            await idle.stream.finish()

            x = inputs(HIDDEN, 1, start=8, seed=8)
            assert_same(await busy.step(8, x), local_forward(span, x, cache, 8))
            await busy.close()
            meta = await info(node, ticket)
            assert meta["counters"]["sessions_active"] == 0 and meta["free_cache_tokens"] == 8192
            assert meta["counters"]["sessions_closed"] == 1 and meta["counters"]["sessions_timed_out"] == 1
            await assert_serving(node, ticket, span)

    run(go())


# ---- malformed frames ----------------------------------------------------------------------------
def _frame(frame_type: int, payload: bytes) -> bytes:
    return FRAME_PREFIX.pack(len(payload) + 1, frame_type) + payload


def _head(**fields) -> bytes:
    header = {"v": 1, "k": "forward", "id": 5, "m": {}, "t": [], "n": 0, **fields}
    return _frame(FRAME_HEAD, msgpack.packb(header))


MALFORMED = {
    "unknown_frame_type": (_frame(9, b"xyz"), "bad_frame_type"),
    "zero_length_frame": (struct.pack(">IB", 0, FRAME_HEAD), "bad_frame"),
    "header_not_msgpack": (_frame(FRAME_HEAD, b"\xc1\xc1\xc1"), "bad_header"),
    "unknown_kind": (_head(k="teleport"), "unknown_kind"),
    "data_without_head": (_frame(FRAME_DATA, b"\0" * 16), "unexpected_frame"),
    "size_mismatch": (_head(t=[["f32", [2, 2]]], n=3), "size_mismatch"),
    "oversized_frame": (FRAME_PREFIX.pack(1 << 31, FRAME_DATA), "frame_too_large"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_frame_gets_a_wire_error_and_the_server_keeps_serving(server, span, case):
    """On a fresh blocks stream and on a session stream: one ``wire`` error naming the problem,
    then the stream ends; a session on that stream is freed; the server keeps serving."""
    data, reason = MALFORMED[case]

    async def expect_wire_error(stream) -> None:
        await stream.send_raw(data)
        reply = await stream.recv(30)
        assert reply.kind == "error"
        assert reply.meta["code"] == "wire" and reply.meta["reason"] == reason
        assert reply.meta["message"].startswith(reason)
        with pytest.raises(ClosedError):
            await stream.recv(30)
        await stream.finish()

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            await expect_wire_error(await node.open_stream(server.ticket, BLOCKS))
            await assert_serving(node, server.ticket, span)

            session = await Session.open(node, server.ticket, max_length=64)
            await session.step(0, inputs(HIDDEN, 2))
            assert (await info(node, server.ticket))["free_cache_tokens"] == CACHE_TOKENS - 64
            await expect_wire_error(session.stream)
            meta = await wait_for_info(node, server.ticket, lambda m: m["counters"]["sessions_active"] == 0)
            assert meta["free_cache_tokens"] == CACHE_TOKENS
            await assert_serving(node, server.ticket, span)

    run(go())


def test_pushes_need_the_session_token_and_a_forged_one_changes_nothing(server, span):
    """Pushes (server-to-server hand-offs) into a session: unknown or malformed session ids, wrong
    or non-ASCII tokens, bad step ids are dropped and counted; the session's client hears nothing
    and its cache is untouched. A push with the right token is served, answered on the session's
    own stream under the pushed step id."""

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            stream = await node.open_stream(server.ticket, BLOCKS)
            opened = await stream.request(Message("open", 1, {"max_length": 8, "batch_size": 1}))
            session, token = opened.meta["session"], opened.meta["token"]
            before = (await info(node, server.ticket))["counters"]
            step = inputs(HIDDEN, 2, seed=5)
            forged = [
                {"session": "feedfacefeedface", "token": token, "position": 0, "step": 7, "push": []},
                {"session": session, "token": "0" * 32, "position": 0, "step": 7, "push": []},
                {"session": session, "token": "tökén", "position": 0, "step": 7, "push": []},
                {"session": [session], "token": token, "position": 0, "step": 7, "push": []},
                {"session": session, "token": token, "position": 0, "step": "7", "push": []},
            ]
            pusher = await node.open_stream(server.ticket, BLOCKS)
            for meta in forged:
                await pusher.send(Message("push", pusher.next_id(), meta, step))
            await wait_for_info(
                node, server.ticket, lambda m: m["counters"]["pushes_rejected"] >= before["pushes_rejected"] + 5
            )
            with pytest.raises(ShoalError):  # nothing reached the session's client
                await stream.recv(0.5)
            stream = await node.open_stream(server.ticket, BLOCKS)  # (that recv timeout spent the old stream)
            opened = await stream.request(Message("open", 1, {"max_length": 8, "batch_size": 1}))
            session, token = opened.meta["session"], opened.meta["token"]
            meta = {"session": session, "token": token, "position": 0, "step": 9, "push": []}
            await pusher.send(Message("push", pusher.next_id(), meta, step))
            reply = await stream.recv(30.0)
            assert reply.kind == "result" and reply.id == 9 and reply.meta["position"] == 2
            assert_same(reply.tensors[0], local_forward(span, step, span.allocate_cache(1, 8), 0))
            after = (await info(node, server.ticket))["counters"]
            assert after["pushes_received"] == before["pushes_received"] + 1
            await stream.request(Message("close", 10), timeout=10)
            await stream.finish()
            await pusher.finish()
            await assert_serving(node, server.ticket, span)

    run(go())
