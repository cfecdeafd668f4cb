"""A span served inside a client's own process: ``from_pretrained(..., local_blocks="0:8")`` and
``shoal api MODEL --serve-blocks 0:8``, the gateway as a peer.

The span is a whole ``shoal serve`` (:func:`shoal.server.app.serve`, the same builder steps), run
as a task on the client's event loop: it has its own node and identity, joins the swarm of the
client's tickets, is announced like any server and serves other peers' sessions. The client's node
reaches it over in-process pipes (:meth:`~shoal.transport.BaseNode.add_local_peer`), so the client's
own requests to it make no network hop, yet carry the same messages and checks as any other hop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from shoal.ids import BlockRange
from shoal.server.app import serve
from shoal.server.config import ServerConfig
from shoal.transport import BaseNode, Node, StartNode, Ticket, TransportConfig

__all__ = ["CLOSE_TIMEOUT", "HostedSpan", "beside", "host_span", "hosted_config"]

CLOSE_TIMEOUT = 15.0  # seconds a hosted span gets to leave the swarm, drain and close


@dataclass
class HostedSpan:
    """A running span of this process: its node (for :meth:`~shoal.transport.BaseNode.add_local_peer`)
    and ticket, until :meth:`close`."""

    node: BaseNode
    ticket: Ticket
    task: asyncio.Task
    stop: asyncio.Event

    @property
    def peer_id(self) -> str:
        return self.node.id

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Leave as ``shoal serve`` does on SIGTERM (offline record, drain, close); idempotent."""
        self.stop.set()
        if self.task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except TimeoutError:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task


async def host_span(config: ServerConfig, start_node: StartNode = Node.start) -> HostedSpan:
    """Start serving ``config``'s span on this event loop; returns once it is online (its error if
    it could not start: the model, the span, the swarm refusing it)."""
    stop = asyncio.Event()
    ready: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
    started: list[BaseNode] = []

    async def start(*args, **kwargs) -> BaseNode:
        node = await start_node(*args, **kwargs)
        started.append(node)
        return node

    def on_ready(ticket: Ticket) -> None:
        if not ready.done():
            ready.set_result(ticket)

    task = asyncio.create_task(serve(config, on_ready=on_ready, stop=stop, start_node=start))
    try:
        await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        stop.set()
        task.cancel()
        raise
    if not ready.done():  # serve ended before it was online: its error
        task.result()
        raise RuntimeError("the hosted span stopped before it came online")
    return HostedSpan(started[0], ready.result(), task, stop)


def hosted_config(
    model: str,
    blocks: BlockRange,
    tickets: Sequence[Ticket],
    dtype: torch.dtype,
    device: str,
    transport: TransportConfig,
) -> ServerConfig:
    """The settings of a span a client hosts: ``shoal serve``'s defaults, the client's dtype,
    device and transport, joining the swarm its ``tickets`` name (standalone if none names one)."""
    return ServerConfig(
        model=model,
        blocks=blocks,
        dtype=dtype,
        device=device,
        transport=transport,
        join=tuple(t for t in tickets if t.swarm_id),
    )


def beside(transport: TransportConfig) -> TransportConfig:
    """The transport of the client whose span takes ``transport``: its bind address on any free port
    (the span's node takes the given one, which peers dial, and the announced addresses; the
    client's is only dialled out of)."""
    if transport.bind_addr is None:
        return replace(transport, announce_addrs=())
    host, _, _ = transport.bind_addr.rpartition(":")
    return replace(transport, bind_addr=f"{host}:0", announce_addrs=())
