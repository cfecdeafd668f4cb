"""The client's view of the servers it can route over, and what it has measured about them.

Servers come from the tickets (:mod:`shoal.client.remote.listing`: each swarm's table, each plain
ticket's own answer). Round-trip times are measured with a blocks-protocol ``info`` request (so a server that is slow to
answer looks slow), once at start and then in the background every ``refresh_period`` seconds
together with a fresh pull of the table: never on a step's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Collection, Sequence
from dataclasses import replace

from shoal.client.config import ClientConfig
from shoal.client.remote.listing import MAX_PULLS, check_consistent, known_spans, missing_servers, until_covered
from shoal.errors import ShoalError
from shoal.ids import BlockRange, PeerId
from shoal.protocols import BLOCKS
from shoal.quantization import Quantization
from shoal.routing import (
    UNAUDITED_PENALTY_MS,
    AdapterChoice,
    BanList,
    LatencyModel,
    NoRouteError,
    ServerSpan,
    forward_cost,
    meeting,
    offering,
    route_with_bans,
    uncovered_blocks,
)
from shoal.routing.audits import Piece, auditable, plan_cover, replicas
from shoal.swarm.service import report_unreachable
from shoal.transport import BaseNode, Ticket
from shoal.wire import Message
from shoal.wire.schema import InfoReply

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 0.75  # a live server answers a ping within this, however busy its compute thread is
MEASURE_TIMEOUT = 2.0
WAIT_POLL = 1.0  # seconds between looks for a newcomer while blocks have no server
SILENT_GRACE = 0.5  # seconds a listed server may answer after the others cover every block
SILENT_AFTER = 1.0  # ... and never less than this after the measurement began (a busy live one answers)
SILENT_BAN = 10.0  # at least this long out of routes for a listed server that did not answer
REPORT_TO = 2  # swarm members told which listed servers did not answer


def _answer(task: asyncio.Future) -> ServerSpan | None:
    """A finished measurement's fresh span; None if it failed in any way."""
    if task.cancelled() or task.exception() is not None:
        return None
    return task.result()


class ServerDirectory:
    """Known servers, their measured latencies and bans; answers "which route now?" and takes the
    sessions' reports (a :class:`~shoal.client.remote.feedback.RoutePlanner` and
    :class:`~shoal.client.remote.feedback.RouteFeedback`). Routes by the client's ``config``: its seed, its
    ``min_quality`` and, with an ``adapter``, only over servers that serve that LoRA adapter;
    ``needs`` on a route asks for capabilities besides."""

    def __init__(
        self,
        node: BaseNode,
        tickets: Sequence[Ticket],
        model: str | None,
        num_blocks: int,
        hidden_size: int,
        config: ClientConfig,
    ):
        self.node = node
        self.config = config  # its routing settings: refresh_period, routing_seed, min_quality, adapter
        self.tickets = list(tickets)
        self.model = model
        self.num_blocks = num_blocks
        self.hidden_size = hidden_size
        self.latency = LatencyModel()
        self.bans = BanList()
        self.rng = random.Random(config.routing_seed)
        self._pull_rng = random.Random(config.routing_seed)  # whom to ask (apart: routes stay as seeded)
        self.spans: list[ServerSpan] = []
        self.banned: set[PeerId] = set()  # caught lying (settled by a majority): never routed over again
        self.excluded: dict[PeerId, str] = {}  # one side of an unsettled dispute (why): routed around, not banned
        # the blocks this client's audits saw each server compute correctly: only those judges' verdicts
        # convict for it (shoal.swarm.verdicts.tally); the client's Verification shares its own
        self.vouched: dict[PeerId, list[BlockRange]] = {}
        self._task: asyncio.Task | None = None
        self._reports: set[asyncio.Future] = set()  # reports of silent servers on their way
        self._looked = False  # whether the server list was pulled before

    @property
    def min_quality(self) -> Quantization:
        """Servers with weights below it are never routed over."""
        return self.config.min_quality

    @property
    def adapter(self) -> AdapterChoice | None:
        """Servers without it are never routed over."""
        return self.config.adapter

    @property
    def swarm(self) -> bool:
        return any(t.swarm_id for t in self.tickets)

    async def refresh(self) -> None:
        """Pull the server list again (tables and infos), then measure round trips to each server."""
        # the first look (the client starting) asks only the given members; later ones more of them too
        more, self._looked = self._looked, True
        timeout = self.config.listing_timeout
        spans = await known_spans(self.node, self._asked(), self.model, timeout, self.num_blocks, more, self.vouched)
        check_consistent(spans, self.num_blocks, self.hidden_size)
        self.spans = await self._measure(spans)

    def _asked(self) -> list[Ticket]:
        """Whom to ask for the server list: the given tickets and, for each swarm, members listed
        by the last look that are not banned, up to ``MAX_PULLS`` in all, given ones that are not
        banned first. A client's view of a swarm must outlive the servers it was given: a SIGKILLed
        first server left a gateway pulling from it alone, blind to every newcomer (seen in the soak)."""
        given = {t.peer_id for t in self.tickets}
        out = [t for t in self.tickets if not t.swarm_id]
        for swarm in dict.fromkeys(t.swarm_id for t in self.tickets if t.swarm_id):
            mine = [t for t in self.tickets if t.swarm_id == swarm]
            known = [s.ticket for s in self.spans if s.ticket.swarm_id == swarm and s.peer_id not in given]
            self._pull_rng.shuffle(known)
            fine = [t for t in mine if not self.bans.banned(t.peer_id)]
            healthy = [t for t in known if not self.bans.banned(t.peer_id) and t.peer_id not in self.banned]
            rest = [t for t in mine if t not in fine]
            out += [*fine, *healthy, *rest][: max(MAX_PULLS, len(fine))]
        return out

    def check_coverage(self) -> None:
        """A :class:`NoRouteError` that says how to add servers when some block has none at all
        (whatever its quality or adapters: routing explains those)."""
        missing = uncovered_blocks(self.spans, self.num_blocks)
        if missing:
            hosts = {s.peer_id for s in self.spans}
            silent = sum(1 for t in self.tickets if not t.swarm_id and t.peer_id not in hosts)
            raise missing_servers(missing, swarm=self.swarm, silent=silent)

    async def _measure(self, spans: list[ServerSpan]) -> list[ServerSpan]:
        """Time an ``info`` request to every server (in parallel); fresh free-cache and drain state
        from the answers. Once the servers that answered cover every block, the others get
        ``SILENT_GRACE`` (or 3 of the slowest answer's round trips) more, ``SILENT_AFTER`` in all at
        least; then they are banned from routes (a ban is advice: a route that needs one still takes
        it) while their answers are awaited in the background up to ``MEASURE_TIMEOUT``: one that
        answers is routable again, the rest stay listed (the table says they exist), banned for a
        while and reported to the swarm. A dead server listed until its record expires costs a new
        client about a second, not a connect timeout."""

        async def one(span: ServerSpan) -> ServerSpan | None:
            started = time.perf_counter()
            try:
                reply = await self.node.request(span.ticket, BLOCKS, Message("info", 1), timeout=MEASURE_TIMEOUT)
                fresh = reply.reply(InfoReply)
            except ShoalError:
                return None
            rtt_ms = (time.perf_counter() - started) * 1e3
            self.latency.observe_rtt(span.peer_id, rtt_ms)
            info = replace(
                span.info,
                free_cache_tokens=fresh.free_cache_tokens,
                draining=fresh.draining,
                capabilities=fresh.span.capabilities,
                adapters=tuple(sorted((a.name, a.digest) for a in fresh.span.adapters)),
                dtype=span.info.dtype or fresh.span.dtype,  # the signed record's announcement first
                compute=span.info.compute or fresh.span.compute,
            )
            return replace(span, info=info)

        tasks = {asyncio.ensure_future(one(span)): span for span in spans}
        answered: dict[PeerId, ServerSpan] = {}
        began = time.monotonic()
        full = began + MEASURE_TIMEOUT

        def take(task: asyncio.Future) -> None:
            if (fresh := _answer(task)) is not None:
                answered[fresh.peer_id] = fresh

        def grace_until() -> float:
            slowest = max(self.latency.client_rtt_ms.get(p, 0.0) for p in answered) / 1e3
            return max(began + SILENT_AFTER, time.monotonic() + max(SILENT_GRACE, 3 * slowest))

        def covered() -> bool:
            return not uncovered_blocks(list(answered.values()), self.num_blocks)

        pending = await until_covered(set(tasks), take, covered, grace_until, full)
        if pending:  # not waited for: out of routes until they answer (if they do before the deadline)
            for task in pending:
                self.bans.ban(tasks[task].peer_id, max(self.config.refresh_period, SILENT_BAN))
            late = asyncio.ensure_future(self._stragglers({t: tasks[t] for t in pending}, full))
            self._reports.add(late)
            late.add_done_callback(self._reports.discard)
        silent = [span for task, span in tasks.items() if task.done() and _answer(task) is None]
        self._silent(silent)
        return [answered.get(span.peer_id, span) for span in spans]

    async def _stragglers(self, pending: dict[asyncio.Future, ServerSpan], deadline: float) -> None:
        """Measurements still under way after a refresh stopped waiting: one that answers before
        ``deadline`` is routable again, with its fresh state; the rest are silent."""
        done, still = await asyncio.wait(pending, timeout=max(deadline - time.monotonic(), 0))
        for task in still:
            task.cancel()
        for task in done:
            if (fresh := _answer(task)) is not None:
                self.bans.lift(fresh.peer_id)
                self.spans = [fresh if s.peer_id == fresh.peer_id else s for s in self.spans]
        self._silent([pending[t] for t in still] + [pending[t] for t in done if _answer(t) is None])

    def _silent(self, silent: list[ServerSpan]) -> None:
        """Listed servers that did not answer: out of routes for a while, and reported."""
        for span in silent:
            self.bans.ban(span.peer_id, max(self.config.refresh_period, SILENT_BAN))
        if silent:
            log.info("%d listed servers did not answer: %s", len(silent), ", ".join(s.peer_id[:10] for s in silent))
            self._report_silent(silent)

    def _report_silent(self, silent: Sequence[ServerSpan]) -> None:
        """Tell the swarm peers we pulled tables from which servers did not answer (each checks
        for itself before it believes it: :mod:`shoal.swarm.liveness`). Not awaited."""
        peers = [s.peer_id for s in silent if s.ticket.swarm_id]
        members = [t for t in self.tickets if t.swarm_id]
        if peers and members:
            task = asyncio.ensure_future(report_unreachable(self.node, members[:REPORT_TO], peers))
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)

    def start(self) -> None:
        if self._task is None and self.config.refresh_period > 0:
            self._task = asyncio.get_running_loop().create_task(self._keep_fresh())

    async def _keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_period * self.rng.uniform(0.8, 1.2))
            try:
                await self.refresh()
            except Exception as exc:  # keep refreshing: the next round may work
                log.info("refreshing the server list failed: %s", exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for report in list(self._reports):
            report.cancel()
        await asyncio.gather(*self._reports, return_exceptions=True)

    def usable(self) -> list[ServerSpan]:
        banned, excluded = self.banned, self.excluded
        return [s for s in self.spans if not s.info.draining and s.peer_id not in banned and s.peer_id not in excluded]

    def route_inference(
        self,
        start: int,
        *,
        cache_tokens: int,
        push: bool,
        exclude: Collection[str] = (),
        reuse: Collection[tuple[str, int, int]] = (),
        replay_ms: float = 0.0,
        needs: Collection[str] = (),
    ) -> list[ServerSpan]:
        """The chain from ``start`` to the last block with the least expected per-token latency.
        Spans in ``reuse`` (peer, start, end) already hold the session's state; others cost
        ``replay_ms`` more (they would have to be replayed). ``needs``: capabilities every server
        of the chain must announce."""
        latency = self.latency
        unchecked = self._unauditable() if self.config.verify != "off" else set()

        def cost(span: ServerSpan, previous: ServerSpan | None) -> float:
            price = latency.inference_cost(span, previous, push=push, cache_tokens=cache_tokens)
            if (span.peer_id, span.start, span.end) in unchecked:
                price += UNAUDITED_PENALTY_MS
            return price if (span.peer_id, span.start, span.end) in reuse else price + replay_ms

        return self._route(start, self.num_blocks, cost, exclude, needs)

    def route_forward(
        self, start: int, exclude: Collection[str] = (), *, end: int | None = None, needs: Collection[str] = ()
    ) -> list[ServerSpan]:
        """A route for one stateless forward over blocks ``[start, end)`` (default: to the last
        block), drawn so load spreads by capacity."""
        return self._route(start, self.num_blocks if end is None else end, forward_cost(self.rng), exclude, needs)

    def _route(self, start: int, end: int, cost, exclude: Collection[str], needs: Collection[str]) -> list[ServerSpan]:
        spans, bans = self.usable(), self.bans
        return route_with_bans(spans, start, end, cost, bans, exclude, self.min_quality, needs, self.adapter)

    def _unauditable(self) -> set[tuple[str, int, int]]:
        """The spans (peer, start, end) no other live server could check (an auditing client
        routes around them when it can: :data:`~shoal.routing.UNAUDITED_PENALTY_MS`)."""
        live = self._checkers()
        return {(s.peer_id, s.start, s.end) for s in self.usable() if not auditable(live, s)}

    def _checkers(self, exclude: Collection[str] = ()) -> list[ServerSpan]:
        """The servers that may check another's hop: usable, meeting the client's quality and
        adapter, outside ``exclude``, and not banned now. A listed server that has not answered
        the client (a record nobody reached, :meth:`_measure`) is banned: it never uses up an
        auditor try, as a route that needs it might."""
        offered = offering(meeting(self.usable(), self.min_quality), (), self.adapter)
        return [s for s in offered if s.peer_id not in exclude and not self.bans.banned(s.peer_id)]

    def route_cover(
        self, like: ServerSpan, *, exclude: Collection[str] = (), needs: Collection[str] = ()
    ) -> list[Piece] | None:
        """Pieces of other live servers' spans (announcing ``needs``) that together run exactly
        ``like``'s blocks and compute what it does (:func:`~shoal.routing.audits.plan_cover`),
        outside ``exclude``: the cheapest for a stateless forward; None when there are none."""
        latency, checkers = self.latency, offering(self._checkers(exclude), needs, None)
        return plan_cover(checkers, like, lambda span, _: latency.compute_ms(span) + 1.0)

    def route_replica(
        self, like: ServerSpan, *, exclude: Collection[str] = (), cache_tokens: int = 0, needs: Collection[str] = ()
    ) -> ServerSpan | None:
        """Another live server whose span is exactly ``like``'s and that computes what it does (see
        :func:`~shoal.routing.audits.replicas`: its dtype may differ), outside ``exclude``: the
        cheapest for a step (an auditor, a third opinion), or None when there is none."""
        candidates = [s for s in replicas(self._checkers(exclude), like) if s.peer_id not in exclude]
        latency = self.latency

        def cost(span: ServerSpan, previous: ServerSpan | None) -> float:
            return latency.inference_cost(span, None, push=False, cache_tokens=cache_tokens)

        try:
            route = route_with_bans(
                candidates, like.start, like.end, cost, self.bans, (), self.min_quality, needs, self.adapter
            )
        except NoRouteError:
            return None
        return route[0] if len(route) == 1 else None

    def missing_blocks(self, start: int, exclude: Collection[str] = (), needs: Collection[str] = ()) -> list[int]:
        offered = offering(meeting(self.spans, self.min_quality), needs, self.adapter)
        out = {*exclude, *self.banned, *self.excluded}
        live = [s for s in offered if s.peer_id not in out]
        return [b for b in uncovered_blocks(live, self.num_blocks) if b >= start]

    async def wait_for_servers(
        self, start: int, *, exclude: Collection[str], needs: Collection[str], timeout: float
    ) -> list[int]:
        deadline = time.monotonic() + timeout
        while missing := self.missing_blocks(start, exclude, needs):
            left = deadline - time.monotonic()
            if left <= 0:
                return missing
            await self.look_again(left)
        return []

    async def look_again(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        await asyncio.sleep(min(WAIT_POLL, timeout))
        try:  # the swarm's tables and the given servers, asked again
            await asyncio.wait_for(self.refresh(), max(deadline - time.monotonic(), 0.01))
        except Exception as exc:  # a failed look is one more reason to keep waiting, not an error
            log.debug("looking for servers again failed: %r", exc)

    # ---- RouteFeedback (shoal.client.remote.feedback): what sessions report and expect ----------------

    def expected_step_ms(self, span: ServerSpan) -> float:
        return self.latency.step_estimate_ms(span)

    def observed_step(self, peer: PeerId, ms: float) -> None:
        self.latency.observe_step(peer, ms)

    def succeeded(self, peer: PeerId) -> None:
        self.bans.succeeded(peer)

    def failed(self, peer: PeerId, ban_seconds: float | None = None) -> None:
        self.bans.ban(peer, ban_seconds)

    def convicted(self, peer: PeerId) -> None:
        self.banned.add(peer)

    def disputed(self, peer: PeerId, reason: str) -> None:
        self.excluded.setdefault(peer, reason)

    async def alive(self, span: ServerSpan) -> bool:
        """Does the server answer right now? An ``info`` on the pooled blocks connection (no
        dial for a live server; compute runs off its event loop, so a busy server answers fast),
        allowed ``PROBE_TIMEOUT`` or 4 round trips, whichever is longer."""
        timeout = max(PROBE_TIMEOUT, 4e-3 * self.latency.client_rtt_ms.get(span.peer_id, 0.0))
        probe = self.node.request(span.ticket, BLOCKS, Message("info", 1), timeout=timeout)
        try:
            await asyncio.wait_for(probe, timeout)
        except (ShoalError, TimeoutError):
            return False
        return True
