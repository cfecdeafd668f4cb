"""Server lifecycle: join the network, choose and load a slice of a model, serve until told to stop.

With ``--blocks`` the span is fixed. Without it (in a swarm only), the server measures its throughput
(:mod:`shoal.server.throughput`), reads the swarm's table, chooses the span that best fills the
weakest part of the swarm's coverage (:mod:`shoal.server.placement`), and every ``balance_period``
re-checks whether moving would clearly help; a move announces the new span as ``joining``, drains the
old span, loads the new one and announces it ``online``. On SIGINT/SIGTERM the server first publishes
its ``offline`` record to every peer, then drains (open sessions move on), then closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path

import torch

from shoal import __version__
from shoal.checkpoints import load_config, load_span, model_fingerprints, model_name, resolve_model
from shoal.ids import BlockRange
from shoal.models import BlockSpan, get_family
from shoal.models.packed import calibrate, pack_linears
from shoal.protocols import BLOCKS
from shoal.quantization import Quantization
from shoal.server.announce import Announcement, keep_measuring
from shoal.server.backend import SpanBackend, compute_thread
from shoal.server.budget import CacheBudget
from shoal.server.config import ServerConfig
from shoal.server.handler import BlockServer
from shoal.server.placement import Balance, Placed, choose_span, plan_move
from shoal.server.preflight import CheckedModel, check_blocks, check_model, check_quantization
from shoal.server.throughput import announced_throughput, cached_compute, default_num_blocks, measure_network
from shoal.swarm.records import State
from shoal.swarm.service import SWARM, SwarmService
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import VerdictKeeper
from shoal.transport import Node, Ticket, load_or_create_identity
from shoal.transport.identity import generate_key
from shoal.verify.receipts import ReceiptSigner
from shoal.wire import error_message
from shoal.wire.schema import CAPABILITIES, RECEIPTS, SpanInfo

log = logging.getLogger(__name__)
MAX_DEFERRALS = 3  # re-checks in a row a server leaves a move to another one
Loader = Callable[[BlockRange], Awaitable[BlockServer]]  # loads a span on the compute thread


def load_block_server(
    config: ServerConfig,
    span: BlockRange,
    on_fingerprints: Callable[[list[str]], None] | None = None,
    executor: Executor | None = None,
    secret_key: bytes | None = None,
) -> BlockServer:
    """Load blocks ``span`` (and nothing else), one block at a time and each quantised as it comes
    (``config.quant``), and wrap them for serving. ``on_fingerprints`` hears the span's fingerprints
    (of the checkpoint's tensors) once every block is read, before warm-up, so the server can
    announce itself as joining. Call it on ``executor``, the thread that will compute (see
    :func:`shoal.server.backend.compute_thread`). ``secret_key``: the node's, to sign receipts
    with; without it the server does not announce :data:`~shoal.wire.schema.RECEIPTS`."""
    started = time.perf_counter()
    model_dir = resolve_model(config.model, blocks=span)
    hf_config = load_config(model_dir)
    total = get_family(hf_config).num_blocks(hf_config)
    start, end = span.start, span.end
    check_blocks(span, CheckedModel(model_dir, hf_config.model_type, total))
    built, prints = load_span(model_dir, start, end, config.dtype, config.device, config.quant)
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
        num_blocks=total,
        blocks=span,
        fingerprints=fingerprints,
        dtype=str(config.dtype).removeprefix("torch."),
        hidden_size=hf_config.hidden_size,
        version=__version__,
        quantization=config.quant,
        adapters=adapters.infos() if adapters is not None else (),
        capabilities=CAPABILITIES if secret_key is not None else CAPABILITIES - {RECEIPTS},
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
    signer = ReceiptSigner(secret_key) if secret_key is not None else None
    return BlockServer(
        backend, info, CacheBudget(pool, config.kv_overcommit), config.max_sessions_per_peer,
        config.session_idle_timeout, signer,
    )  # fmt: skip


def load_adapters(span: BlockSpan, adapters: tuple[tuple[str, Path], ...], hf_config):
    """The span's LoRA adapters (:class:`shoal.models.lora.SpanAdapters`): of each adapter, only the
    tensors of the span's blocks."""
    from shoal.models.lora import SpanAdapters, read_adapter

    loaded = SpanAdapters(span)
    for name, path in adapters:
        loaded.add(name, read_adapter(path, hf_config, span.start, span.end))
        log.info("adapter %s from %s", name, path)
    return loaded


def swarm_id_of(config: ServerConfig) -> str | None:
    if config.new_swarm and config.join:
        raise ValueError("--new-swarm and --join exclude each other")
    if config.new_swarm:
        return secrets.token_hex(8)
    if not config.join:
        return None
    ids = {t.swarm_id for t in config.join}
    if None in ids or len(ids) != 1:
        raise ValueError("every --join ticket must carry the same swarm id (use a ticket printed by a swarm member)")
    return ids.pop()


class _LoadingGate:
    """Answers ``busy`` on the blocks protocol while no span is loaded (starting, or moving)."""

    def __init__(self) -> None:
        self.server: BlockServer | None = None

    async def handle(self, stream, peer_id: str) -> None:
        server = self.server
        if server is None:
            request = await stream.recv(5.0)
            await stream.send(error_message(request.id, "busy", "server is still loading its blocks"))
            return
        await server.handle(stream, peer_id)


class _Presence:
    """A server's part in a swarm: its announcement, its measurement, where it sits, its moves."""

    def __init__(self, config: ServerConfig, node: Node, key: bytes, swarm_id: str, gate: _LoadingGate, compute):
        self.config, self.node, self.gate, self.compute = config, node, gate, compute
        self.model_dir = resolve_model(config.model, blocks=config.blocks, metadata_only=config.blocks is None)
        self.hf_config = load_config(self.model_dir)
        self.total = get_family(self.hf_config).num_blocks(self.hf_config)
        self.model = model_name(config.model)
        self.rng = random.Random()
        self.leaving = False
        blocks = config.blocks or BlockRange(0, 1)  # until placed: nothing is announced without fingerprints
        self.announcement = Announcement(
            node, key, swarm_id, self.model, blocks, fingerprints=[], throughput=0.0, gossip=config.gossip,
            quantization=config.quant,
        )  # fmt: skip
        table = RecordTable(swarm_id, max_lifetime=max(3600.0, 2 * config.gossip.expiry))
        self.service = SwarmService(node, table, config.gossip, list(config.join), self.own_records)
        self.announcement.service = self.service
        self.verdicts = VerdictKeeper(key, self.service.publish)  # kept a day, even while the accused is away
        self.publish_verdict = self.verdicts.add  # the judge's sink: signed, gossiped, re-signed while online

    def own_records(self) -> list:
        """Due for (re)publication: the server's records, and its verdicts until it leaves."""
        return [*self.announcement.records(), *([] if self.leaving else self.verdicts.due())]

    @property
    def announced(self) -> bool:
        a = self.announcement
        return bool(a.fingerprints) and len(a.fingerprints) == len(a.blocks)

    def publish(self) -> None:
        self.service.publish(self.announcement.server_record(time.time()))

    def announce_span(self, span: BlockRange, fingerprints: list[str], state: State) -> None:
        if self.leaving:  # e.g. a load still running on the compute thread at shutdown
            return
        a = self.announcement
        a.blocks = span
        a.fingerprints, a.state = fingerprints, state
        self.publish()

    def known_fingerprints(self, span: BlockRange) -> list[str] | None:
        """The span's fingerprints from the swarm's model record (None without one)."""
        record = self.service.table.model(self.model)
        if record is None or record.num_blocks != self.total:
            return None
        return [record.fingerprints[i].hex() for i in span.blocks()]

    # ---- measuring -------------------------------------------------------------------------
    async def measure(self) -> None:
        """Fill the announcement's throughput and step_ms: given, or measured (cached)."""
        a, config = self.announcement, self.config
        if config.throughput is not None:
            a.throughput = config.throughput
            a.step_ms = 1000.0 / config.throughput if config.throughput > 0 else 0.0
            return
        loop = asyncio.get_running_loop()
        measure = functools.partial(cached_compute, quantization=config.quant)
        compute, cached = await loop.run_in_executor(self.compute, measure, self.hf_config, config.dtype, config.device)
        network = None
        peers = [t for t in config.join if t.peer_id != self.node.id]
        if peers:
            network = await measure_network(self.node, peers[0])
        a.throughput = round(announced_throughput(compute, network, self.hf_config.hidden_size), 3)
        a.step_ms = round(compute.step_ms, 4)
        log.info(
            "throughput %.1f tokens/s per block (%s: step %.3f ms, prefill %.0f tokens/s; network %s)",
            a.throughput, "cached" if cached else "measured", compute.step_ms, compute.prefill_tokens_per_s,
            "not measured" if network is None else f"{network / 2**20:.0f} MiB/s",
        )  # fmt: skip

    # ---- placement -------------------------------------------------------------------------
    def placed(self) -> list[Placed]:
        """Online and joining servers of this model in the table."""
        now = time.time()
        return [
            Placed(r.peer, r.blocks, r.throughput)
            for r in self.service.table.servers(self.model)
            if r.expires > now and r.state is not State.OFFLINE
        ]

    async def choose(self) -> BlockRange:
        config = self.config
        n = config.num_blocks
        if n is None:
            n = default_num_blocks(
                self.hf_config,
                config.dtype,
                config.device,
                config.cache_tokens,
                quantization=config.quant,
                packed=config.packed_weights,
            )
        n = min(n, self.total)
        if not config.new_swarm:  # let servers starting at the same time see each other's choices
            await asyncio.sleep(config.gossip.period * self.rng.uniform(1.0, 2.0))
        others = [p for p in self.placed() if p.peer != self.node.id]
        span = choose_span(others, self.total, n, self.announcement.throughput, self.rng)
        log.info("placed at blocks %s of %d (%d servers in the swarm)", span, self.total, len(others))
        return span

    async def keep_balanced(self, load: Loader) -> None:
        """Every ``balance_period`` (+-20%): move when :func:`plan_move` says it clearly helps. A
        server that defers to another one (which should move first) does so ``MAX_DEFERRALS`` checks
        in a row at most: that one may never move (started with ``--blocks``)."""
        deferred = 0
        while True:
            await asyncio.sleep(self.config.balance_period * self.rng.uniform(0.8, 1.2))
            plan = plan_move(
                self.placed(), self.total, self.node.id, self.rng, self.config.balance_margin,
                defer=deferred < MAX_DEFERRALS,
            )  # fmt: skip
            if plan.defer_to is not None:
                deferred += 1
                log.debug("placement: leaving the next move to %s", plan.defer_to[:10])
                continue
            deferred = 0
            move = plan.move
            if move is None:
                continue
            a = self.announcement
            log.info(
                "moving from blocks %s to %s: swarm %s -> %s%s", a.blocks, move.blocks,
                _describe(move.before), _describe(move.after),
                f" (expected {_describe(move.expected)} once others follow)" if move.neutral else "",
            )  # fmt: skip
            await self.move(move.blocks, load)

    async def move(self, span: BlockRange, load: Loader) -> None:
        fingerprints = self.known_fingerprints(span)
        if fingerprints is not None:
            self.announce_span(span, fingerprints, State.JOINING)
        old = self.gate.server
        if old is not None:
            await old.drain(self.config.drain_timeout)
        self.gate.server = None  # new requests get "busy" until the new span is loaded
        del old  # its weights and caches go (the compute thread stays: it is shared)
        self.gate.server = await load(span)
        self.announce_online()

    def announce_online(self) -> None:
        server = self.gate.server
        if (judge := getattr(server, "judge", None)) is not None:  # every span served judges into our verdicts
            judge.publish_verdict, judge.swarm = self.publish_verdict, self.service.table.swarm
            judge.table = self.service.table  # and judges only servers the swarm lists
        self.announcement.cache_tokens_free = server.budget.free_tokens
        self.announcement.adapters = tuple((a.name, a.digest) for a in server.info.adapters)
        self.announce_span(server.info.blocks, server.info.fingerprints, State.ONLINE)
        for signed in self.announcement.records():
            self.service.publish(signed)

    async def track_cache(self) -> None:
        """Free cache changes with sessions: republish early when it moved by more than 10%."""
        a = self.announcement
        while True:
            await asyncio.sleep(self.config.gossip.period)
            server = self.gate.server
            if server is None or a.state is not State.ONLINE:
                continue
            free = server.budget.free_tokens
            if abs(free - a.cache_tokens_free) > 0.1 * server.budget.capacity_tokens:
                a.cache_tokens_free = free
                self.publish()

    async def leave(self) -> None:
        """Publish the offline record to every peer at once (before draining)."""
        self.leaving = True
        if self.announced:
            await self.service.announce_to_all(self.announcement.set_state(State.OFFLINE))


def _describe(balance: Balance) -> str:
    if balance.uncovered:
        return f"{balance.uncovered} uncovered blocks"
    return f"bottleneck {balance.bottleneck:.3g} tokens/s"


async def serve(
    config: ServerConfig,
    on_ready: Callable[[Ticket], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Join (or create) the swarm, load the blocks, serve until ``stop`` is set or SIGINT/SIGTERM.
    The model and the span are checked first (:mod:`shoal.server.preflight`), before anything binds."""
    model = check_model(config.model)
    check_blocks(config.blocks, model)
    check_quantization(config.quant, model)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    compute = compute_thread(config.num_threads)
    key = load_or_create_identity(config.identity_file) if config.identity_file else generate_key()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    swarm_id = swarm_id_of(config)
    if config.blocks is None and swarm_id is None:
        raise ValueError("--blocks START:END is required outside a swarm (--new-swarm or --join TICKET)")
    gate = _LoadingGate()
    handlers = {BLOCKS: gate.handle}
    presence: _Presence | None = None
    if swarm_id:
        handlers[SWARM] = lambda stream, peer: presence.service.handle(stream, peer)
    node = await Node.start(config.transport, handlers, secret_key=key)
    tasks: list[asyncio.Task] = []
    metrics = None  # the Prometheus exporter (--metrics-port)

    async def load(span: BlockRange) -> BlockServer:
        def fingerprints_known(fingerprints: list[str]) -> None:  # from the compute thread
            if presence is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone
                    loop.call_soon_threadsafe(presence.announce_span, span, fingerprints, State.JOINING)

        loader = functools.partial(load_block_server, secret_key=key)  # receipts are signed with the node key
        server = await loop.run_in_executor(compute, loader, config, span, fingerprints_known, compute)
        server.attach(node)
        return server

    try:
        if config.metrics_port is not None:
            from shoal.server.metrics import start_metrics

            metrics = start_metrics(
                config.metrics_host,
                config.metrics_port,
                lambda: gate.server,
                node,
                lambda: presence.service.table if presence is not None else None,
            )
        span = config.blocks
        if swarm_id:
            presence = _Presence(config, node, key, swarm_id, gate, compute)
            await presence.service.join()
            presence.service.start()
            await presence.measure()
            if span is None:
                span = await presence.choose()
                fingerprints = presence.known_fingerprints(span)
                if fingerprints is not None:
                    presence.announce_span(span, fingerprints, State.JOINING)
        gate.server = await load(span)
        if presence is not None:
            presence.announcement.model_fingerprints = await loop.run_in_executor(
                compute, model_fingerprints, presence.model_dir
            )
            presence.announce_online()
            tasks.append(asyncio.create_task(keep_measuring(presence.announcement, config.gossip.refresh)))
            tasks.append(asyncio.create_task(presence.track_cache()))
            if config.placed_automatically and config.rebalance:
                tasks.append(asyncio.create_task(presence.keep_balanced(load)))
        ticket = node.ticket(swarm_id)
        if config.ticket_file:
            config.ticket_file.write_text(f"{ticket}\n")
        if on_ready:
            on_ready(ticket)
        await _until(stop, tasks)
        log.info("shutting down")
    finally:
        await _shut_down(config, node, gate, presence, tasks, compute)
        if metrics is not None:
            metrics.close()


async def _until(stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    """Wait for ``stop``; a background task that fails (e.g. a move that could not load) ends the
    server with its error."""
    stopped = asyncio.create_task(stop.wait())
    try:
        while True:
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            if stopped in done:
                return
            for task in done:
                tasks.remove(task)
                task.result()  # raises its error; a task that simply ended is dropped
    finally:
        stopped.cancel()


async def _shut_down(
    config: ServerConfig,
    node: Node,
    gate: _LoadingGate,
    presence: _Presence | None,
    tasks: list[asyncio.Task],
    compute: Executor,
) -> None:
    """Offline first (every peer hears it at once), then drain open sessions, then close. From
    the first moment, replies tell clients to move on and new sessions are refused."""
    server = gate.server
    if server is not None:
        server.draining = True
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if presence is not None:
        await presence.leave()
    if server is not None:
        await server.drain(config.drain_timeout)
    if presence is not None:
        await presence.service.stop()
    await node.close()
    if server is not None:
        server.backend.shutdown()
    compute.shutdown(wait=False, cancel_futures=True)
