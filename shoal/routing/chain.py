"""Pick a chain of servers whose spans, end to end, cover blocks ``[0, num_blocks)``."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import ShoalError


class NoRouteError(ShoalError):
    """No chain of known servers covers every block. ``missing`` lists the uncovered blocks."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class ServerSpan:
    """A server hosting blocks ``[start, end)`` (half-open)."""

    peer_id: str
    start: int
    end: int
    ticket: Any = field(compare=False, default=None)
    info: dict = field(compare=False, default_factory=dict)


def uncovered_blocks(spans: Sequence[ServerSpan], num_blocks: int) -> list[int]:
    covered = set()
    for span in spans:
        covered.update(range(span.start, min(span.end, num_blocks)))
    return [i for i in range(num_blocks) if i not in covered]


def _ranges(blocks: list[int]) -> str:
    parts, start = [], None
    for i, b in enumerate(blocks):
        start = b if start is None else start
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            parts.append(f"{start}" if start == b else f"{start}-{b}")
            start = None
    return ", ".join(parts)


def plan_chain(spans: Sequence[ServerSpan], num_blocks: int) -> list[ServerSpan]:
    """Fewest-hop chain from block 0 to ``num_blocks`` where each server starts where the previous
    one ended (a server runs its whole span). Ties keep the order servers were given in."""
    missing = uncovered_blocks(spans, num_blocks)
    if missing:
        raise NoRouteError(f"no server hosts blocks {_ranges(missing)} (of {num_blocks})", missing)
    by_start: dict[int, list[ServerSpan]] = {}
    for span in spans:
        by_start.setdefault(span.start, []).append(span)
    previous: dict[int, ServerSpan | None] = {0: None}
    queue = deque([0])
    while queue:
        block = queue.popleft()
        for span in by_start.get(block, []):
            if span.end <= num_blocks and span.end not in previous:
                previous[span.end] = span
                queue.append(span.end)
    if num_blocks not in previous:
        reachable = max(previous)
        raise NoRouteError(
            f"servers cover every block but no chain of whole spans links block {reachable} onward "
            f"(spans: {sorted((s.start, s.end) for s in spans)})",
            [],
        )
    chain, block = [], num_blocks
    while block:
        span = previous[block]
        chain.append(span)
        block = span.start
    return chain[::-1]
