"""What the blocks protocol handler's tests share besides their fixtures (``conftest.py``): the
setting's sizes, the :class:`Bench` of servers and client nodes, and the checks of a correct answer."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import torch

from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LOOPBACK
from shoal.transport import BaseNode, Ticket
from shoal.wire.schema import InfoReply
from tests.helpers.servers import Session, forward, info, inputs, local_forward

HIDDEN = 64


SPAN = (1, 3)


CACHE_TOKENS = 256


PER_PEER = 3


IDLE = 0.3  # the idle timeout of the tests that wait for one (seconds)


class Bench:
    """Servers in this process and client nodes of their network; coroutines run on their loop."""

    def __init__(self, swarm: InProcessSwarm):
        self.swarm = swarm
        self.nodes: list[BaseNode] = []

    def ticket(self, index: int = 0) -> Ticket:
        return self.swarm.servers[index].ticket

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        return self.swarm.runtime.run(coro, timeout)

    async def client(self) -> BaseNode:
        """A new client node (its own peer id)."""
        node = await self.swarm.network.start(LOOPBACK)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        async def close_nodes() -> None:
            for node in self.nodes:
                await node.close()

        self.run(close_nodes())
        self.swarm.close()


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def assert_sessions_add_up(reply: InfoReply) -> None:
    """Every session opened has ended exactly one way, or is still active."""
    c = reply.counters
    ended = c.sessions_closed + c.sessions_abandoned + c.sessions_timed_out
    assert c.sessions_opened == ended + c.sessions_active, c


async def assert_serving(node: BaseNode, ticket: Ticket, span, seed: int = 100) -> None:
    """A stateless forward and a two-step session on ``ticket`` equal the local blocks' results;
    the session it opens is closed again, and the session counters add up."""
    x = inputs(HIDDEN, 5, seed=seed, mask=True)
    assert_same(await forward(node, ticket, x), local_forward(span, x))
    session = await Session.open(node, ticket, max_length=8)
    try:
        cache = span.allocate_cache(1, 8)
        prefill, step = inputs(HIDDEN, 3, seed=seed + 1), inputs(HIDDEN, 1, start=3, seed=seed + 2)
        assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))
        assert_same(await session.step(3, step), local_forward(span, step, cache, 3))
    finally:
        await session.close()
    assert_sessions_add_up(await info(node, ticket))
