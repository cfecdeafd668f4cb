"""Joining a swarm with no weights on disk: fetch a span's files from the swarm's members, check
them, and leave a checkpoint directory the usual loaders read (:func:`fetch_span_from_swarm`); a
client fetches its part (config, tokenizer, embeddings and head) the same way
(:func:`fetch_client_from_swarm`).

What is checked: the swarm's table verifies every record's signature (and, in a pinned swarm, that
the model record is the one the swarm id pins, its manifest too where the pin covers it); the
manifest fetched from a giver must have the BLAKE3 digest the signed model record names; every chunk
must have the manifest's size and digest (else it is fetched again from another giver, and its
sender banned for the fetch); and once whole, each block's fingerprint (sha256 over its tensors as
stored) must be the model record's. A client's tensors have no fingerprint: they are fetched only by
a manifest the swarm id pins (or a private swarm's owner signed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from shoal.checkpoints.fetch import SWARM_MARKER, is_fetched, swarm_weights_dir
from shoal.checkpoints.loading import load_config, load_tensors, span_fingerprints, span_tensor_filter
from shoal.checkpoints.manifest import Manifest, holds_item, locate, manifest_digest
from shoal.ids import BlockRange
from shoal.swarm.records import ModelRecord, State
from shoal.swarm.service import fetch_table, reach_any, table_from_reply
from shoal.swarm.swarmid import model_digest, parse_swarm_id
from shoal.swarm.table import RecordTable
from shoal.transport import BaseNode, StartNode, Ticket, TransportConfig
from shoal.weights.fetch import FetchReport, WeightsError, fetch_chunks, fetch_manifest
from shoal.weights.partial import PartialSpan, fetched_manifest, forget_tensors
from shoal.wire.schema import WEIGHTS as GIVES_WEIGHTS

log = logging.getLogger(__name__)


def givers_of(table: RecordTable, model: str, me: str = "") -> list[Ticket]:
    """Tickets of the online servers of ``model`` that announce they give its weights."""
    return [
        Ticket(r.peer, r.addrs, r.relay, table.swarm)
        for r in table.servers(model)
        if GIVES_WEIGHTS in r.capabilities and r.state is State.ONLINE and r.peer != me
    ]


def fetches_from_swarm(model: str) -> bool:
    """Whether a server or client of ``model`` given a swarm's tickets fetches its part from the
    swarm's members: ``model`` is no local directory, no GGUF file, no Hub id (those keep the Hub)
    and no known model fetched here."""
    hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    return not (Path(model).expanduser().exists() or model.endswith(".gguf") or hub_id or is_fetched(model))


def _unused_name(root: Path, name: str) -> str:
    """``name``, or ``name-N``: a tensor file name under ``root`` not taken by an earlier fetch."""
    unused, n = name, 1
    while (root / f"{unused}.safetensors").exists():
        n += 1
        unused = f"{name}-{n}"
    return unused


def check_fingerprints(root: Path, record: ModelRecord, blocks: BlockRange) -> None:
    """Each block's fingerprint over the tensors held under ``root``, against the model record's."""
    config = load_config(root)
    tensors = load_tensors(root, span_tensor_filter(config, blocks.start, blocks.end), progress=False)
    prints = span_fingerprints(config, blocks.start, blocks.end, tensors)
    wrong = [i for i in blocks.blocks() if bytes.fromhex(prints[i]) != record.fingerprints[i]]
    if wrong:
        raise WeightsError(f"fetched blocks {wrong} are not the model's (their fingerprints differ from the record's)")


async def _model_record(
    node: BaseNode, tickets: list[Ticket] | tuple[Ticket, ...], model: str, timeout: float, reach_timeout: float | None
) -> tuple[RecordTable, ModelRecord]:
    """The table of the swarm ``tickets`` lead to (reached within ``reach_timeout``, default
    ``timeout``), and its model record of ``model`` with a manifest."""
    ticket = await reach_any(node, list(tickets), reach_timeout or timeout)
    if ticket.swarm_id is None:
        raise WeightsError("the --join ticket names no swarm")
    table = table_from_reply(ticket.swarm_id, await fetch_table(node, ticket, timeout))
    record = table.model(model)
    if record is None or not record.manifest:
        raise WeightsError(f"swarm {ticket.swarm_id} has no model record of {model} with a chunk manifest")
    return table, record


def _lacking(root: Path, manifest: Manifest, items: list[int], check: bool) -> list[int]:
    """Which of the manifest's ``items`` ``root`` does not hold. With ``check`` everything it holds of
    the manifest is compared with it chunk by chunk first, and what differs (files another manifest
    left, e.g. another swarm's model of the same name) is forgotten, so that it is fetched again when
    wanted, not kept because its size matches."""
    held = locate(root, manifest) if root.is_dir() else [None] * len(manifest.items)
    if check:
        size = manifest.chunk_size
        wrong = [i for i, at in enumerate(held) if at is not None and not holds_item(at, manifest.items[i], size)]
        forget_tensors(root, [manifest.items[i].name for i in wrong if manifest.items[i].dtype])
        for i in wrong:
            held[i] = None
    return [i for i in items if held[i] is None]


async def _fetch_items(
    node: BaseNode, table: RecordTable, record: ModelRecord, root: Path, items: Callable[[Manifest], list[int]],
    name: str, timeout: float, progress: bool | None,
) -> FetchReport | None:  # fmt: skip
    """Fetch what ``root`` lacks of the manifest's ``items`` from the table's givers, resuming a fetch
    cut short there; None when ``root`` held them all already. What ``root`` holds counts as held
    without a second look only where an earlier fetch by the same manifest left it (that fetch checked
    every chunk it fetched, and everything of the manifest that was there before): then no giver need
    be online either."""
    kept = fetched_manifest(root)
    manifest = kept[0] if kept is not None and manifest_digest(kept[1]) == record.manifest else None
    if manifest is not None:  # what is here was checked by the fetch that kept it
        wanted = await asyncio.to_thread(_lacking, root, manifest, items(manifest), False)
        if not wanted:
            return None
    givers = givers_of(table, record.name, node.id)
    if not givers:
        raise WeightsError(f"no online member of swarm {table.swarm} gives {record.name}'s weights")
    if manifest is None:  # what is here, if anything, is checked chunk by chunk
        manifest = await fetch_manifest(node, givers, record.name, record.manifest, timeout)
        root.mkdir(parents=True, exist_ok=True)
        wanted = await asyncio.to_thread(_lacking, root, manifest, items(manifest), True)
        if not wanted:
            return None
    partial = await asyncio.to_thread(PartialSpan, root, manifest, record.manifest, wanted, _unused_name(root, name))
    try:
        report = await fetch_chunks(node, givers, partial, timeout, progress=progress)
    except BaseException:
        partial.close()
        raise
    await asyncio.to_thread(partial.finish)
    return report


async def fetch_span_from_swarm(
    node: BaseNode, tickets: list[Ticket] | tuple[Ticket, ...], model: str, blocks: BlockRange,
    root: Path | None = None, timeout: float = 30.0, progress: bool | None = None, reach_timeout: float | None = None,
) -> FetchReport:  # fmt: skip
    """Fetch what ``root`` (default: :func:`swarm_weights_dir`) lacks of blocks ``blocks`` of
    ``model`` (and its config and tokenizer) from the givers of the swarm ``tickets`` lead to,
    resuming a fetch cut short there, and check it (see the module docstring)."""
    root = root if root is not None else swarm_weights_dir(model)
    table, record = await _model_record(node, tickets, model, timeout, reach_timeout)
    if blocks.end > record.num_blocks:
        raise WeightsError(f"blocks {blocks} are outside {model}'s {record.num_blocks} blocks")

    def span(manifest: Manifest) -> list[int]:
        return manifest.span_items(blocks.start, blocks.end)

    report = await _fetch_items(node, table, record, root, span, f"blocks-{blocks.start}-{blocks.end}", timeout,
                                progress)  # fmt: skip
    if report is None:
        return FetchReport()
    try:
        await asyncio.to_thread(check_fingerprints, root, record, blocks)
    except WeightsError:
        (root / SWARM_MARKER).unlink(missing_ok=True)  # not to be served: the files stay for a look
        raise
    log.info("fetched %d chunks (%.1f MB) of blocks %s in %.1f s from %d givers%s", report.fetched,
             report.bytes / 1e6, blocks, report.seconds, len(report.by_giver),
             f"; banned {len(report.banned)}" if report.banned else "")  # fmt: skip
    return report


def vouched_manifest(table: RecordTable, record: ModelRecord) -> bool:
    """Whether more than the first model record vouches for ``record``'s manifest: the swarm id pins
    it (a swarm founded since pins took the manifest), or the private swarm's owner signed it."""
    if table.signed_by_owner(record):
        return True
    swarm = parse_swarm_id(table.swarm)
    return swarm.pin is not None and swarm.pin == model_digest(
        record.name, record.num_blocks, record.fingerprints, record.manifest
    )


async def fetch_client_from_swarm(
    node: BaseNode, tickets: list[Ticket] | tuple[Ticket, ...], model: str, root: Path | None = None,
    timeout: float = 30.0, progress: bool | None = None, reach_timeout: float | None = None,
) -> FetchReport:  # fmt: skip
    """Fetch what ``root`` (default: :func:`swarm_weights_dir`) lacks of ``model``'s client part (its
    config and tokenizer, and every tensor of no block: the embeddings, final norm and head) from the
    givers of the swarm ``tickets`` lead to. No fingerprint covers those tensors, so only a manifest
    the swarm id pins (or a private swarm's owner signed) is fetched by: every chunk is then the
    founder's."""
    root = root if root is not None else swarm_weights_dir(model)
    table, record = await _model_record(node, tickets, model, timeout, reach_timeout)
    if not vouched_manifest(table, record):
        raise WeightsError(
            f"swarm {table.swarm}'s id does not pin {model}'s chunk manifest, so its embeddings and head could "
            "not be checked: give the model's directory, Hub id or known name instead"
        )
    report = await _fetch_items(node, table, record, root, Manifest.client_items, "client", timeout, progress)
    return report if report is not None else FetchReport()


async def fetch_weights(
    start_node: StartNode, transport: TransportConfig, tickets: tuple[Ticket, ...], model: str,
    blocks: BlockRange | None, credential: bytes | None = None, root: Path | None = None,
    progress: bool | None = None, secret_key: bytes | None = None,
) -> FetchReport:  # fmt: skip
    """:func:`fetch_span_from_swarm` (``blocks``; None: :func:`fetch_client_from_swarm`) from an
    endpoint of its own (started by ``start_node`` with ``transport`` and ``secret_key``, presenting
    ``credential`` in a private swarm), closed after: a server or client fetches before it reads the
    model's config, so before its own endpoint exists."""
    node = await start_node(transport, **({"secret_key": secret_key} if secret_key is not None else {}))
    node.credential = credential
    timeout, reach = transport.deadlines.request, transport.deadlines.connect  # no swarm: said in seconds
    try:
        if blocks is None:
            return await fetch_client_from_swarm(node, tickets, model, root, timeout, progress, reach)
        return await fetch_span_from_swarm(node, tickets, model, blocks, root, timeout, progress, reach)
    finally:
        await node.close(linger=0.2)


__all__ = [
    "check_fingerprints",
    "fetch_client_from_swarm",
    "fetch_span_from_swarm",
    "fetch_weights",
    "fetches_from_swarm",
    "givers_of",
    "vouched_manifest",
]
