"""Which servers a client's tickets lead to: each swarm's table (through any member that answers;
servers the swarm convicted of lying or found unreachable left out) and each plain ticket's own
``info`` (standalone servers, started without ``--new-swarm``/``--join``), the two together; and the
errors that say what is missing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence

from shoal.errors import Forbidden, ShoalError
from shoal.ids import PeerId
from shoal.protocols import BLOCKS
from shoal.routing import NoRouteError, RouteInfo, ServerSpan, block_runs, format_blocks, uncovered_blocks
from shoal.swarm.liveness import Liveness, Probe, Reach
from shoal.swarm.records import State
from shoal.swarm.service import fetch_table, table_from_reply
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import Vouched, convicted, suspected
from shoal.transport import BaseNode, Ticket
from shoal.verify.receipts import compute_dtype
from shoal.wire import Message
from shoal.wire.schema import InfoReply

log = logging.getLogger(__name__)

LISTING_GRACE = 1.0  # seconds a plain ticket's peer may answer after the others cover every block
MAX_PULLS = 4  # swarm members a client pulls the table from at once (the tickets it was given)
EXTRA_PULLS = 2  # more members asked when only one ticket was given (one member cannot eclipse the swarm)
EXTRA_PULL_TIMEOUT = 1.0  # seconds those may take (each dial, then answer): a dead one must not hold up the start
ENOUGH_VIEWS = 1  # members' tables that answered, after which the others asked get LATE_VIEW_GRACE more
LATE_VIEW_GRACE = 2.0  # several round trips: a live member's table is merged, a dead one's not awaited


async def fetch_info(node: BaseNode, ticket: Ticket, timeout: float) -> ServerSpan | None:
    """What the peer of a plain ticket hosts; None (logged) if it does not answer."""
    try:
        reply = (await node.request(ticket, BLOCKS, Message("info", 1), timeout=timeout)).reply(InfoReply)
    except ShoalError as exc:
        log.warning("peer %s did not answer info: %s", ticket.peer_id[:10], exc)
        return None
    span = reply.span
    info = RouteInfo(
        num_blocks=span.num_blocks,
        hidden_size=span.hidden_size,
        fingerprints=tuple(span.fingerprints),
        free_cache_tokens=reply.free_cache_tokens,
        draining=reply.draining,
        capabilities=span.capabilities,
        quantization=span.quantization,
        adapters=tuple(sorted((a.name, a.digest) for a in span.adapters)),
        dtype=span.dtype,
        compute=span.compute,
    )
    return ServerSpan(PeerId(ticket.peer_id), span.blocks, ticket, info)


async def pull_table(node: BaseNode, tickets: Sequence[Ticket], timeout: float, more: bool = True) -> RecordTable:
    """The swarm's table as several members see it, merged: the given tickets' peers (at most
    ``MAX_PULLS``) and, when only one was given and ``more``, ``EXTRA_PULLS`` more members it
    lists (given ``EXTRA_PULL_TIMEOUT``: a check, not a wait). Only records
    that verify are merged (the newest of each), so one member cannot make a client believe a short
    or doctored table: one that lists far fewer servers than the others is named in a warning. A
    server counts as reached if any member has reached it."""
    swarm = next(t.swarm_id for t in tickets if t.swarm_id)
    asked = list(tickets[:MAX_PULLS])
    views = await _views(node, asked, swarm, timeout)
    if not views:
        raise ShoalError(f"no peer of swarm {swarm} answered; tried {len(asked)} tickets")
    if len(tickets) == 1 and more:
        seen = {t.peer_id for t in asked}
        members = [r for r in views[0][1].servers() if r.peer not in seen and r.state is State.ONLINE]
        more = [Ticket(r.peer, r.addrs, r.relay, swarm) for r in members[:EXTRA_PULLS]]
        views += await _views(node, more, swarm, min(timeout, EXTRA_PULL_TIMEOUT), quiet=True)
    merged = RecordTable(swarm)
    for _, view in views:
        merged.merge_many(view.records())
    # forged model records the views refused (against the swarm's pin): the client says so if it finds no model
    merged.rejected["model_pin"] = max(view.rejected["model_pin"] for _, view in views)
    servers = merged.servers(include_unreachable=True)
    liveness = Liveness(self_id="")
    for record in servers:
        states = {view.reach(held.record) for _, view in views if (held := view.get(record.key)) is not None}
        if states & {Reach.REACHABLE, Reach.UNREACHABLE}:
            ok = Reach.REACHABLE in states
            liveness.probes[record.peer] = Probe(tuple(record.addrs), record.timestamp, ok, 0.0)
    merged.liveness = liveness
    for ticket, view in views:
        held = sum(view.get(r.key) is not None for r in servers)
        if len(servers) >= 4 and held < 0.75 * len(servers):
            log.warning(
                "swarm member %s listed %d of the %d servers the others know: it may be hiding the swarm; "
                "using every valid record",
                ticket.peer_id[:10],
                held,
                len(servers),
            )
    return merged


async def _views(
    node: BaseNode, tickets: Sequence[Ticket], swarm: str, timeout: float, quiet: bool = False
) -> list[tuple[Ticket, RecordTable]]:
    """Each answering ticket's table (as its peer sees it), in the order given. Once
    ``ENOUGH_VIEWS`` have answered, the others get ``LATE_VIEW_GRACE`` seconds more: a member that
    died (say the first server a client was given) must not hold up every look for ``timeout``,
    nor a wait for servers to join, whose looks must end within it."""

    async def one(ticket: Ticket) -> tuple[Ticket, RecordTable] | None:
        try:
            return ticket, table_from_reply(swarm, await fetch_table(node, ticket, timeout))
        except Forbidden:  # a private swarm that does not admit this client: any member would say so
            raise
        except ShoalError as exc:
            (log.debug if quiet else log.warning)(
                "could not pull the swarm table from %s: %s", ticket.peer_id[:10], exc
            )
            return None

    tasks = [asyncio.ensure_future(one(t)) for t in tickets]
    views: dict[int, tuple[Ticket, RecordTable]] = {}

    def take(task: asyncio.Future) -> None:
        view = task.result()  # Forbidden raises here
        if view is not None:
            views[tasks.index(task)] = view

    enough = min(ENOUGH_VIEWS, len(tasks))
    try:
        await until_covered(set(tasks), take, lambda: len(views) >= enough, lambda: time.monotonic() + LATE_VIEW_GRACE)
    finally:
        for task in tasks:  # those past the grace (a no-op on the rest)
            task.cancel()
    return [views[i] for i in sorted(views)]


async def swarm_spans(
    node: BaseNode,
    tickets: Sequence[Ticket],
    model: str | None,
    timeout: float,
    more: bool = True,
    vouched: Vouched | None = None,
) -> list[ServerSpan]:
    """The online servers of ``model`` in the swarm's table (:func:`pull_table`, ``more``: with
    other members' views too) that its verdicts do not convict and no member found unreachable.
    ``vouched``: a client's (see :func:`shoal.swarm.verdicts.tally`): only judges it saw compute the
    blocks convict; servers that only unseen judges accuse are left out too while every block stays
    served without them (where it is not, they stay, and the client's audits check them)."""
    table = await pull_table(node, tickets, timeout, more)
    swarm = table.swarm
    names = sorted(m.name for m in table.models())
    if model is None or table.model(model) is None:
        pinned = table.rejected["model_pin"]
        refused = f" ({pinned} model records refused: not the model the swarm is pinned to)" if pinned else ""
        serves = ", ".join(names) or "nothing yet"
        raise ShoalError(f"swarm {swarm} has no model {model!r}; it serves: {serves}{refused}")
    spans = []
    num_blocks, pinned = table.model(model).num_blocks, table.model(model).fingerprints
    liars = convicted(table, model, vouched=vouched)
    if liars:
        log.info("the swarm convicted %s of lying: not routed over", ", ".join(p[:10] for p in sorted(liars)))
    for record in table.servers(model):
        if record.state is State.ONLINE and record.peer not in liars:
            ticket = Ticket(record.peer, record.addrs, record.relay, swarm)
            info = RouteInfo(
                num_blocks=num_blocks,
                throughput=record.throughput or 1.0,
                step_ms=record.step_ms,
                rtts=dict(record.rtts),
                free_cache_tokens=record.cache_tokens_free,
                capabilities=frozenset(record.capabilities),
                quantization=record.quantization,
                adapters=tuple(record.adapters),
                # the model record's (the swarm's pin): what the span's receipts must name as weights
                fingerprints=tuple(f.hex() for f in pinned[record.start : record.end]),
                dtype=compute_dtype(record.compute) if record.compute else None,
                compute=record.compute,
            )
            spans.append(ServerSpan(PeerId(record.peer), record.blocks, ticket, info))
    return _around_suspects(spans, suspected(table, model, vouched) if vouched is not None else {}, num_blocks)


def _around_suspects(spans: list[ServerSpan], suspects: Collection[PeerId], num_blocks: int) -> list[ServerSpan]:
    """``spans`` without the ``suspects`` (accused by judges this client has not seen compute) when
    the rest still serve every block the whole did; else all of them (audits check the suspects)."""
    if not suspects:
        return spans
    kept = [s for s in spans if s.peer_id not in suspects]
    if set(uncovered_blocks(kept, num_blocks)) - set(uncovered_blocks(spans, num_blocks)):
        log.info("servers %s are accused by judges this client has not seen compute: used where nothing else "
                 "serves their blocks", ", ".join(p[:10] for p in sorted(suspects)))  # fmt: skip
        return spans
    log.info("servers %s are accused by judges this client has not seen compute: routed around",
             ", ".join(p[:10] for p in sorted(suspects)))  # fmt: skip
    return kept


async def known_spans(
    node: BaseNode,
    tickets: Sequence[Ticket],
    model: str | None,
    timeout: float,
    num_blocks: int | None = None,
    more: bool = True,
    vouched: Vouched | None = None,
) -> list[ServerSpan]:
    """The servers ``tickets`` lead to, each once: every swarm's (:func:`swarm_spans`, through that
    swarm's tickets) and each plain ticket's own (:func:`fetch_info`). Given ``num_blocks``, once
    the answers cover every block the rest get ``LISTING_GRACE`` more: a dead plain ticket does not
    hold up a client whose other servers are enough (a late one is listed at the next refresh)."""
    by_swarm: dict[str, list[Ticket]] = {}
    for ticket in tickets:
        if ticket.swarm_id:
            by_swarm.setdefault(ticket.swarm_id, []).append(ticket)
    asks = [swarm_spans(node, members, model, timeout, more, vouched) for members in by_swarm.values()]
    asks += [_listed(fetch_info(node, t, timeout)) for t in tickets if not t.swarm_id]
    tasks = [asyncio.ensure_future(ask) for ask in asks]
    found: list[ServerSpan] = []

    def take(task: asyncio.Future) -> None:
        found.extend(task.result())  # a swarm none of whose tickets answered raises here

    def covered() -> bool:
        return num_blocks is not None and not uncovered_blocks(found, num_blocks)

    try:
        await until_covered(set(tasks), take, covered, lambda: time.monotonic() + LISTING_GRACE)
    finally:
        for task in tasks:  # the ones not waited for (a no-op on the rest)
            task.cancel()
    unique: dict[PeerId, ServerSpan] = {}
    for span in found:
        unique.setdefault(span.peer_id, span)
    return list(unique.values())


async def until_covered(
    pending: set[asyncio.Future],
    take: Callable[[asyncio.Future], None],
    covered: Callable[[], bool],
    grace_until: Callable[[], float],
    deadline: float | None = None,
) -> set[asyncio.Future]:
    """``take`` each of ``pending`` as it finishes, until none is left or ``deadline`` (monotonic;
    None: no limit) passes. Once ``covered()`` holds with some still pending, the deadline becomes
    ``grace_until()``: the late answers get a grace period, not the whole wait (a dead server must
    not hold up a client whose others are enough). Returns those still pending, not cancelled."""
    graced = False
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
        for task in done:
            take(task)
        if pending and not graced and covered():
            deadline, graced = grace_until(), True
    return pending


async def _listed(ask) -> list[ServerSpan]:
    span = await ask
    return [] if span is None else [span]


def missing_servers(missing: Sequence[int], *, swarm: bool, silent: int = 0) -> NoRouteError:
    """The error of a client whose servers leave ``missing`` blocks unhosted, in one line that says
    how to add them: a server for each gap that joins the swarm (``swarm``: some ticket names one),
    or one more ticket. ``silent``: given peers that did not answer (they may host those blocks)."""
    first, *rest = block_runs(missing)
    more = f" (and one with {', '.join(f'--blocks {g}' for g in rest)})" if rest else ""
    unanswered = f" ({silent} of the given peers did not answer)" if silent else ""
    if swarm:
        how = f"`shoal serve MODEL --blocks {first} --join TICKET`{more}, or pass the ticket of a server hosting them"
    else:
        how = f"`shoal serve MODEL --blocks {first}`{more} and pass its ticket"
    return NoRouteError(
        f"no server hosts blocks {format_blocks(list(missing))}{unanswered}: start one with {how} with another --join",
        list(missing),
    )


def check_consistent(spans: Sequence[ServerSpan], num_blocks: int, hidden_size: int) -> None:
    """Servers must agree with the client's config and with each other on every block's weights."""
    seen: dict[int, tuple[str, str]] = {}
    for span in spans:
        info = span.info
        if info.num_blocks != num_blocks or info.hidden_size not in (hidden_size, None):
            raise ShoalError(
                f"server {span.peer_id[:10]} serves a model with {info.num_blocks} blocks of size "
                f"{info.hidden_size}, the client's config has {num_blocks} of size {hidden_size}"
            )
        for block, fingerprint in zip(span.blocks.blocks(), info.fingerprints, strict=False):
            other = seen.setdefault(block, (fingerprint, span.peer_id))
            if other[0] != fingerprint:
                raise ShoalError(
                    f"servers {other[1][:10]} and {span.peer_id[:10]} hold different weights for block {block}"
                )


__all__ = [
    "check_consistent",
    "fetch_info",
    "known_spans",
    "missing_servers",
    "pull_table",
    "swarm_spans",
    "until_covered",
]
