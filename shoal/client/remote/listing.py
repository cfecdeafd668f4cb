"""Which servers a client's tickets lead to: each swarm's table (through any member that answers;
servers the swarm convicted of lying or found unreachable left out) and each plain ticket's own
``info`` (standalone servers, started without ``--new-swarm``/``--join``), the two together; and the
errors that say what is missing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from shoal.errors import ShoalError
from shoal.ids import PeerId
from shoal.protocols import BLOCKS
from shoal.routing import NoRouteError, RouteInfo, ServerSpan, block_runs, format_blocks, uncovered_blocks
from shoal.swarm.records import State
from shoal.swarm.service import fetch_table, table_from_reply
from shoal.swarm.verdicts import convicted
from shoal.transport import BaseNode, Ticket
from shoal.wire import Message
from shoal.wire.schema import InfoReply

log = logging.getLogger(__name__)

LISTING_GRACE = 1.0  # seconds a plain ticket's peer may answer after the others cover every block


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
    )
    return ServerSpan(PeerId(ticket.peer_id), span.blocks, ticket, info)


async def swarm_spans(node: BaseNode, tickets: Sequence[Ticket], model: str | None, timeout: float) -> list[ServerSpan]:
    """Pull the swarm's table through the first ticket that answers; the online servers of ``model``
    that its verdicts do not convict."""
    swarm = next(t.swarm_id for t in tickets if t.swarm_id)
    for ticket in tickets:
        try:
            table = table_from_reply(swarm, await fetch_table(node, ticket, timeout))  # its unreachable ones left out
            break
        except ShoalError as exc:
            log.warning("could not pull the swarm table from %s: %s", ticket.peer_id[:10], exc)
    else:
        raise ShoalError(f"no peer of swarm {swarm} answered; tried {len(tickets)} tickets")
    names = sorted(m.name for m in table.models())
    if model is None or table.model(model) is None:
        raise ShoalError(f"swarm {swarm} has no model {model!r}; it serves: {', '.join(names) or 'nothing yet'}")
    spans = []
    num_blocks = table.model(model).num_blocks
    liars = convicted(table, model)
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
            )
            spans.append(ServerSpan(PeerId(record.peer), record.blocks, ticket, info))
    return spans


async def known_spans(
    node: BaseNode, tickets: Sequence[Ticket], model: str | None, timeout: float, num_blocks: int | None = None
) -> list[ServerSpan]:
    """The servers ``tickets`` lead to, each once: every swarm's (:func:`swarm_spans`, through that
    swarm's tickets) and each plain ticket's own (:func:`fetch_info`). Given ``num_blocks``, once
    the answers cover every block the rest get ``LISTING_GRACE`` more: a dead plain ticket does not
    hold up a client whose other servers are enough (a late one is listed at the next refresh)."""
    by_swarm: dict[str, list[Ticket]] = {}
    for ticket in tickets:
        if ticket.swarm_id:
            by_swarm.setdefault(ticket.swarm_id, []).append(ticket)
    asks = [swarm_spans(node, members, model, timeout) for members in by_swarm.values()]
    asks += [_listed(fetch_info(node, t, timeout)) for t in tickets if not t.swarm_id]
    pending = {asyncio.ensure_future(ask) for ask in asks}
    found: list[ServerSpan] = []
    deadline: float | None = None
    try:
        while pending:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            for task in done:
                found.extend(task.result())  # a swarm none of whose tickets answered raises here
            if deadline is None and num_blocks is not None and not uncovered_blocks(found, num_blocks):
                deadline = time.monotonic() + LISTING_GRACE
    finally:
        for task in pending:
            task.cancel()
    unique: dict[PeerId, ServerSpan] = {}
    for span in found:
        unique.setdefault(span.peer_id, span)
    return list(unique.values())


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


__all__ = ["check_consistent", "fetch_info", "known_spans", "missing_servers", "swarm_spans"]
