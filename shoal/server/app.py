"""Server lifecycle: load a slice of a model, join the network, serve until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from shoal import __version__
from shoal.checkpoints import (
    load_config,
    load_tensors,
    model_fingerprints,
    model_name,
    resolve_model,
    span_fingerprints,
    span_tensor_filter,
)
from shoal.models import get_family
from shoal.protocols import BLOCKS
from shoal.server.announce import Announcement, keep_measuring
from shoal.server.backend import SpanBackend, compute_thread
from shoal.server.budget import CacheBudget
from shoal.server.config import ServerConfig
from shoal.server.handler import BlockServer, SpanInfo
from shoal.swarm.records import State
from shoal.swarm.service import SWARM, SwarmService
from shoal.swarm.table import RecordTable
from shoal.transport import Node, Ticket, load_or_create_identity
from shoal.transport.identity import generate_key
from shoal.wire import error_message

log = logging.getLogger(__name__)


def load_block_server(
    config: ServerConfig,
    on_fingerprints: Callable[[list[str]], None] | None = None,
    executor: ThreadPoolExecutor | None = None,
) -> BlockServer:
    """Load blocks ``[start, end)`` (and nothing else) and wrap them for serving.
    ``on_fingerprints`` hears the span's fingerprints as soon as they are known (before the
    blocks are built and warmed up), so the server can announce itself as joining. Call it on
    ``executor``, the thread that will compute (see :func:`shoal.server.backend.compute_thread`)."""
    started = time.perf_counter()
    model_dir = resolve_model(config.model, blocks=config.blocks)
    hf_config = load_config(model_dir)
    family = get_family(hf_config)
    total = family.num_blocks(hf_config)
    start, end = config.blocks
    if end > total:
        raise ValueError(f"--blocks {start}:{end} is outside the model's {total} blocks")
    tensors = load_tensors(model_dir, span_tensor_filter(hf_config, start, end))
    fingerprints = span_fingerprints(hf_config, start, end, tensors)
    if on_fingerprints is not None:
        on_fingerprints([fingerprints[i] for i in range(start, end)])
    span = family.build_span(hf_config, start, end, tensors, config.dtype, config.device)
    del tensors
    info = SpanInfo(
        model=model_name(config.model),
        num_blocks=total,
        start=start,
        end=end,
        fingerprints=[fingerprints[i] for i in range(start, end)],
        dtype=str(config.dtype).removeprefix("torch."),
        hidden_size=hf_config.hidden_size,
        version=__version__,
    )
    log.info("loaded blocks %d:%d of %s in %.1f s", start, end, info.model, time.perf_counter() - started)
    backend = SpanBackend(span, hf_config.hidden_size, config.device, executor)
    backend.warm_up()
    return BlockServer(
        backend, info, CacheBudget(config.cache_tokens), config.max_sessions_per_peer, config.session_idle_timeout
    )


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
    """Answers ``busy`` on the blocks protocol until the weights are loaded."""

    def __init__(self) -> None:
        self.server: BlockServer | None = None

    async def handle(self, stream, peer_id: str) -> None:
        if self.server is None:
            request = await stream.recv(5.0)
            await stream.send(error_message(request.id, "busy", "server is still loading its blocks"))
            return
        await self.server.handle(stream, peer_id)


async def serve(
    config: ServerConfig,
    on_ready: Callable[[Ticket], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Join (or create) the swarm, load the blocks, serve until ``stop`` is set or SIGINT/SIGTERM."""
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
    gate = _LoadingGate()
    handlers = {BLOCKS: gate.handle}
    service: SwarmService | None = None
    if swarm_id:
        handlers[SWARM] = lambda stream, peer: service.handle(stream, peer)
    node = await Node.start(config.transport, handlers, secret_key=key)
    tasks: list[asyncio.Task] = []
    announcement = None
    try:
        if swarm_id:
            model_dir = resolve_model(config.model, blocks=config.blocks)
            announcement = Announcement(
                node, key, swarm_id, model_name(config.model), *config.blocks, fingerprints=[],
                throughput=config.throughput, gossip=config.gossip,
            )  # fmt: skip
            table = RecordTable(swarm_id, max_lifetime=max(3600.0, 2 * config.gossip.expiry))
            service = SwarmService(node, table, config.gossip, list(config.join), announcement.records)
            announcement.service = service
            await service.join()
            service.start()

        def announce_joining(fingerprints: list[str]) -> None:  # on the loop, from the loading thread
            if announcement is not None:
                announcement.fingerprints = fingerprints
                service.publish(announcement.server_record(time.time()))  # state: joining

        def fingerprints_known(fingerprints: list[str]) -> None:
            loop.call_soon_threadsafe(announce_joining, fingerprints)

        load = functools.partial(load_block_server, config, fingerprints_known, compute)
        gate.server = server = await loop.run_in_executor(compute, load)
        server.attach(node)
        server.reply_delay = config.test_reply_delay
        if announcement is not None:
            announcement.fingerprints = server.info.fingerprints
            announcement.model_fingerprints = await loop.run_in_executor(compute, model_fingerprints, model_dir)
            announcement.cache_tokens_free = server.budget.free_tokens
            announcement.state = State.ONLINE
            service.publish(announcement.server_record(time.time()))
            for signed in announcement.records():
                service.publish(signed)
            tasks.append(asyncio.create_task(keep_measuring(announcement, config.gossip.refresh)))
            tasks.append(asyncio.create_task(_track_cache(announcement, server, config.gossip.period)))
        ticket = node.ticket(swarm_id)
        if config.ticket_file:
            config.ticket_file.write_text(f"{ticket}\n")
        if on_ready:
            on_ready(ticket)
        await stop.wait()
        log.info("shutting down")
    finally:
        for task in tasks:
            task.cancel()
        if service is not None and announcement is not None:
            await service.stop()
            if announcement.fingerprints:  # announced at all (see Announcement.records)
                await service.announce_to_all(announcement.set_state(State.OFFLINE))
        await node.close()
        if gate.server is not None:
            gate.server.backend.shutdown()
        compute.shutdown(wait=False, cancel_futures=True)


async def _track_cache(announcement: Announcement, server: BlockServer, period: float) -> None:
    """Free cache changes with sessions: republish early when it moved by more than 10%."""
    while True:
        await asyncio.sleep(period)
        free = server.budget.free_tokens
        if abs(free - announcement.cache_tokens_free) > 0.1 * server.budget.capacity_tokens:
            announcement.cache_tokens_free = free
            announcement.service.publish(announcement.server_record(time.time()))
