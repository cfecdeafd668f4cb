"""Real iroh endpoints, in separate processes where it matters."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from shoal.errors import ClosedError, ConnectTimeout, ProtocolMismatch, RemoteError, RequestTimeout, TicketError
from shoal.launch import ServerProcess
from shoal.transport import META, Node, Protocol, Ticket, TransportConfig, binding
from shoal.wire import DTYPES, MAX_FRAME_PAYLOAD, Message
from shoal.wire.schema import HelloReply
from tests.helpers.aio import run
from tests.helpers.servers import ONE_THREAD
from tests.transport.test_wire import SHAPES, same_bits, sample

pytestmark = pytest.mark.timeout(120)
CONFIG = TransportConfig(bind_addr="127.0.0.1:0")


@pytest.fixture(scope="module")
def peer():
    process = ServerProcess(["-m", "tests.helpers.peer"], env=ONE_THREAD)
    yield process
    process.stop()


def test_tensors_of_every_dtype_and_shape_cross_processes_bit_for_bit(peer):
    big = [sample(torch.float32, (MAX_FRAME_PAYLOAD // 4 + 1000,)), sample(torch.bfloat16, (3, MAX_FRAME_PAYLOAD // 3))]

    async def go():
        async with await Node.start(CONFIG) as node:
            stream = await node.open_stream(peer.ticket, META)
            for i, dtype in enumerate(DTYPES.values()):
                tensors = [sample(dtype, shape, i) for shape in SHAPES]
                reply = await stream.request(Message("ping", i, tensors=tensors))
                assert reply.kind == "result" and reply.id == i
                assert all(same_bits(a, b) for a, b in zip(tensors, reply.tensors, strict=True)), dtype
            reply = await stream.request(Message("ping", 99, tensors=big))
            assert all(same_bits(a, b) for a, b in zip(big, reply.tensors, strict=True))

    run(go())


def test_one_connection_carries_many_concurrent_streams(peer):
    async def go():
        async with await Node.start(CONFIG) as node:

            async def one(i: int) -> bool:
                x = torch.full((64,), float(i))
                reply = await node.request(peer.ticket, META, Message("ping", i, tensors=[x]))
                return torch.equal(reply.tensors[0], x)

            results = await asyncio.gather(*(one(i) for i in range(32)))
            assert all(results)
            assert len(node._conns) == 1  # one pooled connection for the peer

    run(go())


def test_recv_deadlines_fire_on_time_and_move_on_with_each_message(peer):
    async def go():
        async with await Node.start(CONFIG) as node:
            stream = await node.open_stream(peer.ticket, META)
            # replies keep coming for longer than one deadline: no timeout (the stream's timer fires
            # mid-recv and re-arms for the deadline of the recv in progress)
            until, i = time.monotonic() + 0.8, 0
            while time.monotonic() < until:
                await stream.send(Message("ping", i))
                assert (await stream.recv(0.3)).id == i
                i += 1
            await asyncio.sleep(0.4)  # the timer fires with no recv waiting
            await stream.send(Message("ping", i))
            assert (await stream.recv(0.3)).id == i
            # a long deadline, then a short one: the short one fires on time
            await stream.send(Message("ping", 99))
            await stream.recv(30)
            started = time.monotonic()
            with pytest.raises(RequestTimeout):
                await stream.recv(0.3)
            assert 0.25 <= time.monotonic() - started < 2.0
            assert stream.broken
            # the caller's own cancellation is not turned into a timeout
            other = await node.open_stream(peer.ticket, META)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(other.recv(30), 0.2)
            assert not other.broken

    run(go())


def test_connecting_to_a_dead_ticket_times_out_within_the_bound():
    async def go():
        gone = await Node.start(CONFIG)
        dead = gone.ticket()
        await gone.close()
        async with await Node.start(CONFIG) as node:
            with pytest.raises(TicketError):
                await node.connect(Ticket("0f" * 32, ("127.0.0.1:9",)), META, timeout=1.0)
            started = time.monotonic()
            with pytest.raises(ConnectTimeout):
                await node.connect(dead, META, timeout=1.0)
            return time.monotonic() - started

    elapsed = run(go())
    assert 0.9 <= elapsed < 1.5


def test_unknown_protocol_or_version_is_refused_naming_both_sides(peer):
    async def go():
        async with await Node.start(CONFIG) as node:
            for wanted in (Protocol("meta", 2), Protocol("teleport", 1)):
                with pytest.raises(ProtocolMismatch) as info:
                    await node.request(peer.ticket, wanted, Message("hello", 1))
                assert info.value.wanted == str(wanted)
                assert info.value.remote_speaks == ["shoal/meta/1"]
                assert "shoal/meta/1" in str(info.value) and str(wanted) in str(info.value)
            reply = await node.request(peer.ticket, META, Message("hello", 2))  # the same peer, a known one
            assert reply.reply(HelloReply).protocols == ["shoal/meta/1"]

    run(go())


def test_remote_error_reply_and_stream_end(peer):
    async def go():
        async with await Node.start(CONFIG) as node:
            with pytest.raises(RemoteError, match="does not serve"):
                await node.request(peer.ticket, META, Message("forward", 1))
            stream = await node.open_stream(peer.ticket, META)
            await stream.finish()
            with pytest.raises(ClosedError):
                await stream.recv(5)

    run(go())


def test_identity_file_survives_a_restart(tmp_path):
    key_file = tmp_path / "peer.key"
    first = ServerProcess(["-m", "tests.helpers.peer", "--key-file", str(key_file)], env=ONE_THREAD)
    first.stop()
    second = ServerProcess(["-m", "tests.helpers.peer", "--key-file", str(key_file)], env=ONE_THREAD)
    try:
        assert second.ticket.peer_id == first.ticket.peer_id
    finally:
        second.stop()
    key_file.write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="corrupt"):
        ServerProcess(["-m", "tests.helpers.peer", "--key-file", str(key_file)], env=ONE_THREAD)


def test_send_path_fix_is_active_and_far_faster_than_stock():
    """The binding lowers bytes into Rust with a per-byte Python loop; our fix memmoves."""
    from iroh import iroh_ffi

    assert binding.apply() and binding.is_active()
    payload = bytes(range(256)) * (4 * 1024 * 1024 // 256)

    def lower(write) -> tuple[float, bytes]:
        builder = iroh_ffi._UniffiRustBufferBuilder()
        started = time.perf_counter()
        write(builder, payload)
        elapsed = time.perf_counter() - started
        rbuf = builder.finalize()
        data = rbuf.data[: rbuf.len]
        rbuf.free()
        return elapsed, data

    fixed_s, fixed_bytes = lower(iroh_ffi._UniffiRustBufferBuilder.write)
    stock_s, stock_bytes = lower(binding.STOCK_WRITE)
    assert fixed_bytes == stock_bytes == payload
    assert stock_s / fixed_s > 20, f"stock {stock_s:.3f}s vs fixed {fixed_s:.5f}s"
