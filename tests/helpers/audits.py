"""Stand-ins the audit tests share (``tests/unit/test_audit*.py``): a hop that names its server and
blocks, and the server span of a peer."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.ids import BlockRange, PeerId
from shoal.routing import RouteInfo, ServerSpan

SPAN = BlockRange(0, 2)
HIDDEN = 8


@dataclass(eq=False)
class FakeHop:
    span: ServerSpan
    aborted: bool = False
    closed: bool = False

    async def abort(self) -> None:
        self.aborted = True

    async def close(self) -> None:
        self.closed = True


def span_of(peer: str, blocks: BlockRange = SPAN) -> ServerSpan:
    return ServerSpan(PeerId(peer), blocks, ticket=peer, info=RouteInfo(dtype="float32"))
