"""What the receipt tests share besides their fixtures (``conftest.py``): inputs, the client steered
over chosen servers, and servers that are asked for receipts or not."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch
from torch import Tensor

from shoal.ids import BlockRange
from shoal.launch.inprocess import LocalServer, Prepare
from shoal.server.handler import BlockServer
from shoal.wire.schema import CAPABILITIES, RECEIPTS

A, B = BlockRange(0, 2), BlockRange(2, 4)
HIDDEN = 64
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])
MAX_RECEIPT_BYTES = 200


def hidden(total: int, seed: int = 3) -> Tensor:
    return torch.randn(1, total, HIDDEN, generator=torch.Generator().manual_seed(seed))


def assert_close(got: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.abs().max()))


def peer(server: LocalServer) -> str:
    return server.node.id


def prefer(model, preferred: Sequence[LocalServer], avoided: Sequence[LocalServer]) -> None:
    """Make ``preferred`` the cheapest servers of the next route (their steps seem free)."""
    latency = model.blocks.directory.latency
    for server in preferred:
        latency.observed_ms[peer(server)] = 0.0
    for server in avoided:
        latency.observed_ms[peer(server)] = 50.0


def feed(session, x: Tensor, prefill: int = 5) -> Tensor:
    outputs = [session.step(x[:, :prefill], torch.arange(prefill)[None], None)]
    for t in range(prefill, x.shape[1]):
        outputs.append(session.step(x[:, t : t + 1], torch.full((1, 1), t), None))
    return torch.cat(outputs, dim=1)


def asked_receipts(record: list[bool]) -> Prepare:
    """A server that notes, for every step it runs, whether the step asked for a receipt."""

    def prepare(server: BlockServer) -> BlockServer:
        step = server._step

        async def spy(session, message, **options):
            record.append(message.meta.receipt)
            return await step(session, message, **options)

        server._step = spy
        return server

    return prepare


def without_receipts(record: list[bool]) -> Prepare:
    """A server of an older version: it does not announce RECEIPTS."""

    def prepare(server: BlockServer) -> BlockServer:
        server = asked_receipts(record)(server)
        server.info = msgspec.structs.replace(server.info, capabilities=CAPABILITIES - {RECEIPTS})
        return server

    return prepare
