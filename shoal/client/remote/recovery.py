"""How a session gets its chain: opened at the start, and rebuilt around a server that failed or is
leaving. The policy lives here; it changes nothing it is given, and returns the new chain for the
session to install.

* a failed server is banned (exponential backoff; a draining one for a minute) and the chain is
  re-planned from its first block (or, when no route starts there, from an earlier hop's first
  block), preferring servers that already hold the session (``REPLAY_MS``);
* every new server of the plan gets the history of its first block replayed (one step over all
  positions so far), so that it rebuilds its cache; a replacement that fails is banned and the
  plan drawn again. A draining server's replacement of the very same span is first offered the
  session's KV pages instead (:mod:`shoal.server.migrate`): no replay when they arrive and their
  inputs' digest is the client's own;
* when no live server is left for some blocks (mid-session, or already when the session opens),
  one bounded wait (``route_wait`` seconds, the client's setting) for a server to join with them,
  announced in one line; then
  :class:`~shoal.routing.NoRouteError` naming those blocks. Otherwise a bounded number of attempts
  (``MAX_RECOVERIES``) before it gives up;
* a draining server nobody can replace yet keeps serving; its replacement is looked for again at
  most every ``DRAIN_RETRY_SECONDS`` (one line the first time), not at every step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from shoal.client.remote.feedback import RouteFeedback, RoutePlanner
from shoal.client.remote.history import SpanHistory
from shoal.client.remote.hops import Hop, close_all
from shoal.errors import BadRequest, BusyError, RemoteError, ShoalError, TransportError
from shoal.ids import BlockRange, PeerId
from shoal.routing import NoRouteError, ServerSpan, format_blocks
from shoal.transport import BaseNode
from shoal.wire.schema import TRAIN, OpenRequest

log = logging.getLogger(__name__)

MAX_RECOVERIES = 8  # per step (and per session open)
REPLAY_MS = 50.0  # routing price of a server that would need a replay (prefer those holding state)
RECOVERY_TIMEOUT = 1.5  # opening a session on a replacement: a dead candidate must not stall recovery long
OPEN_PATIENCE = 1.0  # an open not answered by then makes the client ask whether the server is there at all
DEAD_FOR = 10.0  # seconds a server that did not answer stays out of this session's routes
DRAIN_BAN_SECONDS = 60.0
DRAIN_RETRY_SECONDS = 1.0  # a draining server without a replacement: how often to look for one again

#: Replays ``tensors`` (a step over positions ``[0, n)``) on a hop; returns its output.
Replay = Callable[[Hop, list[Tensor], int], Awaitable[Tensor]]
#: Has a leaving hop's server hand its pages of ``[0, n)`` to a new hop of the same span; False: replay.
Migrate = Callable[[Hop, Hop, int], Awaitable[bool]]


@dataclass(frozen=True)
class RecoveryRecord:
    """What one recovery did (``session.recoveries``: tests, benchmarks and logs read it)."""

    failed: PeerId  # the server replaced
    blocks: BlockRange  # its span
    position: int  # the session's length when it happened
    replayed: Mapping[PeerId, int] = field(default_factory=dict)  # new server -> positions replayed to it
    migrated: Mapping[PeerId, int] = field(default_factory=dict)  # new server -> positions whose KV it took
    seconds: float = 0.0  # planning, opening and replaying
    drain: bool = False  # the server was leaving (else: it failed)


@dataclass(frozen=True)
class Rebuilt:
    """A new chain for the session: ``hops[:first]`` of the old one, then ``suffix``."""

    first: int  # index of the first hop replaced; the step goes on from there
    suffix: tuple[Hop, ...]
    retired: tuple[Hop, ...]  # old hops to close (neither reused nor the failed one, unless draining)
    boundaries: Mapping[int, Tensor]  # replay outputs: the history of blocks that are new boundaries
    failed: frozenset[str]  # every server found failing on the way (the step must not use them again)
    record: RecoveryRecord


def gave_up(
    planner: RoutePlanner,
    failed: Collection[str],
    block: int,
    cause: BaseException,
    needs: Collection[str] = (),
    waited: float | None = None,
) -> NoRouteError:
    """The error that ends the tries: which blocks have no live server (announcing ``needs``) left,
    if any (after ``waited`` seconds for one to join), else that every route failed."""
    missing = planner.missing_blocks(block, exclude=failed, needs=needs)
    if missing:
        after = f" after waiting {waited:g} s for one to join" if waited else ""
        return NoRouteError(f"no live server left for blocks {format_blocks(missing)}{after}", missing)
    return NoRouteError(f"gave up after {MAX_RECOVERIES} recoveries: every route failed (last error: {cause})", [])


class ServerGone(TransportError):
    """A server did not answer an open, nor a probe after it."""


class _RebuildFailed(Exception):
    def __init__(self, span: ServerSpan, cause: BaseException):
        super().__init__(str(cause))
        self.span = span
        self.cause = cause


class ChainRecovery:
    """Plans, opens and replays a session's chains over ``planner``'s servers. ``prompts``: the
    session's deep prompts ``[num_blocks, batch or 1, N, hidden]`` (``request.prompts``): every
    server gets its span's slice at open (a replacement too), and only servers announcing
    :data:`~shoal.wire.schema.TRAIN` are routed over."""

    def __init__(
        self,
        node: BaseNode,
        planner: RoutePlanner,
        feedback: RouteFeedback,
        request: OpenRequest,
        *,
        push: bool,
        prompts: Tensor | None = None,
        route_wait: float = 0.0,
    ):
        if request.prompts != (prompts is not None):
            raise ValueError("request.prompts says whether the session has deep prompts: pass them")
        self.node = node
        self.planner = planner
        self.feedback = feedback
        self.request = request
        self.push = push
        self.prompts = prompts
        self.needs = (TRAIN,) if prompts is not None else ()
        self.cache_tokens = request.batch_size * request.max_length
        self.route_wait = route_wait  # seconds to wait for a server to join when blocks have none left
        self._drain_noted: set[str] = set()  # draining servers already reported without a replacement
        self._dead: dict[str, float] = {}  # servers found not answering -> until when they stay out

    def open_hop(self, span: ServerSpan, timeout: float | None = None) -> Awaitable[Hop]:
        """A session on ``span``'s server as this policy opens them (a chain's hop, or an auditor)."""
        prompts = () if self.prompts is None else (self.prompts[span.start : span.end].contiguous(),)
        return Hop.open(self.node, span, self.request, timeout, prompts)

    async def _open_or_give_up(self, span: ServerSpan) -> Hop:
        """:meth:`open_hop`, but a server that has not answered within ``OPEN_PATIENCE`` is asked
        whether it is there at all (:meth:`RouteFeedback.alive`): a dead one fails the open at
        once, not after the connect or request deadline; a live but busy one gets its time."""
        opening = asyncio.ensure_future(self.open_hop(span))
        done, _ = await asyncio.wait({opening}, timeout=OPEN_PATIENCE)
        if not done and not await self.feedback.alive(span) and not opening.done():
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
            self._dead[span.peer_id] = time.monotonic() + DEAD_FOR
            raise ServerGone(f"peer {span.peer_id[:10]} did not answer within {OPEN_PATIENCE:g} s, nor a probe")
        return await opening

    def _known_dead(self) -> set[str]:
        """Servers this session found not answering a moment ago: not tried again for a while
        (a ban is advice, and the only server of some blocks would be retried at every rebuild)."""
        now = time.monotonic()
        for peer in [p for p, until in self._dead.items() if until <= now]:
            del self._dead[peer]
        return set(self._dead)

    async def open_chain(self) -> list[Hop]:
        """Hops over a whole route, opened in parallel; a server that fails to open is banned and
        the route drawn again without it. A full one (``busy``) is only left out of this open: it
        is not broken, and other sessions may get room there at once. When only full servers could
        take the session, the :class:`BusyError` is what the caller hears (try later), not "no route"."""
        failed: set[str] = self._known_dead()
        busy: BusyError | None = None  # the last "no room" answer (a full server is left out, not banned)
        broken = False
        waited = False  # the one wait for servers to join (route_wait) was spent
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                route = self.planner.route_inference(
                    0, cache_tokens=self.cache_tokens, push=self.push, exclude=failed, needs=self.needs
                )
            except NoRouteError as exc:
                if busy is not None and not broken:  # only full servers could take it: busy, not unavailable
                    raise busy from None
                if waited or self.route_wait <= 0 or not exc.missing:
                    raise
                # blocks without a live server, as when one fails mid-session: a replacement
                # (placement sends newcomers there) gets ``route_wait`` seconds to join
                waited = True
                await self._wait_for_servers(0, failed, exc)
                continue
            results = await asyncio.gather(*(self._open_or_give_up(span) for span in route), return_exceptions=True)
            errors = [(span, r) for span, r in zip(route, results, strict=True) if isinstance(r, BaseException)]
            if not errors:
                return list(results)
            await close_all([hop for hop in results if isinstance(hop, Hop)])
            for span, error in errors:
                if isinstance(error, BadRequest) or not isinstance(error, ShoalError):
                    raise error
                failed.add(span.peer_id)
                if isinstance(error, BusyError):  # full, not broken: no ban (others' sessions may open there)
                    busy = error
                else:
                    broken = True
                    self.feedback.failed(span.peer_id)
                log.warning("could not open a session on %s: %s", span.peer_id[:10], error)
            if attempt == MAX_RECOVERIES:
                if busy is not None and not broken:
                    raise busy
                raise gave_up(self.planner, failed, 0, errors[0][1], self.needs)
        raise AssertionError("unreachable")

    async def rebuild(
        self,
        hops: Sequence[Hop],
        index: int,
        cause: BaseException,
        *,
        failed: Collection[str],
        history: SpanHistory,
        position: int,
        replay: Replay,
        drain: bool = False,
        migrate: Migrate | None = None,
        blame: bool = True,
    ) -> Rebuilt | None:
        """A chain without hop ``index`` (which the caller has aborted, unless ``drain``: a
        draining hop keeps serving until its replacement is ready). None: ``drain`` and nobody can
        take over yet. ``migrate`` (with ``drain``): a replacement of the draining hop's very span
        is first offered its KV pages; it is replayed only if that fails. Raises ``cause`` if it
        is a :class:`BadRequest` (another server would refuse it too), :class:`NoRouteError` when
        the tries are used up. ``blame``: the hop's server failed (it is banned for a while); else
        it leaves for a reason kept elsewhere (a dispute)."""
        if isinstance(cause, BadRequest):
            raise cause
        broken = hops[index]
        peer = broken.span.peer_id
        failed = {*failed, peer, *self._known_dead()}
        if blame:
            self.feedback.failed(peer, DRAIN_BAN_SECONDS if drain else None)
        quiet = drain and peer in self._drain_noted  # looked for its replacement before: say it once
        (log.debug if quiet else log.warning)(
            "server %s failed (%s); re-routing blocks %d+", peer[:10], cause, broken.span.start
        )
        started = time.perf_counter()
        waited: float | None = None
        for _attempt in range(MAX_RECOVERIES):
            try:
                first, route = self._replan(hops, index, failed)
            except NoRouteError as exc:
                if drain:
                    if not quiet:
                        log.warning("no replacement for draining server %s yet: %s", peer[:10], exc)
                    self._drain_noted.add(peer)
                    return None
                if waited is not None or self.route_wait <= 0:
                    raise gave_up(self.planner, failed, broken.span.start, exc, self.needs, waited) from exc
                waited = self.route_wait
                await self._wait_for_servers(broken.span.start, failed, exc)
                continue
            reusable = {hop.key: hop for i, hop in enumerate(hops) if i >= first and i != index}
            source = broken if drain and migrate is not None else None
            try:
                suffix, boundaries, replayed, migrated = await self._open_route(
                    route, reusable, history, position, replay, source, migrate
                )
            except _RebuildFailed as rebuild:
                failed.add(rebuild.span.peer_id)
                self.feedback.failed(rebuild.span.peer_id)
                log.warning("replacement %s failed: %s", rebuild.span.peer_id[:10], rebuild.cause)
                if isinstance(rebuild.cause, BadRequest):
                    raise rebuild.cause from None
                continue
            kept = set(suffix)
            retired = tuple(hop for hop in hops[first:] if hop not in kept and (drain or hop is not broken))
            record = RecoveryRecord(
                failed=peer,
                blocks=broken.span.blocks,
                position=position,
                replayed=replayed,
                migrated=migrated,
                seconds=round(time.perf_counter() - started, 4),
                drain=drain,
            )
            return Rebuilt(first, tuple(suffix), retired, boundaries, frozenset(failed), record)
        raise gave_up(self.planner, failed, broken.span.start, cause, self.needs)

    async def _wait_for_servers(self, start: int, failed: Collection[str], cause: NoRouteError) -> None:
        """One line, then up to ``route_wait`` seconds for servers of the blocks from ``start`` on
        that none outside ``failed`` hosts; :func:`gave_up` (from ``cause``) if some are still missing."""
        missing = self.planner.missing_blocks(start, exclude=failed, needs=self.needs)
        log.warning(
            "no live server left for blocks %s: waiting up to %g s for one to join",
            format_blocks(missing),
            self.route_wait,
        )
        if await self.planner.wait_for_servers(start, exclude=failed, needs=self.needs, timeout=self.route_wait):
            raise gave_up(self.planner, failed, start, cause, self.needs, self.route_wait) from cause

    def _replan(self, hops: Sequence[Hop], index: int, failed: Collection[str]) -> tuple[int, list[ServerSpan]]:
        """(first hop replaced, new route from that hop's first block): from the failed hop if a
        route starts there, else from the nearest earlier hop where one does."""
        reuse = {hop.key for i, hop in enumerate(hops) if i != index}
        error: NoRouteError | None = None
        for first in range(index, -1, -1):
            try:
                route = self.planner.route_inference(
                    hops[first].span.start,
                    cache_tokens=self.cache_tokens,
                    push=self.push,
                    exclude=failed,
                    reuse=reuse,
                    replay_ms=REPLAY_MS,
                    needs=self.needs,
                )
            except NoRouteError as exc:
                error = error or exc
                continue
            return first, route
        raise error

    async def _open_route(
        self,
        route: list[ServerSpan],
        reusable: Mapping[tuple[str, int, int], Hop],
        history: SpanHistory,
        position: int,
        replay: Replay,
        source: Hop | None = None,
        migrate: Migrate | None = None,
    ) -> tuple[list[Hop], dict[int, Tensor], dict[PeerId, int], dict[PeerId, int]]:
        """Hops for ``route``: reuse the ones holding the session, open and replay the others (in
        order: each replay's output is the history the next new hop may need); a new hop of the
        leaving ``source``'s very blocks first gets its pages (``migrate``), then no replay. On
        failure, the hops opened here are closed again."""
        hops: list[Hop] = []
        opened: list[Hop] = []
        fresh: dict[int, Tensor] = {}
        replayed: dict[PeerId, int] = {}
        migrated: dict[PeerId, int] = {}
        try:
            for span in route:
                reused = reusable.get((span.peer_id, span.start, span.end))
                if reused is not None:
                    hops.append(reused)
                    continue
                try:
                    hop = await self.open_hop(span, RECOVERY_TIMEOUT)
                except ShoalError as exc:
                    if not isinstance(exc, RemoteError):  # no answer at all (an error reply is an answer)
                        self._dead[span.peer_id] = time.monotonic() + DEAD_FOR
                    raise _RebuildFailed(span, exc) from exc
                opened.append(hop)
                same = source is not None and migrate is not None and span.blocks == source.span.blocks
                if position and same and await migrate(source, hop, position):  # same end: no new boundary
                    migrated[span.peer_id] = position
                    hops.append(hop)
                    continue
                if position:
                    try:
                        output = await replay(hop, history.replay_inputs(span.start, position, fresh), position)
                    except (ShoalError, TimeoutError) as exc:
                        raise _RebuildFailed(span, exc) from exc
                    if history.at(span.end) is None:
                        fresh.setdefault(span.end, output)
                    replayed[span.peer_id] = position
                hops.append(hop)
        except _RebuildFailed:
            await close_all(opened)
            raise
        return hops, fresh, replayed, migrated


__all__ = ["MAX_RECOVERIES", "ChainRecovery", "Rebuilt", "RecoveryRecord", "gave_up"]
