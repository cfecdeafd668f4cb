"""Binding objects finalized on iroh's threads are freed later, on the event loop (issue #32).

A garbage collection that starts inside iroh's continuation callback (a tokio thread, holding a
connection's lock) used to run the binding's ``__del__`` there: dropping a stream half takes that
same lock, and the endpoint hung for good. ``python -m bench.fuzz`` hit it in about half of its
100,000-frame runs. :mod:`shoal.transport.binding` defers those frees.
"""

from __future__ import annotations

import _thread
import asyncio
import collections
import gc
import threading

import iroh
import pytest
import torch

from shoal.transport import Node, Protocol, TransportConfig, binding
from shoal.wire import Message
from shoal.wire.schema import Ping

pytestmark = pytest.mark.timeout(120)
CONFIG = TransportConfig(bind_addr="127.0.0.1:0")
ECHO = Protocol("echo", 1)


def queued(deferred: collections.deque) -> set[int]:
    return {handle for _, handle in list(deferred)}


class RecordingDeque(collections.deque):
    """A stand-in for binding's queue of deferred frees that records what was queued."""

    def __init__(self) -> None:
        super().__init__()
        self.handles: list[int] = []

    def append(self, item) -> None:
        self.handles.append(item[1])
        super().append(item)


def drop_on_a_foreign_thread(holder: list) -> None:
    """Drop the last reference in ``holder`` on a thread Python did not start (as iroh's are seen)."""
    done = threading.Event()

    def body() -> None:
        assert isinstance(threading.current_thread(), threading._DummyThread)
        holder.clear()
        done.set()

    _thread.start_new_thread(body, ())
    assert done.wait(10)


def test_every_binding_class_frees_later_when_finalized_on_a_foreign_thread(monkeypatch):
    """Every class whose ``__del__`` frees a handle is covered; dropped on a foreign thread, a
    binding object's handle is queued for :func:`binding.release_deferred`; on ours it is freed at once."""
    binding.apply()
    classes = binding.binding_classes()
    assert {iroh.SendStream, iroh.RecvStream, iroh.BiStream, iroh.Connection, iroh.Endpoint} <= set(classes)
    assert all(getattr(vars(cls)["__del__"], binding._DEFERRING, False) for cls in classes)
    deferred = RecordingDeque()
    monkeypatch.setattr(binding, "_deferred", deferred)
    monkeypatch.setattr(binding, "_loop", None)  # no loop to ask: the handle waits for a release

    holder = [iroh.RelayMode.disabled()]
    handle = holder[0]._handle
    drop_on_a_foreign_thread(holder)
    assert handle in deferred.handles
    binding.release_deferred()
    assert handle not in queued(deferred)

    here = iroh.RelayMode.disabled()
    queued_before = len(deferred.handles)
    del here
    assert len(deferred.handles) == queued_before  # freed at once, nothing queued


def test_a_free_deferred_on_a_foreign_thread_is_released_by_the_loop_at_once(monkeypatch):
    """With the transport's loop known, a deferred free does not wait for the next stream: the
    loop is asked to release it as soon as it is queued."""
    deferred = RecordingDeque()
    monkeypatch.setattr(binding, "_deferred", deferred)

    async def go() -> int:
        binding.apply(asyncio.get_running_loop())
        holder = [iroh.RelayMode.disabled()]
        handle = holder[0]._handle
        drop_on_a_foreign_thread(holder)
        assert handle in deferred.handles
        for _ in range(100):  # the loop runs the release once we yield to it
            await asyncio.sleep(0.01)
            if handle not in queued(deferred):
                return True
        return False

    assert asyncio.run(asyncio.wait_for(go(), 30))


class CollectingLoop(asyncio.SelectorEventLoop):
    """Starts a garbage collection whenever an iroh thread wakes the loop: the moment that hung."""

    collections = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        if isinstance(threading.current_thread(), threading._DummyThread):
            self.collections += 1
            gc.collect()
        return super().call_soon_threadsafe(*args, **kwargs)


def test_stream_halves_collected_on_iroh_threads_are_freed_on_the_loop_and_service_goes_on(monkeypatch):
    """Each served stream is left in a reference cycle; collections run inside iroh's callbacks.
    Every request is answered, the halves collected there were deferred, and none is left behind
    once the nodes close."""
    binding.apply()
    deferred = RecordingDeque()
    monkeypatch.setattr(binding, "_deferred", deferred)

    served: set[int] = set()  # handles of the served streams' halves

    async def echo(stream, peer_id):
        channel = stream._channel
        served.update((channel._send._handle, channel._recv._handle))
        message = await stream.recv()
        await stream.send(Message("result", message.id, tensors=message.tensors))
        cycle = [stream]
        cycle.append(cycle)  # garbage only a collection frees

    async def go() -> int:
        answered = 0
        async with await Node.start(CONFIG, {ECHO: echo}) as server, await Node.start(CONFIG) as client:
            for i in range(40):
                check = torch.full((4,), float(i))
                request = Message("ping", 1, Ping(), [check])
                reply = await asyncio.wait_for(client.request(server.ticket(), ECHO, request), 10)
                answered += torch.equal(reply.tensors[0], check)
        return answered

    loop = CollectingLoop()
    try:
        answered = loop.run_until_complete(asyncio.wait_for(go(), 90))
    finally:
        loop.close()
    assert answered == 40
    assert loop.collections > 0 and deferred.handles
    assert not queued(deferred) & served  # released: by the loop, before later streams, and when the nodes closed
