"""The server backend keeps all of a server's torch work on its one compute thread.

The first OpenMP parallel region a thread opens gives that thread a libgomp pool of its own. A
session cache zero-filled on the event loop thread made a second pool next to the compute
thread's; with more pool threads than CPUs libgomp stops spinning at barriers, and every later
decode step of the server ran ~1.8x slower (bench.profile_step, 270M llama: 40 ms per 8-layer
step against 22 ms in-process)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from shoal.checkpoints import load_span
from shoal.server.backend import SpanBackend
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    span, _ = load_span(tiny_checkpoint(tmp_path_factory.mktemp("tiny-backend")), 0, 2)
    return span


def test_session_cache_is_filled_on_the_compute_thread(span, monkeypatch):
    threads: list[str] = []
    allocate = span.allocate_cache

    def recording(batch_size: int, max_length: int):
        threads.append(threading.current_thread().name)
        return allocate(batch_size, max_length)

    monkeypatch.setattr(span, "allocate_cache", recording)
    backend = SpanBackend(span, 64)

    async def open_and_step() -> torch.Tensor:
        cache = await backend.allocate_cache(1, 1200)  # 2 kv heads x 1200 x 16 per block: above torch's grain size
        return await backend.run(torch.randn(1, 3, 64), torch.arange(3)[None], None, cache, 0)

    try:
        out = asyncio.run(open_and_step())
    finally:
        backend.shutdown()
    assert len(threads) == 1 and threads[0].startswith("shoal-compute"), threads  # compute_thread()'s name
    assert out.shape == (1, 3, 64) and torch.isfinite(out).all()
