"""Routing: pure decisions about which servers carry which blocks. No I/O here."""

from shoal.routing.audits import UNAUDITED_PENALTY_MS
from shoal.routing.bans import BanList
from shoal.routing.chain import (
    NoRouteError,
    RouteInfo,
    ServerSpan,
    block_runs,
    format_blocks,
    plan_route,
    uncovered_blocks,
)
from shoal.routing.costs import LatencyModel, forward_cost, route_with_bans
from shoal.routing.offers import AdapterChoice, offering, with_offer_hint
from shoal.routing.quality import meeting, with_quality_hint

__all__ = [
    "UNAUDITED_PENALTY_MS",
    "AdapterChoice",
    "BanList",
    "LatencyModel",
    "NoRouteError",
    "RouteInfo",
    "ServerSpan",
    "block_runs",
    "format_blocks",
    "forward_cost",
    "meeting",
    "offering",
    "plan_route",
    "route_with_bans",
    "uncovered_blocks",
    "with_offer_hint",
    "with_quality_hint",
]
