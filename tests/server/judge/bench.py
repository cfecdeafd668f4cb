"""What the judge tests share besides their fixture (``conftest.py``): the liars' faults, the
:class:`Court` of judges, liars and a client node that testifies, and the evidence counters."""

from __future__ import annotations

import torch
from torch import Tensor

from shoal.client.remote.history import SpanHistory
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.protocols import BLOCKS
from shoal.transport.identity import generate_key
from shoal.verify.evidence import Evidence, build_evidence
from shoal.wire import Message
from shoal.wire.schema import (
    EvidenceReply,
    ForwardRequest,
    OpenReply,
    OpenRequest,
    ServerCounters,
    StepReply,
    StepRequest,
)
from testkit.faults import Noise, OtherWeights, SkipBlock, When, Zeros
from testkit.faulty import make_faulty

SPAN = BlockRange(2, 4)
HIDDEN = 64
STEPS = ((0, 5), (5, 1), (6, 1), (7, 1))
FIRST_LIE = 6  # the liars lie from the third step (positions 6:7) on
LIE = When(first_step=2)
FAULTS = {
    "noise": Noise(0.1, seed=1, when=LIE),
    "zeros": Zeros(when=LIE),
    "skip-block": SkipBlock(3, when=LIE),
    "other-weights": OtherWeights(block=2, relative=0.5, seed=3, when=LIE),
}


class Court:
    """The servers, a client node, and what it takes to testify."""

    def __init__(self, swarm: InProcessSwarm):
        self.swarm = swarm
        self.judges = [swarm.add(SPAN), swarm.add(SPAN), swarm.add(BlockRange(0, 4))]
        self.liars = {name: swarm.add(SPAN, lambda s, f=fault: make_faulty(s, [f])) for name, fault in FAULTS.items()}
        self.node = swarm.runtime.run(swarm.start_node(swarm.transport, {}, secret_key=generate_key()))
        self.model = self.judges[0].server.info.model

    def run(self, coroutine, timeout: float = 30.0):
        return self.swarm.runtime.run(coroutine, timeout=timeout)

    def session(self, server: LocalServer, seed: int = 0) -> SpanHistory:
        return self.run(self._session(server, seed))

    async def _session(self, server: LocalServer, seed: int) -> SpanHistory:
        """A session on ``server`` (fresh random inputs from ``seed``), recorded as an audited one is."""
        total = max(start + n for start, n in STEPS)
        hidden = torch.randn(1, total, HIDDEN, generator=torch.Generator().manual_seed(seed))
        positions = torch.arange(total)[None]
        history = SpanHistory(1)
        stream = await self.node.open_stream(server.ticket, BLOCKS, timeout=5.0)
        opened = (await stream.request(Message("open", stream.next_id(), OpenRequest(max_length=32)))).reply(OpenReply)
        for start, n in STEPS:
            tensors = [hidden[:, start : start + n], positions[:, start : start + n]]
            request = StepRequest(session=opened.session, position=start, receipt=True)
            reply = await stream.request(Message("step", stream.next_id(), request, tensors), 10.0)
            receipt = reply.reply(StepReply).receipt
            history.record({SPAN.start: tensors[0], SPAN.end: reply.tensors[0]}, {SPAN.start, SPAN.end},
                           tensors[1], None, start + n, {SPAN.start: receipt})  # fmt: skip
        await stream.request(Message("close", stream.next_id()))
        return history

    def evidence(self, server: LocalServer, position: int = FIRST_LIE, seed: int = 0) -> Evidence:
        return build_evidence(self.model, SPAN, server.node.id, position, self.session(server, seed))

    def testify(self, judge: LocalServer, meta, tensors: list[Tensor]) -> EvidenceReply:
        message = Message("evidence", 1, meta, tensors)
        return self.run(self.node.request(judge.ticket, BLOCKS, message, timeout=30.0)).reply(EvidenceReply)

    def forward(self, server: LocalServer, hidden: Tensor) -> Tensor:
        message = Message("forward", 1, ForwardRequest(), [hidden, torch.arange(hidden.shape[1])[None]])
        reply = self.run(self.node.request(server.ticket, BLOCKS, message, timeout=10.0))
        return reply.tensors[0]


def evidence_counts(server: LocalServer) -> dict[str, int]:
    counters = server.server.counters
    return {name: getattr(counters, name) for name in ServerCounters.__struct_fields__ if name.startswith("evidence_")}


def counted(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The evidence counters that moved, and by how much."""
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


def still_serving(court: Court) -> None:
    """Every judge answers forwards, and they agree (the sub-span of 0:4 aside: it runs all 4 blocks)."""
    hidden = torch.randn(1, 6, HIDDEN, generator=torch.Generator().manual_seed(11))
    first, second, superset = (court.forward(judge, hidden) for judge in court.judges)
    torch.testing.assert_close(first, second, rtol=0, atol=1e-4 * float(first.abs().max()))
    assert superset.shape == hidden.shape
