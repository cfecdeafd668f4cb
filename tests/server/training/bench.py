"""What the server-side training tests share besides their fixtures (``conftest.py``): the setting's
sizes, raw typed requests to a server, and what a correct server answers (the same blocks run
locally, with local autograd)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LOOPBACK
from shoal.protocols import BLOCKS
from shoal.transport import MessageStream
from shoal.wire import Message
from shoal.wire.schema import BackwardRequest, ForwardRequest, InfoReply, OpenReply, OpenRequest
from tests.helpers.servers import Session

HIDDEN = 64
SPAN = (1, 3)
SEED = 1


def chunks(blocks: int, row_groups: int = 1) -> int:
    """Training chunks of one backward through ``blocks`` blocks: per group of rows a no-grad pass
    (every block but the last) and a gradient pass (every block), then one that joins the answer."""
    return row_groups * (2 * blocks - 1) + 1


def run(swarm: InProcessSwarm, coro_fn, timeout: float = 30.0):
    """Run ``coro_fn(node, ticket)`` on the swarm's loop with a fresh client node."""

    async def go():
        node = await swarm.network.start(LOOPBACK)
        try:
            return await coro_fn(node, swarm.servers[0].ticket)
        finally:
            await node.close()

    return swarm.runtime.run(go(), timeout)


# ---- what the server should answer ---------------------------------------------------------------
def padded_inputs(batch: int = 2, n: int = 6, seed: int = 0) -> list[torch.Tensor]:
    """``[hidden, position_ids, attention_mask]``, the first row left-padded by 2."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, n, HIDDEN, generator=generator)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[0, :2] = False
    position_ids = (mask.long().cumsum(1) - 1).clamp_min(0)
    return [hidden, position_ids, mask]


def random_prompts(blocks: int, batch: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(blocks, batch, n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def local_grads(span, tensors, grad_output, prompts=None, adapters=None, adapter=None) -> list[torch.Tensor]:
    """Local autograd of the same blocks: the gradients w.r.t. the hidden states (and prompts)."""
    hidden, position_ids, mask = tensors
    x = hidden.clone().requires_grad_()
    p = None if prompts is None else prompts.clone().requires_grad_()
    with adapters.active(adapter) if adapters is not None else nullcontext():
        out = span(x, position_ids, mask, prompts=p)
    return list(torch.autograd.grad(out, [x] if p is None else [x, p], grad_output))


@torch.inference_mode()
def local_out(span, tensors, cache=None, past_length=0, prompts=None, adapters=None, adapter=None):
    hidden, position_ids, *mask = tensors
    with adapters.active(adapter) if adapters is not None else nullcontext():
        return span(hidden, position_ids, mask[0] if mask else None, cache, past_length, prompts=prompts)


def assert_grad_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    bound = 1e-4 * expected.abs().max().item() + 1e-7
    assert (got - expected).abs().max().item() <= bound, ((got - expected).abs().max().item(), bound)


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


async def backward(target, tensors, prompts: bool = False, adapter: str | None = None) -> list[torch.Tensor]:
    """A backward request on ``target``: a stream, or a ``(node, ticket)`` pair."""
    message = Message("backward", 1, BackwardRequest(prompts=prompts, adapter=adapter), list(tensors))
    if isinstance(target, MessageStream):
        message.id = target.next_id()
        return (await target.request(message)).tensors
    node, ticket = target
    return (await node.request(ticket, BLOCKS, message)).tensors


async def forward(node, ticket, tensors, prompts: bool = False, adapter: str | None = None) -> torch.Tensor:
    message = Message("forward", 1, ForwardRequest(prompts=prompts, adapter=adapter), list(tensors))
    return (await node.request(ticket, BLOCKS, message)).tensors[0]


async def open_session(node, ticket, max_length: int, batch_size: int = 1, prompts=None, adapter=None) -> Session:
    stream = await node.open_stream(ticket, BLOCKS)
    meta = OpenRequest(max_length=max_length, batch_size=batch_size, prompts=prompts is not None, adapter=adapter)
    reply = await stream.request(Message("open", 1, meta, [] if prompts is None else [prompts]))
    return Session(stream, reply.reply(OpenReply))


async def info(node, ticket) -> InfoReply:
    return (await node.request(ticket, BLOCKS, Message("info", 1))).reply(InfoReply)
