"""Server lifecycle: join the network, choose and load a slice of a model, serve until told to stop.

Start-up is :mod:`shoal.server.builder`'s steps (the in-process harness takes the same ones); a
swarm presence (:mod:`shoal.server.presence`) places the span when ``--blocks`` is not given and
moves it when that clearly helps. On SIGINT/SIGTERM the server first publishes its ``offline``
record to every peer, then drains (open sessions move on), then closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

import torch

from shoal.server.announce import keep_measuring
from shoal.server.backend import compute_thread
from shoal.server.builder import (
    check_member,
    come_online,
    make_presence,
    node_key,
    span_loader,
    start_endpoint,
    swarm_id_of,
)
from shoal.server.config import ServerConfig
from shoal.server.preflight import CheckedModel, check_server
from shoal.server.presence import LoadingGate, Presence
from shoal.transport import BaseNode, Node, StartNode, Ticket

log = logging.getLogger(__name__)


async def serve(
    config: ServerConfig,
    on_ready: Callable[[Ticket], None] | None = None,
    stop: asyncio.Event | None = None,
    model: CheckedModel | None = None,
    start_node: StartNode = Node.start,
    beside: Callable[[Presence], Awaitable[None]] | None = None,
) -> None:
    """Join (or create) the swarm, load the blocks, serve until ``stop`` is set (none given: SIGINT/SIGTERM).
    The model and the span are checked first (:mod:`shoal.server.preflight`; ``model``: the model
    checked already, its config read), before anything binds. ``start_node``: iroh's (tests: an
    in-memory network's; a span hosted by a client, :mod:`shoal.server.hosted`: the client's);
    ``beside``: a task run with the swarm presence once online (the re-check across models of
    :mod:`shoal.server.roam`)."""
    checked = check_server(config, model)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    compute = compute_thread(config.num_threads)
    key = node_key(config)
    if stop is None:  # stopped by signals (a caller with its own ``stop``, e.g. a hosted span, stops it)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            # off the main thread (e.g. in a test's loop) there are none to add: uvloop says ValueError
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signum, stop.set)
    swarm_id = swarm_id_of(config, checked)  # the config requires --blocks outside a swarm
    check_member(config, swarm_id, key)
    node, gate = await start_endpoint(config, key, start_node, swarm=swarm_id is not None)
    tasks: list[asyncio.Task] = []
    metrics = None  # the Prometheus exporter (--metrics-port)
    try:
        if config.metrics_port is not None:
            from shoal.server.metrics import start_metrics

            metrics = start_metrics(
                config.metrics_host,
                config.metrics_port,
                lambda: gate.server,
                node,
                lambda: gate.presence.service.table if gate.presence is not None else None,
            )
        presence = None
        if swarm_id:
            presence = make_presence(checked, node, key, swarm_id, gate, compute)
            await presence.join()
        load = span_loader(checked, node, key, compute, presence)
        await come_online(checked, gate, presence, load, compute)
        if presence is not None:
            tasks.append(asyncio.create_task(keep_measuring(presence.announcement, config.gossip.refresh)))
            tasks.append(asyncio.create_task(presence.track_cache()))
            if config.placed_automatically and config.rebalance:
                tasks.append(asyncio.create_task(presence.keep_balanced(load)))
            if beside is not None:
                tasks.append(asyncio.create_task(beside(presence)))
        ticket = node.ticket(swarm_id)
        if config.ticket_file:
            config.ticket_file.write_text(f"{ticket}\n")
        if on_ready:
            on_ready(ticket)
        await _until(stop, tasks)
        log.info("shutting down")
    finally:
        await _shut_down(config, node, gate, tasks, compute)
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
    node: BaseNode,
    gate: LoadingGate,
    tasks: list[asyncio.Task],
    compute: Executor,
) -> None:
    """Offline first (every peer hears it at once), then drain open sessions, then close. From
    the first moment, replies tell clients to move on and new sessions are refused."""
    server, presence = gate.server, gate.presence
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
