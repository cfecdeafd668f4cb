"""The lean stream calls behave exactly like the binding's own methods, call for call."""

from __future__ import annotations

import asyncio

import iroh
import pytest
import torch
from iroh import iroh_ffi

from shoal.transport import binding, fastcall
from shoal.wire.tensors import tensor_bytes
from tests.helpers.aio import run

pytestmark = pytest.mark.timeout(120)
ALPN = b"shoal-test/fastcall/1"


async def _endpoint() -> iroh.Endpoint:
    binding.apply()
    iroh_ffi.uniffi_set_event_loop(asyncio.get_running_loop())
    options = iroh.EndpointOptions(
        preset=iroh.preset_minimal(),
        relay_mode=iroh.RelayMode.disabled(),
        bind_addr="127.0.0.1:0",
        secret_key=iroh.SecretKey.generate().to_bytes(),
        alpns=[ALPN],
    )
    return await iroh.Endpoint.bind(options)


async def _stream_pair() -> tuple[list, object, object]:
    """Two endpoints in this process and one open bidirectional stream between them:
    ``(endpoints, (send, recv) of the dialler, (send, recv) of the acceptor)``."""
    server, client = await _endpoint(), await _endpoint()
    addr = iroh.EndpointAddr(server.id(), None, server.addr().direct_addresses())

    async def accept():
        incoming = await server.accept_next()
        conn = await (await incoming.accept()).connect()
        return conn, await conn.accept_bi()

    accepting = asyncio.ensure_future(accept())
    conn = await client.connect(addr, ALPN)
    dialled = await conn.open_bi()
    await fastcall.write_all(dialled.send(), b"hi")  # a stream is announced by its first bytes
    server_conn, accepted = await accepting
    assert await fastcall.read_exact(accepted.recv(), 2) == b"hi"
    keep = [server, client, conn, server_conn]
    return keep, (dialled.send(), dialled.recv()), (accepted.send(), accepted.recv())


async def _close(endpoints: list) -> None:
    for ep in endpoints[:2]:
        await asyncio.wait_for(ep.close(), 5)


def test_lean_calls_are_active_on_the_pinned_binding():
    assert fastcall.available()


@pytest.mark.parametrize("size", [1, 1000, 70_000, 5 * 1024 * 1024 + 3])
def test_bytes_cross_unchanged_both_ways_against_the_binding(size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)

    async def go():
        keep, (c_send, c_recv), (s_send, s_recv) = await _stream_pair()
        # (writer and reader run together: a stream's flow-control window is smaller than 5 MiB)
        # lean write, binding read_exact
        _, got = await asyncio.gather(fastcall.write_all(c_send, payload), s_recv.read_exact(size))
        assert got == payload
        # binding write, lean read_exact
        _, got = await asyncio.gather(s_send.write_all(payload), fastcall.read_exact(c_recv, size))
        assert got == payload
        # lean write of a tensor's memoryview, lean read until all arrived
        view = tensor_bytes(torch.arange(size // 4 + 1, dtype=torch.int32))

        async def read_all() -> bytes:
            got = b""
            while len(got) < view.nbytes:
                chunk = await fastcall.read(s_recv, 65536)
                assert 0 < len(chunk) <= 65536
                got += chunk
            return got

        _, got = await asyncio.gather(fastcall.write_all(c_send, view), read_all())
        assert got == view.tobytes()
        # end of stream: the lean read returns what the binding's does
        await s_send.finish()
        assert await fastcall.read(c_recv, 100) == b""
        await _close(keep)

    run(go())


def test_errors_come_out_as_the_bindings_iroh_error():
    async def go():
        keep, (c_send, c_recv), (s_send, s_recv) = await _stream_pair()
        await s_send.reset(7)
        with pytest.raises(iroh.IrohError):
            while True:  # the reset may race bytes still in flight; it must surface as an IrohError
                if not await fastcall.read(c_recv, 100):
                    raise AssertionError("a reset stream must not read as a clean end")
        await s_recv.stop(9)
        with pytest.raises(iroh.IrohError):
            for _ in range(100):  # the stop reaches us after a round trip
                await fastcall.write_all(c_send, b"x" * 1000)
                await asyncio.sleep(0.01)
        with pytest.raises(ValueError):
            await fastcall.read(c_recv, -1)
        await _close(keep)

    run(go())


def test_a_cancelled_read_leaves_nothing_behind_and_the_stream_keeps_working():
    async def go():
        keep, (_, c_recv), (s_send, _) = await _stream_pair()
        for _ in range(20):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(fastcall.read(c_recv, 100), 0.01)
        await asyncio.sleep(0.05)
        assert not fastcall._pending  # every continuation was consumed (freed futures call back once)
        await fastcall.write_all(s_send, b"after")
        assert await fastcall.read_exact(c_recv, 5) == b"after"
        await _close(keep)

    run(go())


def test_without_the_lean_path_the_same_calls_go_through_the_binding(monkeypatch):
    monkeypatch.setattr(fastcall, "_AVAILABLE", False)

    async def go():
        keep, (c_send, c_recv), (s_send, s_recv) = await _stream_pair()
        await fastcall.write_all(c_send, memoryview(b"abcdef")[1:4])
        assert await fastcall.read_exact(s_recv, 3) == b"bcd"
        await fastcall.write_all(s_send, b"xyz")
        assert await fastcall.read(c_recv, 10) == b"xyz"
        await _close(keep)

    run(go())
