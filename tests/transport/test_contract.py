"""One contract, two transports: every test runs on iroh (:class:`Node`, both peers in this
process), in memory (:class:`MemoryNode`), and on iroh nodes that reach each other in-process
(:meth:`BaseNode.add_local_peer`, a gateway and its own span), and must behave the same on all:
tensors, deadlines, closed streams, size limits, malformed frames, protocol mismatch, dead peers,
concurrency, meta."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgpack
import pytest
import torch

from shoal.errors import BadRequest, ClosedError, ConnectTimeout, MessageTooLarge, ProtocolMismatch, RequestTimeout
from shoal.transport import META, BaseNode, MemoryNetwork, MessageStream, Node, Protocol, Ticket, TransportConfig
from shoal.transport.identity import generate_key
from shoal.transport.memory import peer_id_of
from shoal.wire import CAPABILITIES, FRAME_DATA, FRAME_HEAD, MAX_FRAME_PAYLOAD, Limits, Message, tensors
from shoal.wire.schema import ErrorReply, HelloReply, Ping
from tests.helpers.aio import run

pytestmark = pytest.mark.timeout(60)

CONFIG = TransportConfig(bind_addr="127.0.0.1:0")
CONTRACT = Protocol("contract", 1)
SMALL = Limits(max_message_bytes=64 * 1024)
Start = Callable[..., Awaitable[BaseNode]]


async def contract_handler(stream: MessageStream, peer_id: str) -> None:
    """``forward``: echo the tensors. ``info``: never answered. ``close``: end the stream, unanswered."""
    while True:
        request = await stream.recv(30)
        if request.kind == "close":
            return
        if request.kind == "forward":
            await stream.send(Message("result", request.id, tensors=request.tensors))


@pytest.fixture(params=["iroh", "memory", "local"])
def start(request) -> Start:
    """Starts a node on this test's transport: ``await start(config=..., handlers=...)``."""
    if request.param == "iroh":
        return lambda config=CONFIG, handlers=None: Node.start(config, handlers)
    if request.param == "local":  # iroh nodes, each reaching the live ones started before in-process
        started: list[BaseNode] = []

        async def local(config=CONFIG, handlers=None) -> BaseNode:
            node = await Node.start(config, handlers)
            for other in started:
                if not other.closed:
                    node.add_local_peer(other)
            started.append(node)
            return node

        return local
    network = MemoryNetwork()
    return lambda config=CONFIG, handlers=None: network.start(config, handlers)


@contextlib.asynccontextmanager
async def peers(
    start: Start, server_config: TransportConfig = CONFIG, client_config: TransportConfig = CONFIG
) -> AsyncIterator[tuple[BaseNode, BaseNode]]:
    server = await start(config=server_config, handlers={CONTRACT: contract_handler})
    client = await start(config=client_config)
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and bytes(tensors.tensor_bytes(a)) == bytes(tensors.tensor_bytes(b))
    )


def frame(frame_type: int, payload: bytes) -> bytes:
    return struct.pack(">IB", len(payload) + 1, frame_type) + payload


def head(**changes) -> bytes:
    header = {"v": 2, "k": "ping", "id": 7, "m": {}, "t": [["f32", [4], "raw"]], "n": 16}
    header.update(changes)
    return frame(FRAME_HEAD, msgpack.packb(header))


DATA16 = frame(FRAME_DATA, bytes(16))
MALFORMED = [
    ("bad_frame_type", struct.pack(">IB", 5, 7) + b"abcd"),
    ("frame_too_large", struct.pack(">IB", 1 << 30, FRAME_HEAD)),
    ("bad_header", frame(FRAME_HEAD, b"\xc1not msgpack")),
    ("bad_version", head(v=1) + DATA16),
    ("unknown_kind", head(k="launch") + DATA16),
    ("size_mismatch", head(n=15) + DATA16),
    ("unexpected_frame", DATA16),
    ("truncated", head()[:9]),
]


def test_request_response_carries_tensors_of_several_dtypes_bit_for_bit(start):
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int8,
        torch.uint8,
        torch.bool,
    ]
    shapes = [(), (0,), (3,), (2, 3, 4), (1, 1, 5)]

    async def go():
        async with peers(start) as (server, client):
            stream = await client.open_stream(server.ticket(), CONTRACT)
            for i, dtype in enumerate(dtypes):
                sent = [sample(dtype, shape, i * 10 + j) for j, shape in enumerate(shapes)]
                reply = await stream.request(Message("forward", i, tensors=sent))
                assert reply.kind == "result" and reply.id == i
                assert all(same_bits(a, b) for a, b in zip(sent, reply.tensors, strict=True)), dtype
            big = [sample(torch.float32, (MAX_FRAME_PAYLOAD // 4 + 1000,), 1), sample(torch.bfloat16, (3, 1000), 2)]
            reply = await client.request(server.ticket(), CONTRACT, Message("forward", 99, tensors=big))
            assert all(same_bits(a, b) for a, b in zip(big, reply.tensors, strict=True))
            await stream.finish()

    run(go(), timeout=30)


def test_a_request_never_answered_times_out_within_its_deadline(start):
    async def go():
        async with peers(start) as (server, client):
            stream = await client.open_stream(server.ticket(), CONTRACT)
            started = time.monotonic()
            with pytest.raises(RequestTimeout):
                await stream.request(Message("info", 1), timeout=0.3)
            elapsed = time.monotonic() - started
            assert stream.broken
            other = await client.open_stream(server.ticket(), CONTRACT)  # the caller's cancellation is no timeout
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(other.recv(30), 0.1)
            assert not other.broken
            reply = await other.request(Message("forward", 2, tensors=[torch.ones(2)]), timeout=5)  # and it serves on
            assert reply.id == 2 and torch.equal(reply.tensors[0], torch.ones(2))
            return elapsed

    assert 0.28 <= run(go(), timeout=30) < 1.0


def test_a_stream_the_peer_closes_raises_closed_error(start):
    async def go():
        async with peers(start) as (server, client):
            stream = await client.open_stream(server.ticket(), CONTRACT)
            await stream.send(Message("close", 1))  # the handler returns: its stream ends
            with pytest.raises(ClosedError):
                await stream.recv(5)
            assert stream.broken
            finished = await client.open_stream(server.ticket(), META)
            await finished.finish()  # our side ends: the meta handler ends its side too
            with pytest.raises(ClosedError):
                await finished.recv(5)
            pending = await client.open_stream(server.ticket(), CONTRACT)
            waiting = asyncio.ensure_future(pending.recv(5))
            await asyncio.sleep(0.05)
            await server.close()  # closing a node ends its streams
            with pytest.raises(ClosedError):
                await waiting

    run(go(), timeout=30)


def test_an_oversized_message_is_refused_and_the_server_serves_on(start):
    async def go():
        async with peers(start, server_config=TransportConfig(bind_addr="127.0.0.1:0", limits=SMALL)) as (
            server,
            client,
        ):
            too_big = torch.zeros(SMALL.max_message_bytes + 1, dtype=torch.uint8)
            with pytest.raises(BadRequest, match="message_too_large"):
                await client.request(server.ticket(), CONTRACT, Message("forward", 1, tensors=[too_big]))
            assert server.rejected_frames["message_too_large"] == 1
            fits = torch.arange(1000, dtype=torch.int32)
            reply = await client.request(server.ticket(), CONTRACT, Message("forward", 2, tensors=[fits]))
            assert torch.equal(reply.tensors[0], fits)
            # a receiver refuses a reply over its own limit, before reading its bytes
            small_client = await start(
                config=TransportConfig(bind_addr="127.0.0.1:0", limits=Limits(max_message_bytes=1000))
            )
            try:
                stream = await small_client.open_stream(server.ticket(), META)
                with pytest.raises(MessageTooLarge, match="message_too_large"):
                    await stream.request(Message("ping", 3, tensors=[torch.zeros(2000, dtype=torch.uint8)]))
                assert stream.broken
            finally:
                await small_client.close()

    run(go(), timeout=30)


def test_malformed_frames_get_a_wire_error_then_the_stream_ends_and_the_node_serves_on(start):
    async def go():
        async with peers(start) as (server, client):
            for reason, data in MALFORMED:
                stream = await client.open_stream(server.ticket(), META)
                await stream.send_raw(data)
                await stream.finish()
                reply = await stream.recv(5)
                assert reply.kind == "error", reason
                error = reply.meta
                assert isinstance(error, ErrorReply) and (error.code, error.reason) == ("wire", reason), error
                with pytest.raises(ClosedError):
                    await stream.recv(5)
            assert server.rejected_frames == {reason: 1 for reason, _ in MALFORMED}
            # metadata that does not validate is a request error, not a broken stream
            stream = await client.open_stream(server.ticket(), META)
            with pytest.raises(BadRequest, match="echo"):
                await stream.request(Message("ping", 5, {"echo": "yes"}))
            reply = await stream.request(Message("ping", 6, tensors=[torch.ones(3)]))
            assert reply.id == 6 and torch.equal(reply.tensors[0], torch.ones(3)) and not stream.broken

    run(go(), timeout=30)


def test_a_protocol_the_peer_does_not_serve_is_refused_naming_both_sides(start):
    async def go():
        async with peers(start) as (server, client):
            for wanted in (Protocol("contract", 2), Protocol("teleport", 1)):
                with pytest.raises(ProtocolMismatch) as info:
                    await client.request(server.ticket(), wanted, Message("forward", 1))
                assert info.value.wanted == str(wanted)
                assert info.value.remote_speaks == ["shoal/contract/1", "shoal/meta/1"]
                assert str(wanted) in str(info.value) and "shoal/contract/1" in str(info.value)
            reply = await client.request(server.ticket(), CONTRACT, Message("forward", 2, tensors=[torch.ones(2)]))
            assert torch.equal(reply.tensors[0], torch.ones(2))

    run(go(), timeout=30)


def test_dialling_a_closed_node_fails(start):
    async def go():
        gone = await start()
        dead = gone.ticket()
        await gone.close()
        async with peers(start) as (server, client):
            started = time.monotonic()
            with pytest.raises(ConnectTimeout):
                await client.connect(dead, META, timeout=0.3)
            elapsed = time.monotonic() - started
            await client.close()
            with pytest.raises(ClosedError, match="node is closed"):
                await client.connect(server.ticket(), META)
            return elapsed

    assert 0.28 <= run(go(), timeout=30) < 1.0


def test_concurrent_streams_share_one_connection(start):
    async def go():
        async with peers(start) as (server, client):

            async def one(i: int) -> bool:
                x = torch.full((64,), float(i))
                reply = await client.request(server.ticket(), CONTRACT, Message("forward", i, tensors=[x]))
                return reply.id == i and torch.equal(reply.tensors[0], x)

            assert all(await asyncio.gather(*(one(i) for i in range(24))))
            assert len(client._conns) == 1
            streams = [await client.open_stream(server.ticket(), CONTRACT) for _ in range(6)]
            for i, stream in enumerate(streams):
                await stream.send(Message("forward", i, tensors=[torch.tensor([i])]))
            for i, stream in reversed(list(enumerate(streams))):  # each stream's reply is its own
                reply = await stream.recv(5)
                assert reply.id == i and reply.tensors[0].item() == i
            assert len(client._conns) == 1

    run(go(), timeout=30)


def test_meta_hello_ping_ticket_and_dropped_connections(start):
    async def go():
        async with peers(start) as (server, client):
            ticket = server.ticket("swarm-1")
            assert Ticket.parse(str(ticket)) == ticket and ticket.swarm_id == "swarm-1"
            assert len(server.id) == 64 and int(server.id, 16) >= 0 and server.id != client.id
            assert client.rtt_ms(ticket, META) is None  # not connected yet
            reply = await client.request(ticket, META, Message("hello", 1))
            hello = reply.reply(HelloReply)
            assert hello.protocols == server.protocols == ["shoal/contract/1", "shoal/meta/1"]
            assert hello.capabilities == CAPABILITIES
            x = torch.arange(10.0)
            echoed = await client.request(ticket, META, Message("ping", 2, Ping(), [x]))
            assert echoed.id == 2 and torch.equal(echoed.tensors[0], x)
            silent = await client.request(ticket, META, Message("ping", 3, Ping(echo=False), [x]))
            assert silent.tensors == []
            assert client.rtt_ms(ticket, META) >= 0.0
            # a dropped connection ends its streams; the next request dials anew
            stream = await client.open_stream(ticket, META)
            assert (await stream.request(Message("ping", 4))).id == 4
            client.drop_connection(server.id)
            assert client.rtt_ms(ticket, META) is None
            with pytest.raises(ClosedError):
                await stream.request(Message("ping", 5), timeout=5)
            assert (await client.request(ticket, META, Message("ping", 6))).id == 6

    run(go(), timeout=30)


def test_a_memory_node_has_the_peer_id_iroh_gives_the_same_key():
    key = generate_key()

    async def go():
        async with await Node.start(CONFIG, secret_key=key) as node:
            return node.id

    assert run(go(), timeout=30) == peer_id_of(key)


def test_large_messages_streamed_both_ways_arrive_whole_and_in_order(start):
    """More bytes in flight than any window: the writer waits for the reader, nothing reorders."""
    count, size = 8, 3 * 1024 * 1024

    async def go():
        async with peers(start) as (server, client):
            stream = await client.open_stream(server.ticket(), CONTRACT)

            async def send_all() -> None:
                for i in range(count):
                    await stream.send(Message("forward", i, tensors=[torch.full((size,), i, dtype=torch.uint8)]))

            sender = asyncio.ensure_future(send_all())
            for i in range(count):
                reply = await stream.recv(10)
                data = reply.tensors[0]
                assert reply.id == i and data.shape == (size,) and int(data[0]) == int(data[-1]) == i
            await sender

    run(go(), timeout=30)


def test_writing_to_a_stream_whose_reader_is_gone_fails_instead_of_waiting(start):
    async def go():
        async with peers(start) as (server, client):
            stream = await client.open_stream(server.ticket(), CONTRACT)
            await stream.send(Message("close", 1))  # the handler returns and drops its stream
            with pytest.raises(ClosedError):
                await stream.recv(5)
            block = torch.zeros(MAX_FRAME_PAYLOAD, dtype=torch.uint8)
            with pytest.raises(ClosedError):
                for i in range(64):  # far more than any window
                    await stream.send(Message("forward", i, tensors=[block]))

    run(go(), timeout=30)
