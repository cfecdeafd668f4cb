"""What the batching tests share besides their fixtures (``conftest.py``): sessions' step plans,
their solo runs (what a batch must equal), and a server's batcher over a span with its own pages."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import torch

from shoal.models.kv import PagedCache
from shoal.server.backend import SpanBackend, compute_thread

HIDDEN = 64
PAGE = 16
ATOL = 1e-4
WAIT = 10.0
SCALE = 0.3  # the tiny model's embedding scale (its init)


@dataclass
class Plan:
    """One session: its rows, max_length, prompt and decode steps (random hidden states, seeded),
    the rows' left padding (masked out), and the peer it belongs to."""

    batch: int
    max_length: int
    prompt: int
    decode: int
    seed: int
    padding: tuple[int, ...] = ()
    peer: str = "peer-a"

    def steps(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]]:
        """``(hidden, position_ids, mask, past_length)`` of the prefill, then of each decode step."""
        generator = torch.Generator().manual_seed(self.seed)
        total = self.prompt + self.decode
        hidden = torch.randn(self.batch, total, HIDDEN, generator=generator) * SCALE
        mask = torch.ones(self.batch, total, dtype=torch.bool)
        for row, pad in enumerate(self.padding):
            mask[row, :pad] = False
        masked = bool(self.padding)
        bounds = [(0, self.prompt)] + [(p, p + 1) for p in range(self.prompt, total)]
        return [
            (hidden[:, a:b], torch.arange(a, b).expand(self.batch, -1), mask[:, :b] if masked else None, a)
            for a, b in bounds
        ]


PLANS = [
    Plan(batch=1, max_length=40, prompt=5, decode=6, seed=1),
    Plan(batch=2, max_length=64, prompt=24, decode=4, seed=2, padding=(0, 3)),
    Plan(batch=3, max_length=20, prompt=1, decode=8, seed=3),
    Plan(batch=1, max_length=50, prompt=33, decode=3, seed=4),
]


def pages_for(plans: list[Plan]) -> int:
    return sum(p.batch * -(-p.max_length // PAGE) for p in plans)


def solo(span, plan: Plan) -> torch.Tensor:
    """The session alone: every step through the span on a cache of its own, concatenated."""
    cache = span.allocate_cache(plan.batch, plan.max_length)
    outs = []
    with torch.inference_mode():
        for hidden, positions, mask, past in plan.steps():
            cache.prepare(past, past + hidden.shape[1])
            outs.append(span(hidden, positions, mask, cache=cache, past_length=past))
    return torch.cat(outs, dim=1)


class Server:
    """A backend on its own compute thread, its sessions' caches on one page pool."""

    def __init__(self, span, num_pages: int, **limits: int):
        self.executor = compute_thread(1)
        self.backend = SpanBackend(span, HIDDEN, executor=self.executor, **limits)
        self.pool = self.executor.submit(span.allocate_pool, num_pages, PAGE).result(WAIT)

    def cache(self, plan: Plan) -> PagedCache:
        return PagedCache(self.pool, plan.batch, plan.max_length)

    def hold(self) -> threading.Event:
        """Hold the compute thread until the returned event is set (steps queue up meanwhile)."""
        entered, release = threading.Event(), threading.Event()
        self.executor.submit(lambda: (entered.set(), release.wait(WAIT)))
        assert entered.wait(WAIT)
        return release

    async def drive(
        self, plan: Plan, cache: PagedCache | None = None, away: float | None = None, pushed: bool = False
    ) -> torch.Tensor:
        """The plan's session, step after step; ``away``: it spends that long after each step on the
        rest of its chain; ``pushed``: its steps come from a previous server, not its client."""
        cache = cache if cache is not None else self.cache(plan)
        outs = []
        for hidden, positions, mask, past in plan.steps():
            outs.append(await self.backend.run(hidden, positions, mask, cache, past, peer=plan.peer, pushed=pushed))
            if away is not None:
                await asyncio.sleep(away)
        return torch.cat(outs, dim=1)

    async def concurrently(
        self, plans: list[Plan], return_exceptions: bool = False, timeout: float = WAIT, **driving
    ) -> list[torch.Tensor]:
        """Every plan's session at once (:meth:`drive` with ``driving``), their first steps queued
        behind a held compute thread (``return_exceptions``: a session that failed gives its error
        instead of raising it)."""
        release = self.hold()
        tasks = [asyncio.create_task(self.drive(plan, **driving)) for plan in plans]
        await asyncio.sleep(0)  # every task queued its first step
        assert len(self.backend.batcher._queue) == len(plans)
        release.set()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=return_exceptions), timeout)

    def close(self) -> None:
        self.backend.shutdown()


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within :data:`ATOL` of the outputs' scale (their largest magnitude, at least 1)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    scale = max(1.0, float(expected.abs().max()))
    err = float((got - expected).abs().max())
    assert err <= ATOL * scale, f"max |diff| {err} > {ATOL} x {scale:.1f}"
