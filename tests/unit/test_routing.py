"""Route planning, bans and the cost model (pure: no network)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shoal.ids import BlockRange, PeerId
from shoal.routing import (
    BanList,
    LatencyModel,
    NoRouteError,
    RouteInfo,
    ServerSpan,
    forward_cost,
    plan_route,
    route_with_bans,
)
from shoal.routing.costs import CACHE_PENALTY_MS


def span(peer: str, start: int, end: int, **info) -> ServerSpan:
    return ServerSpan(PeerId(peer), BlockRange(start, end), None, RouteInfo(**info))


def test_plan_route_takes_the_cheapest_chain_not_the_fewest_hops():
    spans = [span("whole", 0, 8), span("a", 0, 4), span("b", 4, 8)]
    price = {"whole": 10.0, "a": 2.0, "b": 3.0}
    route = plan_route(spans, 0, 8, lambda s, prev: price[s.peer_id])
    assert [s.peer_id for s in route] == ["a", "b"]
    price["whole"] = 4.0
    assert [s.peer_id for s in plan_route(spans, 0, 8, lambda s, prev: price[s.peer_id])] == ["whole"]


def test_plan_route_prices_a_hop_by_its_predecessor():
    """With push, a hop's network cost is the previous server's published RTT to it."""
    spans = [span("a1", 0, 4), span("a2", 0, 4), span("b1", 4, 8), span("b2", 4, 8)]
    rtt = {("a1", "b1"): 50.0, ("a1", "b2"): 1.0, ("a2", "b1"): 1.0, ("a2", "b2"): 50.0}

    def cost(s, prev):
        return 1.0 if prev is None and s.peer_id == "a1" else 2.0 if prev is None else rtt[(prev.peer_id, s.peer_id)]

    assert [s.peer_id for s in plan_route(spans, 0, 8, cost)] == ["a1", "b2"]


def test_plan_route_from_a_middle_block_and_infinite_costs_exclude():
    spans = [span("a", 0, 4), span("b", 4, 8), span("c", 4, 8)]
    assert [s.peer_id for s in plan_route(spans, 4, 8, lambda s, p: 1.0 if s.peer_id == "b" else 2.0)] == ["b"]
    route = plan_route(spans, 4, 8, lambda s, p: float("inf") if s.peer_id == "b" else 1.0)
    assert [s.peer_id for s in route] == ["c"]
    with pytest.raises(NoRouteError) as caught:
        plan_route([span("a", 0, 4)], 0, 8, lambda s, p: 1.0)
    assert caught.value.missing == [4, 5, 6, 7] and "4-7" in str(caught.value)


def test_misaligned_spans_that_cover_everything_but_do_not_chain():
    with pytest.raises(NoRouteError) as caught:
        plan_route([span("a", 0, 5), span("b", 3, 8)], 0, 8, lambda s, p: 1.0)
    assert caught.value.missing == []


def test_bans_back_off_exponentially_and_reset_on_success():
    now = [100.0]
    bans = BanList(base=1.0, ceiling=5.0, clock=lambda: now[0])
    assert [bans.ban("x") for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert bans.banned("x")
    now[0] += 5.01
    assert not bans.banned("x")
    bans.succeeded("x")
    assert bans.ban("x") == 1.0


def test_bans_are_ignored_when_every_server_of_a_block_is_banned_but_dead_ones_never():
    spans = [span("a1", 0, 4), span("a2", 0, 4), span("b", 4, 8)]
    bans = BanList()
    bans.ban("a1")
    cost = lambda s, p: 1.0  # noqa: E731
    assert [s.peer_id for s in route_with_bans(spans, 0, 8, cost, bans)] == ["a2", "b"]
    bans.ban("a2")
    assert [s.peer_id for s in route_with_bans(spans, 0, 8, cost, bans)][-1] == "b"  # bans ignored
    with pytest.raises(NoRouteError) as caught:
        route_with_bans(spans, 0, 8, cost, bans, exclude={"a1", "a2"})
    assert caught.value.missing == [0, 1, 2, 3]


def test_latency_model_prefers_measured_and_penalises_short_cache():
    model = LatencyModel()
    fast, slow = span("fast", 0, 4, step_ms=1.0), span("slow", 0, 4, step_ms=1.0)
    model.observe_rtt("fast", 1.0)
    model.observe_rtt("slow", 150.0)  # e.g. a server that is slow to answer
    assert model.inference_cost(fast, None, push=True) < model.inference_cost(slow, None, push=True)
    model.observe_step("fast", 30.0)  # what the client saw overrides the published estimate
    assert model.inference_cost(fast, None, push=True) == pytest.approx(31.0)
    cramped = span("cramped", 0, 4, step_ms=1.0, free_cache_tokens=16)
    assert model.inference_cost(cramped, None, push=True, cache_tokens=64) >= CACHE_PENALTY_MS
    assert model.inference_cost(cramped, None, push=True, cache_tokens=16) < CACHE_PENALTY_MS


def test_forward_routes_spread_by_throughput():
    spans = [span("big", 0, 4, throughput=30.0), span("small", 0, 4, throughput=10.0)]
    rng = random.Random(0)
    picks = Counter(plan_route(spans, 0, 4, forward_cost(rng))[0].peer_id for _ in range(4000))
    assert picks["big"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_with_push_a_hop_costs_the_previous_servers_published_rtt():
    """The previous server's record says how far the next one is; without push (or with no
    published figure) the client's own measured round trip counts."""
    model = LatencyModel()
    first = span("first", 0, 4, step_ms=1.0, rtts={PeerId("second"): 7.0})
    second = span("second", 4, 8, step_ms=0.5)
    model.observe_rtt("second", 40.0)
    assert model.network_ms(second, first) == 7.0
    assert model.inference_cost(second, first, push=True) == pytest.approx(7.0 + 4 * 0.5 + 1.0)
    assert model.inference_cost(second, first, push=False) == pytest.approx(40.0 + 4 * 0.5 + 1.0)
    assert model.network_ms(first, second) == 5.0  # second publishes nothing about first: UNKNOWN_RTT_MS


def test_server_span_reads_its_blocks_and_capabilities_and_compares_by_peer_and_blocks():
    plain = span("a", 2, 6)
    rich = ServerSpan(PeerId("a"), BlockRange(2, 6), "ticket", RouteInfo(capabilities=frozenset({"push"})))
    assert (plain.start, plain.end, len(plain.blocks)) == (2, 6, 4)
    assert rich.supports("push") and not plain.supports("push")
    assert plain == rich  # ticket and what is known of the server do not make it another span
    assert plain != span("a", 2, 5)
    with pytest.raises(ValueError, match="0 <= start < end"):
        span("empty", 4, 4)
