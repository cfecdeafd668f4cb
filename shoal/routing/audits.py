"""Who can check a hop: pure decisions about auditors, pieces and the price of a hop nobody can check.

A hop ``[a, b)`` is checked by servers that compute what its server does: the same weight format
(quantisation) and the same LoRA adapters. Their compute dtype may differ (fp32 beside bf16): the
comparison then runs within the coarser dtype's tolerance (:func:`shoal.verify.compare.tolerance_of`).
The best check is an exact replica (span ``[a, b)``: it can hold a session); failing that, a
*cover*: a chain of pieces of other servers' spans, each clipped to ``[a, b)`` (servers run a sub-range
of their span statelessly, ``ForwardRequest.blocks``). No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from shoal.ids import BlockRange
from shoal.routing.chain import NoRouteError, ServerSpan, plan_route

SUB_SPAN = "sub-span"  # the capability (shoal.wire.schema.SUB_SPAN; routing imports no wire code)
#: What a hop nobody can check costs on a route planned by an auditing client (ms per token): far
#: above any honest difference in speed, so a checkable chain wins whenever one exists, and far below
#: CACHE_PENALTY_MS (a full server is still worse than an unchecked one).
UNAUDITED_PENALTY_MS = 1e3

__all__ = ["SUB_SPAN", "UNAUDITED_PENALTY_MS", "Piece", "alike", "auditable", "plan_cover", "replicas"]


def alike(span: ServerSpan, like: ServerSpan) -> bool:
    """Whether ``span``'s honest outputs match ``like``'s within some tolerance: same weight format
    and LoRA adapters (int8 beside fp32 differ by far more than honest rounding: an audit between
    them would convict whichever is alone). The compute dtype may differ (the coarser tolerance)."""
    return span.info.quantization == like.info.quantization and span.info.adapters == like.info.adapters


def replicas(spans: Sequence[ServerSpan], like: ServerSpan) -> list[ServerSpan]:
    """The servers of ``spans`` other than ``like``'s whose span is exactly ``like``'s and that compute alike."""
    return [s for s in spans if s.blocks == like.blocks and s.peer_id != like.peer_id and alike(s, like)]


@dataclass(frozen=True)
class Piece:
    """Blocks ``blocks`` of ``server``'s span (all of it, or a sub-range: a stateless forward runs them)."""

    server: ServerSpan
    blocks: BlockRange

    @property
    def whole(self) -> bool:
        return self.blocks == self.server.blocks


def _pieces_of(spans: Sequence[ServerSpan], like: ServerSpan, exclude: Collection[str]) -> list[ServerSpan]:
    """``spans`` that can give part of ``like``'s blocks, clipped to them (a clipped one needs SUB_SPAN)."""
    out = []
    for s in spans:
        if s.peer_id == like.peer_id or s.peer_id in exclude or not alike(s, like):
            continue
        start, end = max(s.start, like.start), min(s.end, like.end)
        if start >= end or ((start, end) != (s.start, s.end) and not s.supports(SUB_SPAN)):
            continue
        out.append(replace(s, blocks=BlockRange(start, end)))
    return out


def plan_cover(
    spans: Sequence[ServerSpan],
    like: ServerSpan,
    cost: Callable[[ServerSpan, ServerSpan | None], float],
    exclude: Collection[str] = (),
) -> list[Piece] | None:
    """The cheapest chain of pieces of ``spans`` (not ``like``'s server, nor ``exclude``) that
    together run exactly ``like``'s blocks, each server once at most; None when there is none.
    ``cost`` prices a clipped span (as :func:`~shoal.routing.chain.plan_route` does)."""
    clipped = _pieces_of(spans, like, exclude)
    whole = {s.peer_id: s for s in spans}
    try:
        chain = plan_route(clipped, like.start, like.end, cost)
    except NoRouteError:
        return None
    if len({s.peer_id for s in chain}) != len(chain):
        return None  # one server twice would be one opinion counted twice
    return [Piece(whole[s.peer_id], s.blocks) for s in chain]


def auditable(spans: Sequence[ServerSpan], like: ServerSpan) -> bool:
    """Whether some other servers of ``spans`` can check ``like``'s hop (a replica or a cover)."""
    return plan_cover(spans, like, lambda span, previous: float(len(span.blocks))) is not None
