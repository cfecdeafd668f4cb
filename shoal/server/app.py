"""Server lifecycle: load a slice of a model, join the network, serve until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shoal import __version__
from shoal.checkpoints import load_config, load_tensors, resolve_model, span_fingerprints, span_tensor_filter
from shoal.models import get_family
from shoal.protocols import BLOCKS
from shoal.server.backend import SpanBackend
from shoal.server.budget import CacheBudget
from shoal.server.config import ServerConfig
from shoal.server.handler import BlockServer, SpanInfo
from shoal.transport import Node, Ticket, load_or_create_identity

log = logging.getLogger(__name__)


def model_name(model: str) -> str:
    """The name a model goes by in the swarm: a directory's name, or the id as given."""
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def load_block_server(config: ServerConfig) -> BlockServer:
    """Load blocks ``[start, end)`` (and nothing else) and wrap them for serving."""
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
    backend = SpanBackend(span, hf_config.hidden_size, config.device)
    backend.warm_up()
    return BlockServer(
        backend, info, CacheBudget(config.cache_tokens), config.max_sessions_per_peer, config.session_idle_timeout
    )


async def serve(
    config: ServerConfig,
    on_ready: Callable[[Ticket], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set, or SIGINT/SIGTERM arrives."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    server = await asyncio.to_thread(load_block_server, config)
    key = load_or_create_identity(config.identity_file) if config.identity_file else None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    node = await Node.start(config.transport, {BLOCKS: server.handle}, secret_key=key)
    try:
        ticket = node.ticket()
        if config.ticket_file:
            config.ticket_file.write_text(f"{ticket}\n")
        if on_ready:
            on_ready(ticket)
        await stop.wait()
        log.info("shutting down")
    finally:
        await node.close()
        server.backend.shutdown()
