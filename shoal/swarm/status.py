"""``shoal swarm status``: the swarm's table as seen through one peer, as text or JSON: models,
servers, coverage, the verdicts against servers and whether their quorum convicts
(:mod:`shoal.swarm.verdicts`), and the records that peer rejected, by reason (forgeries show there)."""

from __future__ import annotations

import json
import time

from shoal.errors import UsageError
from shoal.swarm.liveness import Reach
from shoal.swarm.records import ServerRecord, State
from shoal.swarm.service import fetch_table, reach_any, table_from_reply
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import tally
from shoal.transport import Node, Ticket, TransportConfig


async def swarm_status(
    ticket: Ticket, transport: TransportConfig, identity: bytes | None = None, member_cert: bytes | None = None
) -> dict:
    """The summary of the table of ``ticket``'s peer; ``identity`` and ``member_cert``: the key and
    member certificate a private swarm admits the reader with."""
    if not ticket.swarm_id:
        raise UsageError(
            "this ticket names no swarm: it was printed by a server started without --new-swarm or --join; "
            "use the ticket of a swarm member"
        )
    async with await Node.start(transport, secret_key=identity) as node:
        node.credential = member_cert
        await reach_any(node, [ticket], transport.deadlines.connect)  # a dead peer fails in --connect-timeout
        payload = await fetch_table(node, ticket, transport.deadlines.request)
    table = table_from_reply(ticket.swarm_id, payload)
    return summarize(table, time.time(), rejected=payload.rejected)


def _server(record: ServerRecord, now: float, reach: Reach) -> dict:
    """One server's line: ``state`` is ``unreachable`` (whatever its record says) when the peer
    asked found it so; ``reach`` says whether that peer has reached it yet."""
    unreachable = reach is Reach.UNREACHABLE and record.state is not State.OFFLINE
    return {
        "peer": record.peer,
        "start": record.start,
        "end": record.end,
        "state": "unreachable" if unreachable else str(record.state),
        "reach": reach.value,
        "throughput": record.throughput,
        "cache_tokens_free": record.cache_tokens_free,
        "rtts_ms": dict(record.rtts),
        "version": record.version,
        "age_s": round(now - record.timestamp, 2),
        "expires_in_s": round(record.expires - now, 2),
    }


def summarize(table: RecordTable, now: float, rejected: dict[str, int] | None = None) -> dict:
    """The status of ``table``; ``rejected``: the rejection counts to show (default: the table's own;
    a status tool shows those of the peer it asked), less ``stale`` (gossip delivers copies of what a
    peer holds all the time: not worth a look, unlike a forgery)."""
    verdicts = [t for name in sorted({v.model for v in table.verdicts()}) for t in tally(table, name, now)]
    liars = {(t.model, t.accused) for t in verdicts if t.convicts}
    models = []
    for model in sorted(table.models(), key=lambda m: m.name):
        servers = table.servers(model.name, include_offline=True, include_unreachable=True)
        coverage = [0] * model.num_blocks
        for record in servers:
            if record.state is State.ONLINE and table.reach(record) is not Reach.UNREACHABLE:
                for block in range(record.start, min(record.end, model.num_blocks)):
                    coverage[block] += 1
        models.append(
            {
                "name": model.name,
                "num_blocks": model.num_blocks,
                "coverage": coverage,
                "uncovered": [i for i, n in enumerate(coverage) if n == 0],
                "servers": [
                    {**_server(r, now, table.reach(r)), "convicted": (model.name, r.peer) in liars} for r in servers
                ],
            }
        )
    listed = {s["peer"] for m in models for s in m["servers"]}
    everyone = table.servers(include_offline=True, include_unreachable=True)
    orphans = [_server(r, now, table.reach(r)) for r in everyone if r.peer not in listed]
    return {
        "swarm": table.swarm,
        "models": models,
        "unverified_servers": orphans,
        "verdicts": [t.as_json() for t in verdicts],
        "rejected": {
            why: n for why, n in sorted((table.rejected if rejected is None else rejected).items()) if why != "stale"
        },
    }


def render(status: dict) -> str:
    lines = [f"swarm {status['swarm']}"]
    for model in status["models"]:
        bar = "".join(str(min(n, 9)) if n else "." for n in model["coverage"])
        lines.append(f"model {model['name']}: {model['num_blocks']} blocks, coverage [{bar}]")
        if model["uncovered"]:
            lines.append(f"  uncovered blocks: {model['uncovered']}")
        for s in model["servers"]:
            lines.append(
                f"  {s['peer'][:12]}  [{s['start']:>3}:{s['end']:<3})  {s['state']:<11} "
                f"throughput {s['throughput']:<7.3g} free cache {s['cache_tokens_free']:<7} age {s['age_s']:.1f}s"
            )
    for s in status["unverified_servers"]:
        lines.append(f"  (no model record) {s['peer'][:12]} [{s['start']}:{s['end']}) {s['state']}")
    for v in status.get("verdicts", ()):
        finding = "CONVICTED, not routed over" if v["convicts"] else "no quorum"
        ignored = f", {len(v['ignored_judges'])} judges not counted" if v["ignored_judges"] else ""
        lines.append(
            f"verdict against {v['accused'][:12]} on {v['model']} [{v['start']}:{v['end']}): "
            f"{len(v['judges'])} of {v['electorate']} servers on them judged it, {v['needed']} needed"
            f"{ignored}: {finding}"
        )
    if status.get("rejected"):
        lines.append("rejected records: " + ", ".join(f"{why} {n}" for why, n in status["rejected"].items()))
    return "\n".join(lines)


def to_json(status: dict) -> str:
    return json.dumps(status, indent=2)
