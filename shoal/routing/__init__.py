"""Routing: pure decisions about which servers carry which blocks. No I/O here."""

from shoal.routing.chain import NoRouteError, ServerSpan, plan_chain, uncovered_blocks

__all__ = ["NoRouteError", "ServerSpan", "plan_chain", "uncovered_blocks"]
