"""How a server is put together, step by step, by ``shoal serve`` (:func:`shoal.server.app.serve`)
and by the in-process harness (:class:`shoal.launch.InProcessSwarm`) alike: both call these
functions in the same order, and differ only in the node they start (iroh, or an in-memory network)
and in how they choose a swarm id.

1. :func:`~shoal.server.preflight.check_server`: the settings against the model, whose config is
   read once and travels on in the :class:`~shoal.server.preflight.CheckedServer`.
2. :func:`node_key`, then :func:`start_endpoint`: the node, answering through a
   :class:`~shoal.server.presence.LoadingGate` (``busy`` until a span is loaded).
3. In a swarm, :func:`make_presence` and :meth:`Presence.join <shoal.server.presence.Presence.join>`:
   gossip, and the throughput to announce.
4. :func:`span_loader` and :func:`come_online`: the span placed (unless given), loaded on the compute
   thread (:func:`load_block_server`: backend, KV budget, judge and pusher, each given its context
   when made), and announced ``online``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from shoal import __version__
from shoal.checkpoints import load_span, model_fingerprints, model_name, resolve_model
from shoal.checkpoints.manifest import Manifest, cached_manifest, manifest_digest
from shoal.errors import UsageError
from shoal.ids import BlockRange
from shoal.models import BlockSpan
from shoal.models.packed import calibrate, pack_linears
from shoal.quantization import Quantization
from shoal.server.backend import SpanBackend
from shoal.server.budget import CacheBudget
from shoal.server.config import ServerConfig
from shoal.server.handler import BlockServer
from shoal.server.judge import Judge, Jurisdiction
from shoal.server.preflight import CheckedServer, check_blocks
from shoal.server.presence import Loader, LoadingGate, Presence
from shoal.server.push import Pusher
from shoal.server.scheduler import ComputeScheduler
from shoal.swarm.members import public_key, read_certificate, refusal
from shoal.swarm.records import State
from shoal.swarm.swarmid import model_digest, new_swarm_id, owner_tag, parse_swarm_id, pin_refusal
from shoal.transport import BaseNode, StartNode, load_or_create_identity
from shoal.transport.identity import generate_key
from shoal.verify.receipts import ReceiptSigner, announced_compute
from shoal.weights.give import Giver
from shoal.weights.partial import fetched_manifest
from shoal.wire.schema import CAPABILITIES, MIGRATE, RECEIPTS, ServerCounters, SpanInfo

log = logging.getLogger(__name__)
#: Turns a loaded server into the one that serves (e.g. :func:`testkit.faulty.make_faulty`).
Prepare = Callable[[BlockServer], BlockServer]


def node_key(config: ServerConfig) -> bytes:
    """The node's secret key (its receipts are signed with it too): from ``identity_file``, or new."""
    return load_or_create_identity(config.identity_file) if config.identity_file else generate_key()


def swarm_id_of(config: ServerConfig, checked: CheckedServer | None = None) -> str | None:
    """The swarm ``shoal serve`` takes part in: a new one, the one its ``--join`` tickets name, or none
    (the config refused ``--new-swarm`` with ``--join``). A new swarm is pinned to ``checked``'s model
    (:func:`founding_pin`), and private when the server has a member certificate (its owner's)."""
    if config.new_swarm:
        owner = owner_tag(read_certificate(config.member_cert).owner) if config.member_cert else None
        return new_swarm_id(founding_pin(checked) if checked is not None else None, owner)
    if not config.join:
        return None
    ids = {t.swarm_id for t in config.join}
    if None in ids or len(ids) != 1:
        raise UsageError("every --join ticket must carry the same swarm id (use a ticket printed by a swarm member)")
    return ids.pop()


def founding_pin(checked: CheckedServer) -> str | None:
    """The pin of a new swarm: the digest of the founding server's whole model, as its model record
    will define it, the chunk manifest of its files included (so members fetch the founder's files
    and no other); None (an unpinned swarm, with a warning) when the server lacks some block's shard."""
    model = checked.model
    prints = model_fingerprints(model.model_dir, model.hf_config)
    if prints is None:
        log.warning("the new swarm is not pinned to its model: this server does not hold every block's weights")
        return None
    built = given_manifest(checked, whole=True)
    manifest = manifest_digest(built[1]) if built is not None else b""
    return model_digest(model_name(checked.config.model), len(prints), [bytes.fromhex(p) for p in prints], manifest)


def check_member(config: ServerConfig, swarm_id: str | None, key: bytes) -> None:
    """Refuse to start, in one line, a server whose certificate would not admit it to its swarm (or
    that has one for a public swarm)."""
    swarm = parse_swarm_id(swarm_id) if swarm_id is not None else None
    if swarm is None or not swarm.private:
        if config.member_cert is not None:
            raise UsageError("--member-cert is for private swarms; this swarm is public (its ticket names no owner)")
        return
    why = refusal(config.member_cert, public_key(key), swarm, time.time())
    if why is not None:
        raise UsageError(f"cannot take part: {why} (the identity key is --identity)")


async def start_endpoint(
    config: ServerConfig, key: bytes, start_node: StartNode, swarm: bool
) -> tuple[BaseNode, LoadingGate]:
    """The server's node (started by ``start_node``) and the gate it answers through (``swarm``:
    the swarm protocol too)."""
    gate = LoadingGate()
    node = await start_node(config.transport, gate.handlers(swarm), secret_key=key)
    node.credential = config.member_cert  # presented to every peer it dials (private swarms)
    return node, gate


def make_presence(
    checked: CheckedServer, node: BaseNode, key: bytes, swarm_id: str, gate: LoadingGate, compute: Executor
) -> Presence:
    """The server's part in swarm ``swarm_id``, answering the swarm protocol through ``gate`` from now
    on (join it next: :meth:`Presence.join`)."""
    presence = Presence(checked, node, key, swarm_id, gate, compute)
    gate.presence = presence
    return presence


def span_loader(
    checked: CheckedServer,
    node: BaseNode,
    key: bytes,
    compute: Executor,
    presence: Presence | None,
    prepare: Prepare | None = None,
) -> Loader:
    """Loads a span on the compute thread (its spans' judges judging in ``presence``'s swarm);
    ``prepare`` turns each server loaded into the one that serves."""

    async def load(span: BlockRange) -> BlockServer:
        loop = asyncio.get_running_loop()

        def fingerprints_known(fingerprints: list[str]) -> None:  # from the compute thread
            if presence is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone
                    loop.call_soon_threadsafe(presence.announce_span, span, fingerprints, State.JOINING)

        loader = functools.partial(
            load_block_server, checked, span, node, secret_key=key, executor=compute,
            jurisdiction=presence.jurisdiction if presence is not None else None, on_fingerprints=fingerprints_known,
        )  # fmt: skip
        server = await loop.run_in_executor(compute, loader)
        return prepare(server) if prepare is not None else server

    return load


async def come_online(
    checked: CheckedServer, gate: LoadingGate, presence: Presence | None, load: Loader, compute: Executor
) -> BlockServer:
    """Place the span (in a swarm, when none was given), load it into ``gate``, and announce it online."""
    span = checked.config.blocks
    if presence is not None and span is None:
        span = await presence.choose()
        fingerprints = presence.known_fingerprints(span)
        if fingerprints is not None:
            presence.announce_span(span, fingerprints, State.JOINING)
    server = gate.server = await load(span)
    if presence is not None:
        model = checked.model
        loop = asyncio.get_running_loop()
        announcement = presence.announcement
        prints = await loop.run_in_executor(compute, model_fingerprints, model.model_dir, model.hf_config)
        built = await loop.run_in_executor(compute, given_manifest, checked, bool(prints))
        if built is not None:
            announcement.model_manifest = manifest_digest(built[1])  # what its model record names (and pins)
            _warn_if_unpinned(announcement.swarm, announcement.model, prints, announcement.model_manifest)
            if checked.config.give_weights:
                gate.giver = await loop.run_in_executor(compute, make_giver, checked, compute, built)
                announcement.gives_weights = True
        announcement.model_fingerprints = prints  # set last: a model record is signed with its manifest
        presence.announce_online()
    return server


def _warn_if_unpinned(swarm_id: str, model: str, prints: list[str] | None, manifest: bytes) -> None:
    """Say so when this server's model record would not pass its swarm's pin: it still serves, but
    cannot stand in for the founder's record (e.g. another ``--weights-chunk``, other small files)."""
    if prints and (why := pin_refusal(parse_swarm_id(swarm_id), model, len(prints),
                                      tuple(bytes.fromhex(p) for p in prints), manifest)):  # fmt: skip
        log.warning("%s: this server's files differ from the founder's (chunk size, config or tokenizer "
                    "files), so it cannot republish the model record; it serves as usual", why)  # fmt: skip


def given_manifest(checked: CheckedServer, whole: bool) -> tuple[Manifest, bytes] | None:
    """The manifest (and its encoding) this server gives its files by: for weights fetched from the
    swarm, the swarm's, kept beside them; else, when the checkpoint is ``whole``, the one built from
    it (or read from beside it); None when neither."""
    model = checked.model
    built = fetched_manifest(Path(model.model_dir))
    if built is None and whole:
        built = cached_manifest(model.model_dir, model_name(checked.config.model), checked.config.weights_chunk)
    return built


def make_giver(checked: CheckedServer, compute: Executor, built: tuple[Manifest, bytes]) -> Giver:
    """What gives the model's weights to peers by the manifest ``built`` (:func:`given_manifest`):
    what was fetched, or every file of a whole checkpoint. Chunks are read on a thread of their own
    while the compute thread has no step to run (or a short wait is over), at most ``give_rate``
    bytes per second."""
    manifest, data = built
    busy = compute.busy if isinstance(compute, ComputeScheduler) else None
    return Giver(checked.model.model_dir, manifest, data, manifest_digest(data), checked.config.give_rate, busy=busy)


def load_block_server(
    checked: CheckedServer,
    span: BlockRange,
    node: BaseNode | None = None,
    *,
    secret_key: bytes | None = None,
    executor: Executor | None = None,
    jurisdiction: Jurisdiction | None = None,
    on_fingerprints: Callable[[list[str]], None] | None = None,
) -> BlockServer:
    """Load blocks ``span`` (and nothing else), one block at a time and each quantised as it comes
    (``quant``), and build the server of them, answering on ``node`` (None: a server that pushes
    nothing). ``on_fingerprints`` hears the span's fingerprints (of the checkpoint's tensors) once
    every block is read, before warm-up, so the server can announce itself as joining. Call it on
    ``executor``, the thread that will compute (see :func:`shoal.server.backend.compute_thread`).
    ``secret_key``: the node's, to sign receipts with; without it the server does not announce
    :data:`~shoal.wire.schema.RECEIPTS`. ``jurisdiction``: the swarm its judge judges in."""
    config, model = checked.config, checked.model
    signer = ReceiptSigner(secret_key) if secret_key is not None else None
    if signer is not None and node is not None and signer.peer_id != node.id:
        raise ValueError("the receipt key is not the node's: its receipts would not verify")
    started = time.perf_counter()
    check_blocks(span, model)
    model_dir = resolve_model(config.model, blocks=span, config=model.hf_config)  # from the Hub: the span's shards
    hf_config, start, end = model.hf_config, span.start, span.end
    built, prints = load_span(
        model_dir, start, end, config.dtype, config.device, config.quant, config=hf_config, gguf=config.gguf
    )
    fingerprints = [prints[i] for i in range(start, end)]
    if on_fingerprints is not None:
        on_fingerprints(fingerprints)
    adapters = load_adapters(built, config.adapters, hf_config) if config.adapters else None
    if config.packed_weights:  # after the adapters: the layers they wrap keep the plain layout
        packed = pack_linears(built)
        log.info("packed %d linear layers for oneDNN, used for batches from %s rows (quicker there on this CPU)",
                 packed, calibrate(built))  # fmt: skip
    info = SpanInfo(
        model=model_name(config.model),
        num_blocks=model.num_blocks,
        blocks=span,
        fingerprints=fingerprints,
        dtype=str(config.dtype).removeprefix("torch."),
        compute=announced_compute(str(config.dtype).removeprefix("torch."), config.device),
        hidden_size=hf_config.hidden_size,
        version=__version__,
        quantization=config.quant,
        adapters=adapters.infos() if adapters is not None else (),
        capabilities=CAPABILITIES if signer is not None else CAPABILITIES - {RECEIPTS, MIGRATE},  # no key: no chain
    )
    log.info(
        "loaded blocks %d:%d of %s (%s weights) in %.1f s", start, end, info.model,
        "full-precision" if config.quant is Quantization.NONE else config.quant, time.perf_counter() - started,
    )  # fmt: skip
    backend = SpanBackend(built, hf_config.hidden_size, config.device, executor, adapters,
                          max_batch=config.max_batch, prefill_chunk=config.prefill_chunk,
                          contended_cost=config.contended_cost, merge_wait=config.merge_wait)  # fmt: skip
    backend.warm_up()
    pool = built.allocate_pool(max(1, config.cache_tokens // config.page_size), config.page_size)
    counters = ServerCounters()
    judge = Judge(backend, info, counters, node.id if node is not None else "", jurisdiction)
    # only to online members of its swarm serving the next blocks, never to a liar convicted here
    pusher = Pusher(counters, node, info, jurisdiction.table if jurisdiction is not None else None, judge.convicted)
    budget = CacheBudget(pool, config.kv_overcommit)
    return BlockServer(backend, info, budget, counters, judge, pusher, config.transport.limits, signer,
                       config.share_counters)  # fmt: skip


def load_adapters(span: BlockSpan, adapters: tuple[tuple[str, Path], ...], hf_config):
    """The span's LoRA adapters (:class:`shoal.models.lora.SpanAdapters`): of each adapter, only the
    tensors of the span's blocks."""
    from shoal.models.lora import SpanAdapters, read_adapter

    loaded = SpanAdapters(span)
    for name, path in adapters:
        loaded.add(name, read_adapter(path, hf_config, span.start, span.end))
        log.info("adapter %s from %s", name, path)
    return loaded


__all__ = [
    "Prepare",
    "check_member",
    "come_online",
    "founding_pin",
    "given_manifest",
    "load_adapters",
    "load_block_server",
    "make_giver",
    "make_presence",
    "node_key",
    "span_loader",
    "start_endpoint",
    "swarm_id_of",
]
