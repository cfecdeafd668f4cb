"""Joining a swarm with no weights on disk: fetch a span's files from the swarm's members, check
them, and leave a checkpoint directory the usual loaders read (:func:`fetch_span_from_swarm`).

What is checked: the swarm's table verifies every record's signature (and, in a pinned swarm, that
the model record is the one the swarm id pins); the manifest fetched from a giver must have the
BLAKE3 digest the signed model record names; every chunk must have the manifest's size and digest
(else it is fetched again from another giver, and its sender banned for the fetch); and once whole,
each block's fingerprint (sha256 over its tensors as stored) must be the model record's.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from shoal.checkpoints.fetch import SWARM_MARKER, swarm_weights_dir
from shoal.checkpoints.loading import load_config, load_tensors, span_fingerprints, span_tensor_filter
from shoal.checkpoints.manifest import locate
from shoal.ids import BlockRange
from shoal.swarm.records import ModelRecord, State
from shoal.swarm.service import fetch_table, reach_any, table_from_reply
from shoal.swarm.table import RecordTable
from shoal.transport import BaseNode, StartNode, Ticket, TransportConfig
from shoal.weights.fetch import FetchReport, WeightsError, fetch_chunks, fetch_manifest
from shoal.weights.partial import PartialSpan
from shoal.wire.schema import WEIGHTS as GIVES_WEIGHTS

log = logging.getLogger(__name__)


def givers_of(table: RecordTable, model: str, me: str = "") -> list[Ticket]:
    """Tickets of the online servers of ``model`` that announce they give its weights."""
    return [
        Ticket(r.peer, r.addrs, r.relay, table.swarm)
        for r in table.servers(model)
        if GIVES_WEIGHTS in r.capabilities and r.state is State.ONLINE and r.peer != me
    ]


def _span_file(root: Path, blocks: BlockRange) -> str:
    """The name of the span's tensor file: one not taken by an earlier fetch."""
    name, n = f"blocks-{blocks.start}-{blocks.end}", 1
    while (root / f"{name}.safetensors").exists():
        n += 1
        name = f"blocks-{blocks.start}-{blocks.end}-{n}"
    return name


def check_fingerprints(root: Path, record: ModelRecord, blocks: BlockRange) -> None:
    """Each block's fingerprint over the tensors held under ``root``, against the model record's."""
    config = load_config(root)
    tensors = load_tensors(root, span_tensor_filter(config, blocks.start, blocks.end), progress=False)
    prints = span_fingerprints(config, blocks.start, blocks.end, tensors)
    wrong = [i for i in blocks.blocks() if bytes.fromhex(prints[i]) != record.fingerprints[i]]
    if wrong:
        raise WeightsError(f"fetched blocks {wrong} are not the model's (their fingerprints differ from the record's)")


async def fetch_span_from_swarm(
    node: BaseNode, tickets: list[Ticket] | tuple[Ticket, ...], model: str, blocks: BlockRange,
    root: Path | None = None, timeout: float = 30.0, progress: bool | None = None,
) -> FetchReport:  # fmt: skip
    """Fetch what ``root`` (default: :func:`swarm_weights_dir`) lacks of blocks ``blocks`` of
    ``model`` (and its config and tokenizer) from the givers of the swarm ``tickets`` lead to,
    resuming a fetch cut short there, and check it (see the module docstring)."""
    root = root if root is not None else swarm_weights_dir(model)
    ticket = await reach_any(node, list(tickets), timeout)
    if ticket.swarm_id is None:
        raise WeightsError("the --join ticket names no swarm")
    table = table_from_reply(ticket.swarm_id, await fetch_table(node, ticket, timeout))
    record = table.model(model)
    if record is None or not record.manifest:
        raise WeightsError(f"swarm {ticket.swarm_id} has no model record of {model} with a chunk manifest")
    if blocks.end > record.num_blocks:
        raise WeightsError(f"blocks {blocks} are outside {model}'s {record.num_blocks} blocks")
    givers = givers_of(table, model, node.id)
    if not givers:
        raise WeightsError(f"no online member of swarm {ticket.swarm_id} gives {model}'s weights")
    manifest = await fetch_manifest(node, givers, model, record.manifest, timeout)
    root.mkdir(parents=True, exist_ok=True)
    held = await asyncio.to_thread(locate, root, manifest)
    wanted = [i for i in manifest.span_items(blocks.start, blocks.end) if held[i] is None]
    if not wanted:
        return FetchReport()
    partial = await asyncio.to_thread(PartialSpan, root, manifest, record.manifest, wanted, _span_file(root, blocks))
    try:
        report = await fetch_chunks(node, givers, partial, timeout, progress=progress)
    except BaseException:
        partial.close()
        raise
    await asyncio.to_thread(partial.finish)
    try:
        await asyncio.to_thread(check_fingerprints, root, record, blocks)
    except WeightsError:
        (root / SWARM_MARKER).unlink(missing_ok=True)  # not to be served: the files stay for a look
        raise
    log.info("fetched %d chunks (%.1f MB) of blocks %s in %.1f s from %d givers%s", report.fetched,
             report.bytes / 1e6, blocks, report.seconds, len(report.by_giver),
             f"; banned {len(report.banned)}" if report.banned else "")  # fmt: skip
    return report


async def fetch_weights(
    start_node: StartNode, transport: TransportConfig, tickets: tuple[Ticket, ...], model: str, blocks: BlockRange,
    credential: bytes | None = None, root: Path | None = None, progress: bool | None = None,
) -> FetchReport:  # fmt: skip
    """:func:`fetch_span_from_swarm` from an endpoint of its own (started by ``start_node`` with
    ``transport``, presenting ``credential`` in a private swarm), closed after: a server fetches
    before its preflight reads the model, so before its own endpoint exists."""
    node = await start_node(transport)
    node.credential = credential
    try:
        return await fetch_span_from_swarm(node, tickets, model, blocks, root, transport.deadlines.request, progress)
    finally:
        await node.close(linger=0.2)


__all__ = ["check_fingerprints", "fetch_span_from_swarm", "fetch_weights", "givers_of"]
