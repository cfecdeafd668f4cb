"""The blocks protocol handler (:class:`shoal.server.handler.BlockServer`) under bad input and
malformed frames (here), greedy, vanishing and idle clients and a drain (``test_capacity.py``) and
forged pushes (``test_push.py``): every failure is a clear error of the right type, and the server
keeps serving correct results afterwards.

Real servers (:mod:`shoal.server.builder`, what ``shoal serve`` runs) in this process, on an in-memory
network (:class:`shoal.launch.InProcessSwarm`), talked to with raw typed messages from client nodes
of the same network (:mod:`tests.helpers.servers`): the protocol is the point here, not the client.
Each test gets fresh servers (tens of milliseconds), so counters are exact. Unless a test says
otherwise: one server of blocks 1:3 of a tiny random llama, cache budget 256 tokens, at most 3
sessions per peer. "Correct" always means: equal to the same blocks run locally
(:func:`shoal.checkpoints.load_span`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import pytest
import torch

from shoal.errors import BadRequest, ClosedError, NotFound, ShoalError
from shoal.protocols import BLOCKS
from shoal.transport import MessageStream
from shoal.wire import FRAME_DATA, FRAME_HEAD, FRAME_PREFIX, Message
from shoal.wire.schema import ErrorReply, OpenReply, OpenRequest, StepRequest
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.servers import Session, forward, info, inputs, local_forward, wait_for_info
from tests.server.handler.bench import CACHE_TOKENS, HIDDEN, assert_same, assert_serving

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_server_errors")]


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
