"""Routing: pure decisions about which servers carry which blocks. No I/O here."""

from shoal.routing.bans import BanList
from shoal.routing.chain import NoRouteError, RouteInfo, ServerSpan, format_blocks, plan_route, uncovered_blocks
from shoal.routing.costs import LatencyModel, forward_cost, route_with_bans
from shoal.routing.quality import meeting, with_quality_hint

__all__ = [
    "BanList",
    "LatencyModel",
    "NoRouteError",
    "RouteInfo",
    "ServerSpan",
    "format_blocks",
    "forward_cost",
    "meeting",
    "plan_route",
    "route_with_bans",
    "uncovered_blocks",
    "with_quality_hint",
]
