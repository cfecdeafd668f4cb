"""The two narrow faces of the server directory that remote sessions use.

:class:`RoutePlanner` answers "which servers now?"; :class:`RouteFeedback` is the one way a session
tells routing what it saw of a server (a step's latency, a success, a failure, a lie, a dispute) and asks what it
should expect of one (a step's duration, whether it still answers). Sessions never touch the
latency model or the ban list themselves, so routing can change how it learns without the
session code changing, and tests can stand a plain object in for the directory.
:class:`~shoal.client.remote.directory.ServerDirectory` implements both.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from shoal.ids import PeerId
from shoal.routing import ServerSpan
from shoal.routing.audits import Piece

#: ``(peer id, first block, end block)``: a span that already holds a session's state.
SpanKey = tuple[str, int, int]


class RouteFeedback(Protocol):
    """What a session reports about the servers it uses, and the expectations it asks for."""

    def expected_step_ms(self, span: ServerSpan) -> float:
        """How long a one-token step on ``span`` should take, reply included (deadlines scale it)."""
        ...

    def observed_step(self, peer: PeerId, ms: float) -> None:
        """A one-token step on ``peer`` took ``ms``, request to reply."""
        ...

    def succeeded(self, peer: PeerId) -> None:
        """``peer`` answered: forget its earlier failures."""
        ...

    def failed(self, peer: PeerId, ban_seconds: float | None = None) -> None:
        """``peer`` failed (or is leaving): keep it out of routes for a while (``None``: backoff)."""
        ...

    async def alive(self, span: ServerSpan) -> bool:
        """Does ``span``'s server answer right now (a late reply: slow, or dead)?"""
        ...

    def convicted(self, peer: PeerId) -> None:
        """``peer`` returned wrong hidden states (a majority of replicas said so): never route over
        it again. Unlike :meth:`failed` (a server that may come back), this ban does not expire."""
        ...

    def disputed(self, peer: PeerId, reason: str) -> None:
        """``peer`` is one side of a dispute no third replica settled (``reason`` says which): keep
        it out of this client's routes for good. Not a conviction: it may be the honest side."""
        ...


class RoutePlanner(Protocol):
    """Routes over the servers known now."""

    def route_inference(
        self,
        start: int,
        *,
        cache_tokens: int,
        push: bool,
        exclude: Collection[str] = (),
        reuse: Collection[SpanKey] = (),
        replay_ms: float = 0.0,
        needs: Collection[str] = (),
    ) -> list[ServerSpan]: ...

    def route_forward(
        self, start: int, exclude: Collection[str] = (), *, end: int | None = None, needs: Collection[str] = ()
    ) -> list[ServerSpan]: ...

    def route_replica(
        self, like: ServerSpan, *, exclude: Collection[str] = (), cache_tokens: int = 0, needs: Collection[str] = ()
    ) -> ServerSpan | None:
        """Another server with exactly ``like``'s span computing what it does (an auditor, a third
        opinion), outside ``exclude``; None if there is none."""
        ...

    def route_cover(
        self, like: ServerSpan, *, exclude: Collection[str] = (), needs: Collection[str] = ()
    ) -> list[Piece] | None:
        """Pieces of other servers' spans (announcing ``needs``) that together run exactly ``like``'s
        blocks (a stateless checker of its hop, :mod:`shoal.routing.audits`), outside ``exclude``;
        None if there are none."""
        ...

    def missing_blocks(self, start: int, exclude: Collection[str] = (), needs: Collection[str] = ()) -> list[int]:
        """Blocks from ``start`` on that no known server outside ``exclude`` (announcing ``needs``) hosts."""
        ...

    async def wait_for_servers(
        self, start: int, *, exclude: Collection[str], needs: Collection[str], timeout: float
    ) -> list[int]:
        """Look again for servers of the blocks from ``start`` on until every one has a server
        outside ``exclude``, or ``timeout`` seconds pass; returns the blocks still missing."""
        ...

    async def look_again(self, timeout: float) -> None:
        """A moment's pause (``WAIT_POLL``, at most ``timeout`` s), then the swarm's servers listed
        again: for a caller waiting for servers to join. A failed look is not an error."""
        ...


__all__ = ["RouteFeedback", "RoutePlanner", "SpanKey"]
