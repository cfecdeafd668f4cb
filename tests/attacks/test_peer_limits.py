"""Attacks of one hostile peer on a node's limits (:mod:`shoal.limits`), each beside an honest one.

A real server (what ``shoal serve`` runs) in this process, on iroh over loopback: the real transport
framing, connections and streams. For each attack: it fails (the hostile peer gets a clear error, or
its connection or stream is ended), the node holds no more than its limit of the hostile peer's
bytes, streams or cache, and an honest session beside it returns the outputs the same blocks compute
locally, as it would without the attack.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import torch

from shoal.checkpoints import load_span
from shoal.errors import BadRequest, BusyError, ShoalError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.limits import MiB
from shoal.protocols import BLOCKS
from shoal.transport import META, MessageStream, Node, TransportConfig
from shoal.wire import FRAME_DATA, FRAME_HEAD, FRAME_PREFIX, Message
from shoal.wire.schema import ErrorReply, Ping
from testkit.tiny import tiny_checkpoint
from tests.helpers.servers import Session, forward, info, inputs, local_forward, wait_for_info

pytestmark = pytest.mark.timeout(60)

HIDDEN = 64  # testkit.tiny's
SPAN = (0, 2)
LOOPBACK = TransportConfig(bind_addr="127.0.0.1:0")
PART = 768 * 1024  # data bytes sent of a 1 MiB message


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-limits"), "llama", seed=3)


@pytest.fixture(scope="module")
def span(model_dir):
    return load_span(model_dir, *SPAN)[0]


@pytest.fixture
def serve(model_dir):
    """``serve(**limits)``: one server of SPAN on iroh with those limits (and 256 cache tokens)."""
    swarms: list[InProcessSwarm] = []

    def make(**limits) -> InProcessSwarm:
        settings = {"cache_tokens": 256, "share_counters": False, **limits}
        swarm = InProcessSwarm(model_dir, [BlockRange(*SPAN)], start_node=Node.start, transport=LOOPBACK, **settings)
        swarms.append(swarm)
        return swarm

    yield make
    for swarm in swarms:
        swarm.close()


async def honest_session(node: Node, swarm: InProcessSwarm, span) -> None:
    """A session of a 4-token prefill and two steps from ``node``: each output equals the local
    blocks' (what it returns without any attack)."""
    ticket = swarm.servers[0].ticket
    session = await Session.open(node, ticket, max_length=32)
    cache = span.allocate_cache(1, 32)
    for position, n in ((0, 4), (4, 1), (5, 1)):
        x = inputs(HIDDEN, n, start=position, seed=position)
        got = await session.step(position, x)
        torch.testing.assert_close(got, local_forward(span, x, cache, position), rtol=0, atol=1e-4)
    await session.close()


async def stream_on(conn, ticket) -> MessageStream:
    """A stream on connection ``conn`` itself (a node's pool would reuse one connection per peer;
    a hostile peer dials as many as it likes)."""
    return MessageStream(await conn.open_channel(), ticket.peer_id, LOOPBACK.limits, 5.0)


def frame(frame_type: int, payload: bytes) -> bytes:
    return FRAME_PREFIX.pack(len(payload) + 1, frame_type) + payload


def forward_head(nbytes: int, request_id: int = 1) -> bytes:
    """The HEAD frame of a ``forward`` whose one uint8 tensor has ``nbytes`` bytes."""
    header = {"v": 2, "k": "forward", "id": request_id, "m": {}, "t": [["u8", [nbytes], "raw"]], "n": nbytes}
    return frame(FRAME_HEAD, msgpack.packb(header, use_bin_type=True))


async def wire_error(stream) -> ErrorReply:
    """The wire error a stream was answered with before the node ended it."""
    reply = await stream.recv(10)
    assert reply.kind == "error", reply
    error = reply.meta
    assert isinstance(error, ErrorReply) and error.code == "wire", error
    return error


def run(swarm: InProcessSwarm, coro, timeout: float = 30.0):
    return swarm.runtime.run(coro, timeout)


# ---- connections and streams ----------------------------------------------------------------------
def test_connections_over_the_per_peer_limit_are_closed_and_an_honest_peer_is_served(serve, span):
    """A peer that dials connection after connection (its pool would reuse one; a hostile peer does
    not) gets 3 and no more: the 4th and 5th are closed on arrival. Closing one makes room again."""
    swarm = serve(max_connections_per_peer=3)
    server = swarm.servers[0]

    async def go():
        async with await Node.start(LOOPBACK) as hostile, await Node.start(LOOPBACK) as honest:
            connections, refused = [], 0
            for _ in range(5):
                conn = await hostile._dial(server.ticket, META, 5.0)
                try:
                    stream = await stream_on(conn, server.ticket)
                    await stream.request(Message("ping", 1, Ping()), timeout=5)
                    connections.append(conn)
                except ShoalError:
                    refused += 1
            assert (len(connections), refused) == (3, 2)
            assert server.node.guard.connections[hostile.id] == 3
            assert server.node.guard.refused["max_connections_per_peer"] == 2
            await honest_session(honest, swarm, span)
            connections[0].close("done")
            deadline = time.monotonic() + 5
            while server.node.guard.connections[hostile.id] == 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            conn = await hostile._dial(server.ticket, META, 5.0)
            stream = await stream_on(conn, server.ticket)
            assert (await stream.request(Message("ping", 2, Ping()), timeout=5)).kind == "result"

    run(swarm, go())


def test_streams_over_the_per_peer_limit_are_refused_and_an_honest_peer_is_served(serve, span):
    """8 open streams per peer: a 9th stream of the same peer is answered with a wire error
    ``over_limit`` naming the flag and ended; another peer's session steps as usual; once one of the
    8 ends, the peer may open another."""
    swarm = serve(max_streams_per_peer=8)
    server = swarm.servers[0]

    async def go():
        async with await Node.start(LOOPBACK) as hostile, await Node.start(LOOPBACK) as honest:
            held = []
            for i in range(8):  # each stream served once, then held open (the handler waits for more)
                stream = await hostile.open_stream(server.ticket, META)
                assert (await stream.request(Message("ping", i + 1, Ping()), timeout=5)).kind == "result"
                held.append(stream)
            extra = await hostile.open_stream(server.ticket, META)
            await extra.send(Message("ping", 99, Ping()))
            error = await wire_error(extra)
            assert error.reason == "over_limit" and "--max-streams-per-peer" in error.message
            assert server.node.guard.streams[hostile.id] == 8
            await honest_session(honest, swarm, span)
            await held[0].finish()
            deadline = time.monotonic() + 5
            while server.node.guard.streams[hostile.id] == 8 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            again = await hostile.open_stream(server.ticket, META)
            assert (await again.request(Message("ping", 100, Ping()), timeout=5)).kind == "result"

    run(swarm, go())


# ---- bytes of unfinished messages -------------------------------------------------------------------
def test_unfinished_messages_over_the_per_peer_and_node_bytes_limits_are_dropped(serve, span):
    """Messages of 1 MiB sent in part (the data stops at 768 KiB): a peer may have 2 MiB of such
    bytes held here, all peers 2.5 MiB. The stream that would pass either is answered ``over_limit``
    and ended (its bytes given back); the node never holds more than its limits; an honest session
    steps beside them, and once the hostile streams end nothing is held."""
    swarm = serve(max_message_bytes=MiB, max_inflight_bytes_per_peer=2 * MiB, max_inflight_bytes=5 * MiB // 2)
    guard = swarm.servers[0].node.guard
    part = frame(FRAME_DATA, bytes(PART))

    async def go():
        async with (
            await Node.start(LOOPBACK) as first,
            await Node.start(LOOPBACK) as second,
            await Node.start(LOOPBACK) as honest,
        ):
            ticket = swarm.servers[0].ticket

            async def unfinished(node: Node):
                stream = await node.open_stream(ticket, BLOCKS)
                await stream.send_raw(forward_head(MiB) + part)
                return stream

            async def held_by(node: Node, expected: int) -> None:
                deadline = time.monotonic() + 5
                while guard.inflight[node.id] != expected and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert guard.inflight[node.id] == expected

            mine = [await unfinished(first) for _ in range(3)]  # the third passes 2 MiB for this peer
            error = await wire_error(mine[2])
            assert error.reason == "over_limit" and "--max-inflight-bytes-per-peer" in error.message
            await held_by(first, 2 * PART)
            theirs = [await unfinished(second) for _ in range(2)]  # the second passes 2.5 MiB for the node
            error = await wire_error(theirs[1])
            assert error.reason == "over_limit" and "--max-inflight-bytes" in error.message
            await held_by(second, PART)
            assert guard.inflight_total == 3 * PART <= 5 * MiB // 2
            await honest_session(honest, swarm, span)
            for stream in [*mine[:2], theirs[0]]:
                await stream.abort()
            await held_by(first, 0)
            await held_by(second, 0)
            assert guard.inflight_total == 0
            assert guard.refused["max_inflight_bytes_per_peer"] == 1 and guard.refused["max_inflight_bytes"] == 1

    run(swarm, go())


def test_a_message_that_stalls_after_its_header_is_cut_at_the_data_timeout(serve, span):
    """A header and part of its data, then nothing: the stream is answered ``data_timeout`` about
    ``--data-timeout`` later (not at the 300 s idle deadline) and its bytes are given back."""
    swarm = serve(data_timeout=0.5)
    guard = swarm.servers[0].node.guard

    async def go():
        async with await Node.start(LOOPBACK) as hostile, await Node.start(LOOPBACK) as honest:
            stream = await hostile.open_stream(swarm.servers[0].ticket, BLOCKS)
            started = time.monotonic()
            await stream.send_raw(forward_head(MiB) + frame(FRAME_DATA, bytes(100_000)))
            error = await wire_error(stream)
            elapsed = time.monotonic() - started
            assert error.reason == "data_timeout" and "--data-timeout" in error.message
            assert 0.4 <= elapsed < 5, elapsed
            assert guard.inflight_total == 0
            await honest_session(honest, swarm, span)

    run(swarm, go())


def test_a_control_message_that_declares_tensors_is_refused_at_its_header(serve, span):
    """``info`` carries no tensors: an info header declaring 1 MiB of them is answered
    ``message_too_large`` before any data is read."""
    swarm = serve()

    async def go():
        async with await Node.start(LOOPBACK) as hostile, await Node.start(LOOPBACK) as honest:
            stream = await hostile.open_stream(swarm.servers[0].ticket, BLOCKS)
            header = {"v": 2, "k": "info", "id": 1, "m": {}, "t": [["u8", [MiB], "raw"]], "n": MiB}
            await stream.send_raw(frame(FRAME_HEAD, msgpack.packb(header, use_bin_type=True)))
            error = await wire_error(stream)
            assert error.reason == "message_too_large" and "info message of 1048576 > 0 bytes" in error.message
            await honest_session(honest, swarm, span)

    run(swarm, go())


# ---- work and cache ----------------------------------------------------------------------------------
def test_a_stateless_forward_over_the_position_limit_is_refused_and_a_long_one_runs_in_chunks(serve, span):
    """``--max-forward-positions 600``: a forward of 601 positions is a ``bad_request`` naming the
    flag, and so is a backward (which runs a row in one piece) of a row longer than
    ``--max-unchunked-row-tokens``; a forward of 2 x 250 (over the 256 positions a task runs at
    once) runs in chunks through a KV cache of its own and equals the blocks run in one piece."""
    swarm = serve(max_forward_positions=600, max_unchunked_row_tokens=300)

    async def go():
        async with await Node.start(LOOPBACK) as hostile, await Node.start(LOOPBACK) as honest:
            ticket = swarm.servers[0].ticket
            with pytest.raises(BadRequest, match=r"601 positions .* limit of 600 \(--max-forward-positions\)"):
                await forward(hostile, ticket, inputs(HIDDEN, 601, seed=1))
            long_row = [*inputs(HIDDEN, 301, seed=1), torch.randn(1, 301, HIDDEN)]  # hidden, positions, grad
            with pytest.raises(BadRequest, match=r"301 tokens per row .* limit of 300 \(--max-unchunked-row-tokens\)"):
                await hostile.request(ticket, BLOCKS, Message("backward", 1, tensors=long_row))
            x = inputs(HIDDEN, 250, batch=2, seed=2, mask=True)
            torch.testing.assert_close(await forward(honest, ticket, x), local_forward(span, x), rtol=0, atol=1e-4)
            await honest_session(honest, swarm, span)

    run(swarm, go())


def test_sessions_opened_and_never_stepped_hold_nothing_another_session_needs(serve, span):
    """A peer opens sessions reserving all the free cache and never steps them. An honest peer's
    open takes the reservation of such a session back, so the honest session opens and steps as
    without them; the peer's rows of such sessions are capped (``--max-unstepped-rows-per-peer``),
    and after ``--first-step-timeout`` they are closed."""
    swarm = serve(max_unstepped_rows_per_peer=6, first_step_timeout=1.0, cache_tokens=512)  # 32 pages

    async def go():
        async with await Node.start(LOOPBACK) as hostile, await Node.start(LOOPBACK) as honest:
            ticket = swarm.servers[0].ticket
            server = swarm.servers[0].server
            free = (await info(honest, ticket)).free_cache_tokens
            assert free == 512
            hoarders = [await Session.open(hostile, ticket, max_length=n, batch_size=2) for n in (96, 96, 64)]
            assert (await info(honest, ticket)).free_cache_tokens == 0  # they reserved it all
            with pytest.raises(BusyError, match=r"never stepped here; 1 more would pass the limit of 6 "
                                                r"\(--max-unstepped-rows-per-peer\)"):  # fmt: skip
                await Session.open(hostile, ticket, max_length=16)
            await honest_session(honest, swarm, span)
            assert server.counters.reservations_taken_back == 1
            deadline = time.monotonic() + 5
            while server.counters.sessions_timed_out < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert server.counters.sessions_timed_out == 3
            assert (await wait_for_info(honest, ticket, lambda r: r.free_cache_tokens == free)).counters is None
            for session in hoarders:
                await session.stream.finish()

    run(swarm, go())


def test_info_to_a_stranger_carries_no_counters(serve, span):
    """What routing needs (span, free cache, draining), not the counters that would tell a liar
    when an auditor replays its steps on a replica; the server's own metrics still have them."""
    swarm = serve()

    async def go():
        async with await Node.start(LOOPBACK) as stranger:
            await honest_session(stranger, swarm, span)
            reply = await info(stranger, swarm.servers[0].ticket)
            assert reply.counters is None and reply.free_cache_tokens == 256 and reply.span.blocks == BlockRange(*SPAN)
            assert swarm.servers[0].server.describe().counters.sessions_opened == 1

    run(swarm, go())


def test_an_idle_sessions_unused_reservation_goes_to_a_session_that_needs_pages(serve, span):
    """A peer reserves the whole cache with one session, steps it once and goes idle. An honest open
    is busy while that session is recent, and admitted once it has been idle for
    ``--reclaim-idle-after``: the idle session keeps the pages its positions hold (and goes on
    stepping), the rest of its reservation goes to the honest session."""
    swarm = serve(reclaim_idle_after=2.0)  # 256 tokens: 16 pages

    async def go():
        async with await Node.start(LOOPBACK) as hostile, await Node.start(LOOPBACK) as honest:
            ticket = swarm.servers[0].ticket
            hoarder = await Session.open(hostile, ticket, max_length=256)
            cache = span.allocate_cache(1, 32)
            x = inputs(HIDDEN, 16, seed=1)
            torch.testing.assert_close(await hoarder.step(0, x), local_forward(span, x, cache, 0), rtol=0, atol=1e-4)
            with pytest.raises(BusyError, match=r"needs 4 KV pages of 16, 0 of 16 are free"):
                await Session.open(honest, ticket, max_length=64)
            await asyncio.sleep(2.2)
            await honest_session(honest, swarm, span)
            assert swarm.servers[0].server.counters.reservations_taken_back == 1
            y = inputs(HIDDEN, 1, start=16, seed=2)  # its positions kept: it steps on
            torch.testing.assert_close(await hoarder.step(16, y), local_forward(span, y, cache, 16), rtol=0, atol=1e-4)
            await hoarder.close()

    run(swarm, go())
