"""Judges of evidence (:mod:`shoal.server.judge`) on live in-process servers of a tiny llama (4 blocks).

A plain client node runs one session of positions 0:5, 5, 6, 7 with receipts on a server of blocks
2:4 (a liar from the fault seam, or an honest one), keeps its history as an audited session does,
and builds evidence from it (:func:`shoal.verify.evidence.build_evidence`). It goes to two honest
servers of 2:4 and to one of 0:4 (a superset: it judges its sub-span). Each finding is checked in the
reply and in the judges' counters, and every judge still serves correct forwards afterwards.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import Tensor

from shoal.client.history import SpanHistory
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.protocols import BLOCKS
from shoal.server.metrics import EVIDENCE_REASONS, ServerCollector
from shoal.server.push import Pusher
from shoal.transport.identity import generate_key
from shoal.verify.evidence import Evidence, build_evidence
from shoal.wire import Message
from shoal.wire.schema import (
    EVIDENCE,
    EvidenceReply,
    ForwardRequest,
    OpenReply,
    OpenRequest,
    PushHop,
    Receipt,
    ServerCounters,
    StepReply,
    StepRequest,
)
from testkit.faults import Noise, OtherWeights, SkipBlock, When, Zeros
from testkit.faulty import make_faulty
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]

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


@pytest.fixture(scope="module")
def court(tmp_path_factory):
    model_dir = save_checkpoint(tiny_model("llama", seed=5), tmp_path_factory.mktemp("tiny-judge"))
    with InProcessSwarm(model_dir, []) as swarm:
        court = Court(swarm)
        yield court
        court.run(court.node.close())


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


def test_servers_announce_evidence(court):
    assert all(EVIDENCE in judge.server.info.capabilities for judge in court.judges)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_lie_is_confirmed_by_every_judge_and_a_replay_is_not(court, fault):
    liar = court.liars[fault]
    evidence = court.evidence(liar)
    assert evidence.meta.steps == 3 and evidence.positions == 7  # receipts of 0:5, 5:6 and the disputed 6:7
    published: list = []
    court.judges[0].server.judge.publish_verdict = published.append
    court.judges[0].server.judge.swarm = "swarm-1"
    try:
        for judge in court.judges:
            before, chunks = evidence_counts(judge), judge.server.describe().counters.training_chunks
            reply = court.testify(judge, evidence.meta, evidence.tensors)
            assert reply.confirmed, reply
            # all at the lowest priority: the checks, one task per block of 2:4 recomputed, the comparison
            assert judge.server.describe().counters.training_chunks - chunks == 1 + len(SPAN) + 1
            assert reply.detail.startswith(f"wrong from position {FIRST_LIE} ")
            assert counted(before, evidence_counts(judge)) == {"evidence_received": 1, "evidence_confirmed": 1}
            assert judge.server.judge.convicted(liar.node.id)
        again = court.testify(court.judges[1], evidence.meta, evidence.tensors)
        assert (again.confirmed, again.reason) == (False, "replayed")
    finally:
        court.judges[0].server.judge.publish_verdict = None
    (verdict,) = published
    assert (verdict.swarm, verdict.judge, verdict.accused) == ("swarm-1", court.judges[0].node.id, liar.node.id)
    assert (verdict.model, verdict.blocks, len(verdict.evidence)) == (court.model, SPAN, 32)
    assert msgspec.msgpack.decode(verdict.receipt, type=Receipt).position == FIRST_LIE
    still_serving(court)


def test_forged_evidence_is_rejected(court):
    liar, judge = court.liars["noise"], court.judges[1]
    evidence = court.evidence(liar, seed=1)
    meta, tensors = evidence.meta, evidence.tensors
    before = evidence_counts(judge)
    framed = msgspec.structs.replace(meta, accused=court.judges[0].node.id)  # the liar's receipts, pinned on another
    reply = court.testify(judge, framed, tensors)
    assert (reply.confirmed, reply.reason) == (False, "forged") and "not signed by the accused" in reply.detail
    tampered = tensors[2].clone()
    tampered[0, 3, 0] += 0.01
    reply = court.testify(judge, meta, [tensors[0], tensors[1], tampered, tensors[3]])
    assert (reply.confirmed, reply.reason) == (False, "forged") and "inputs at position 0" in reply.detail
    expected = {"evidence_received": 2, "evidence_rejected": 2, "evidence_forged": 2}
    assert counted(before, evidence_counts(judge)) == expected
    reply = court.testify(judge, meta, tensors)  # forged copies never pre-empt the real evidence
    assert reply.confirmed, reply
    still_serving(court)


def test_an_honest_server_framed_is_not_convicted(court):
    honest, judge = court.judges[0], court.judges[1]
    evidence = court.evidence(honest, seed=2)  # its true outputs: the "lie" recomputes within tolerance
    before = evidence_counts(judge)
    reply = court.testify(judge, evidence.meta, evidence.tensors)
    assert (reply.confirmed, reply.reason) == (False, "framing"), reply
    lie = court.evidence(court.liars["zeros"], seed=2)  # the same inputs: the liar's wrong output
    reply = court.testify(judge, evidence.meta, [evidence.tensors[0], lie.tensors[1], *evidence.tensors[2:]])
    assert (reply.confirmed, reply.reason) == (False, "forged") and "output" in reply.detail
    expected = {"evidence_received": 2, "evidence_rejected": 2, "evidence_framing": 1, "evidence_forged": 1}
    assert counted(before, evidence_counts(judge)) == expected
    assert not judge.server.judge.convicted(honest.node.id)
    still_serving(court)


def test_evidence_about_the_judge_itself_or_while_draining_is_not_judged(court):
    liar = court.liars["skip-block"]
    evidence = court.evidence(liar, seed=3)
    before = evidence_counts(liar)
    reply = court.testify(liar, evidence.meta, evidence.tensors)  # the accused as its own judge
    assert (reply.confirmed, reply.reason, reply.detail) == (False, "not_judged", "about this server itself")
    assert counted(before, evidence_counts(liar)) == {"evidence_received": 1, "evidence_rejected": 1,
                                                      "evidence_not_judged": 1}  # fmt: skip
    judge = court.judges[2]
    judge.server.draining = True
    try:
        reply = court.testify(judge, evidence.meta, evidence.tensors)
    finally:
        judge.server.draining = False
    assert (reply.confirmed, reply.reason) == (False, "not_judged") and "draining" in reply.detail
    assert court.testify(judge, evidence.meta, evidence.tensors).confirmed  # judged once it serves again


def test_a_server_never_pushes_to_a_peer_it_convicted(court):
    """The push hand-off refuses a convicted next server before opening any stream to it: the step's
    reply says ``pushed=False`` and the client drives that hop itself."""
    liar = court.liars["noise"]
    counters = ServerCounters()
    pusher = Pusher(counters, refuses={liar.node.id}.__contains__)
    pusher.node = court.node  # never used: the target is refused first
    step = Message("step", 3, StepRequest(session="s", position=0), [torch.zeros(1, 1, HIDDEN), torch.zeros(1, 1)])
    route = (PushHop(ticket=str(liar.ticket), session="t", token="k"),)
    assert court.run(pusher.push(Message("result", 3, tensors=[torch.zeros(1, 1, HIDDEN)]), step, route)) is False
    assert (counters.pushes_failed, counters.pushes_sent) == (1, 0)
    assert court.judges[0].server.pusher.refuses == court.judges[0].server.judge.convicted


def test_evidence_counters_are_exported_to_prometheus(court):
    evidence = court.evidence(court.liars["other-weights"], seed=4)
    server = court.judges[1].server
    assert court.testify(court.judges[1], evidence.meta, evidence.tensors).confirmed
    assert court.testify(court.judges[1], evidence.meta, evidence.tensors).reason == "replayed"
    c = server.counters
    families = {family.name: family for family in ServerCollector(lambda: server).collect()}
    outcomes = {s.labels["outcome"]: s.value for s in families["shoal_evidence"].samples}
    assert outcomes == {"received": c.evidence_received, "confirmed": c.evidence_confirmed,
                        "rejected": c.evidence_rejected}  # fmt: skip
    reasons = {s.labels["reason"]: s.value for s in families["shoal_evidence_rejected_by_reason"].samples}
    assert reasons == {reason: getattr(c, f"evidence_{reason}") for reason in EVIDENCE_REASONS}
    assert reasons["replayed"] >= 1 and outcomes["confirmed"] >= 1
