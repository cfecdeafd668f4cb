"""What a hop costs: expected per-token latency for inference, capacity-weighted lottery for
stateless forward. Pure: measurements come in, prices go out.

Inference (one new token through the chain), per hop, in milliseconds:
    network   the client's measured round trip to the server (first hop, or every hop without
              push); with push, the previous server's published round trip to this one
    compute   the client's observed time for this server's steps, when it has some; else the
              span's length times the server's published one-token step time per block
    + HOP_MS  fixed per-hop overhead (serialisation, scheduling): prefers fewer hops
    + CACHE_PENALTY_MS when the server's published free cache cannot hold the session
Stateless forward: servers are drawn with probability proportional to their throughput (an
exponential race), so concurrent batches spread over replicas by capacity.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from shoal.quantization.formats import DEFAULT_MIN_QUALITY, Quantization
from shoal.routing.bans import BanList
from shoal.routing.chain import NoRouteError, ServerSpan, plan_route
from shoal.routing.offers import AdapterChoice, offering, with_offer_hint
from shoal.routing.quality import meeting, with_quality_hint

HOP_MS = 1.0
UNKNOWN_RTT_MS = 5.0
UNKNOWN_STEP_MS = 2.0  # per block, when a server publishes no measurement
CACHE_PENALTY_MS = 1e6
EMA = 0.3


@dataclass
class LatencyModel:
    """What the client knows about each server's speed. Keys are peer ids."""

    client_rtt_ms: dict[str, float] = field(default_factory=dict)  # measured by the client
    observed_ms: dict[str, float] = field(default_factory=dict)  # EMA of one-token step replies

    def observe_rtt(self, peer: str, ms: float) -> None:
        self.client_rtt_ms[peer] = _ema(self.client_rtt_ms.get(peer), ms)

    def observe_step(self, peer: str, ms: float) -> None:
        self.observed_ms[peer] = _ema(self.observed_ms.get(peer), ms)

    def step_estimate_ms(self, span: ServerSpan, previous: ServerSpan | None = None) -> float:
        """Expected time from sending a one-token step to this server (from the client, or pushed
        by ``previous``) to its reply: what the client observed, else network plus compute."""
        seen = self.observed_ms.get(span.peer_id)
        if seen is not None:
            return seen
        return self.network_ms(span, previous) + self.compute_ms(span)

    def compute_ms(self, span: ServerSpan) -> float:
        step_ms = span.info.step_ms or UNKNOWN_STEP_MS
        return (span.end - span.start) * step_ms

    def network_ms(self, span: ServerSpan, previous: ServerSpan | None) -> float:
        if previous is not None:
            published = previous.info.rtts  # peer id -> ms, from the server's record
            if span.peer_id in published:
                return published[span.peer_id]
        return self.client_rtt_ms.get(span.peer_id, UNKNOWN_RTT_MS)

    def inference_cost(
        self, span: ServerSpan, previous: ServerSpan | None, *, push: bool, cache_tokens: int = 0
    ) -> float:
        cost = self.step_estimate_ms(span, previous if push else None)
        free = span.info.free_cache_tokens
        if cache_tokens and free is not None and free < cache_tokens:
            cost += CACHE_PENALTY_MS
        return cost + HOP_MS


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


def forward_cost(rng: random.Random) -> Callable[[ServerSpan, ServerSpan | None], float]:
    """A random price per server: exponential with mean ``span length / throughput``, so among
    replicas of one span each is picked with probability proportional to its throughput."""
    draws: dict[str, float] = {}

    def cost(span: ServerSpan, previous: ServerSpan | None) -> float:
        if span.peer_id not in draws:
            draws[span.peer_id] = rng.expovariate(1.0)
        throughput = max(span.info.throughput, 1e-6)
        return HOP_MS * 1e-3 + draws[span.peer_id] * (span.end - span.start) / throughput

    return cost


def route_with_bans(
    spans: Collection[ServerSpan],
    start: int,
    end: int,
    cost: Callable[[ServerSpan, ServerSpan | None], float],
    bans: BanList,
    exclude: Collection[str] = (),
    min_quality: Quantization = DEFAULT_MIN_QUALITY,
    needs: Collection[str] = (),
    adapter: AdapterChoice | None = None,
) -> list[ServerSpan]:
    """The cheapest route over servers with weights of at least ``min_quality`` that announce the
    capabilities in ``needs`` and serve ``adapter`` (see :mod:`shoal.routing.offers`), avoiding
    banned ones, or, if bans leave a block uncovered, ignoring bans (never ``exclude``: servers
    known dead right now, nor the quality bar, capabilities or adapter)."""
    alive = [s for s in spans if s.peer_id not in exclude]
    good = meeting(offering(alive, needs, adapter), min_quality)
    allowed = [s for s in good if not bans.banned(s.peer_id)]
    try:
        try:
            return plan_route(allowed, start, end, cost)
        except NoRouteError:
            if len(allowed) == len(good):
                raise
        return plan_route(good, start, end, cost)
    except NoRouteError as error:
        hinted = with_offer_hint(error, meeting(alive, min_quality), end, needs, adapter)
        if hinted is not error:
            raise hinted from None
        raise with_quality_hint(error, offering(alive, needs, adapter), min_quality) from None
