"""Pick a chain of servers whose spans, end to end, cover blocks ``[0, num_blocks)``."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import ShoalError
from shoal.ids import BlockRange, OnBlocks, PeerId
from shoal.quantization.formats import Quantization


class NoRouteError(ShoalError):
    """No chain of known servers covers every block. ``missing`` lists the uncovered blocks."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class RouteInfo:
    """What routing knows of a server besides its blocks: from its ``info`` reply or its swarm
    record. ``None``: not known (e.g. a record does not say the hidden size)."""

    num_blocks: int | None = None
    hidden_size: int | None = None
    fingerprints: tuple[str, ...] = ()
    throughput: float = 1.0  # tokens/s per block the server sustains (the forward lottery weighs by it)
    step_ms: float = 0.0  # measured one-token step per block (0: unknown)
    rtts: Mapping[PeerId, float] = field(default_factory=dict)  # ms to servers next in a chain
    free_cache_tokens: int | None = None
    draining: bool = False
    capabilities: frozenset[str] = frozenset()
    quantization: Quantization = Quantization.NONE  # how the server holds its weights (clients set a minimum)
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters it runs its span with: (name, digest), sorted
    dtype: str | None = None  # what it computes in ("float32", "bfloat16"...; from its info or record)
    compute: str = ""  # the compute label it announced ("bf16/cuda"; "": not announced): its receipts must sign it


@dataclass(frozen=True)
class ServerSpan(OnBlocks):
    """A server hosting ``blocks``, and what routing knows of it."""

    peer_id: PeerId
    blocks: BlockRange
    ticket: Any = field(compare=False, default=None)
    info: RouteInfo = field(compare=False, default_factory=RouteInfo)

    def supports(self, capability: str) -> bool:
        return capability in self.info.capabilities


def uncovered_blocks(spans: Sequence[ServerSpan], num_blocks: int) -> list[int]:
    covered = set()
    for span in spans:
        covered.update(range(span.start, min(span.end, num_blocks)))
    return [i for i in range(num_blocks) if i not in covered]


def block_runs(blocks: Sequence[int]) -> list[BlockRange]:
    """Sorted block indices as contiguous ranges: ``[2, 3, 7]`` -> ``[2:4, 7:8]``."""
    runs: list[BlockRange] = []
    for block in blocks:
        if runs and runs[-1].end == block:
            runs[-1] = BlockRange(runs[-1].start, block + 1)
        else:
            runs.append(BlockRange(block, block + 1))
    return runs


def format_blocks(blocks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    return ", ".join(f"{r.start}" if len(r) == 1 else f"{r.start}-{r.end - 1}" for r in block_runs(blocks))


def plan_route(
    spans: Sequence[ServerSpan],
    start: int,
    end: int,
    cost: Callable[[ServerSpan, ServerSpan | None], float],
) -> list[ServerSpan]:
    """Cheapest chain of whole spans from block ``start`` to block ``end`` (Dijkstra over block
    boundaries). ``cost(span, previous)`` prices one hop (``previous`` is None for the first);
    an infinite cost excludes the span. Ties go to the span given first."""
    usable = [s for s in spans if start <= s.start < s.end <= end]
    missing = [b for b in uncovered_blocks(usable, end) if b >= start]
    if missing:
        raise NoRouteError(f"no usable server hosts blocks {format_blocks(missing)} (of {start}-{end - 1})", missing)
    by_start: dict[int, list[tuple[int, ServerSpan]]] = {}
    for order, span in enumerate(usable):
        by_start.setdefault(span.start, []).append((order, span))
    # state: (block, last span) so that costs may depend on the previous hop (server-to-server RTTs)
    best: dict[tuple[int, str | None], float] = {(start, None): 0.0}
    back: dict[tuple[int, str | None], tuple[tuple[int, str | None], ServerSpan]] = {}
    heap: list[tuple[float, int, int, str | None]] = [(0.0, 0, start, None)]
    last_span: dict[tuple[int, str | None], ServerSpan | None] = {(start, None): None}
    done: tuple[int, str | None] | None = None
    counter = 0
    while heap:
        total, _, block, peer = heapq.heappop(heap)
        state = (block, peer)
        if total > best.get(state, float("inf")):
            continue
        if block == end:
            done = state
            break
        previous = last_span[state]
        for _, span in by_start.get(block, []):
            price = cost(span, previous)
            if price == float("inf"):
                continue
            nxt = (span.end, span.peer_id)
            if total + price < best.get(nxt, float("inf")):
                best[nxt] = total + price
                back[nxt] = (state, span)
                last_span[nxt] = span
                counter += 1
                heapq.heappush(heap, (total + price, counter, span.end, span.peer_id))
    if done is None:
        raise NoRouteError(
            f"no chain of usable whole spans links block {start} to block {end} "
            f"(spans: {sorted((s.start, s.end) for s in usable)})",
            [],
        )
    chain, state = [], done
    while state in back:
        state, span = back[state]
        chain.append(span)
    return chain[::-1]
