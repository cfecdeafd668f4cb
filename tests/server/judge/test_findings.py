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

from shoal.launch.inprocess import LocalServer
from shoal.protocols import BLOCKS
from shoal.server.metrics import EVIDENCE_REASONS, ServerCollector
from shoal.server.push import Pusher
from shoal.verify.compare import first_disagreement, tolerance_for
from shoal.verify.state import EMPTY_STATE, states_of
from shoal.wire import Message
from shoal.wire.schema import (
    EVIDENCE,
    EvidenceRequest,
    OpenReply,
    OpenRequest,
    PushHop,
    Receipt,
    ServerCounters,
    StepReply,
    StepRequest,
)
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.server.judge.bench import FAULTS, FIRST_LIE, HIDDEN, SPAN, Court, counted, evidence_counts, still_serving

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]


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
            # all at the lowest priority: the checks (structure, then one task per 256 receipts), one task
            # per block of 2:4 recomputed (7 positions: one chunk each), the comparison
            assert judge.server.describe().counters.training_chunks - chunks == 1 + 1 + len(SPAN) + 1
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
    span = court.judges[0].server.info
    pusher = Pusher(counters, court.node, span, refuses={liar.node.id}.__contains__)  # its node: never used
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


async def _steps(court: Court, server: LocalServer, steps: list[tuple[int, Tensor]]) -> list[tuple[Receipt, Tensor]]:
    """One session on ``server`` running ``(position, hidden)`` steps as given (a position below the
    session's length rolls it back): their receipts and outputs."""
    stream = await court.node.open_stream(server.ticket, BLOCKS, timeout=5.0)
    opened = (await stream.request(Message("open", stream.next_id(), OpenRequest(max_length=32)))).reply(OpenReply)
    receipts = []
    for position, hidden in steps:
        tensors = [hidden, torch.arange(position, position + hidden.shape[1])[None]]
        request = StepRequest(session=opened.session, position=position, receipt=True)
        reply = await stream.request(Message("step", stream.next_id(), request, tensors), 10.0)
        receipts.append((reply.reply(StepReply).receipt, reply.tensors[0]))
    await stream.request(Message("close", stream.next_id()))
    return receipts


def test_receipts_after_a_rollback_state_the_cache_they_ran_on_and_stale_ones_frame_nobody(court):
    """An honest server runs [0, 4) on X, [0, 4) again on Y (rolled back), then [4, 5). Its receipt of
    [4, 5) states Y's chain, so joined to the receipt of X's prefill (both genuine) it is forged."""
    honest, judge = court.judges[0], court.judges[1]
    generator = torch.Generator().manual_seed(21)
    x, y, last = (torch.randn(1, n, HIDDEN, generator=generator) for n in (4, 4, 1))
    (r1, _), (r2, _), (r3, output) = court.run(_steps(court, honest, [(0, x), (0, y), (4, last)]))
    positions = torch.arange(5)[None]
    assert r1.state == r2.state == EMPTY_STATE and r1.compute == r3.compute == "f32/cpu"
    assert r3.state == states_of(y, positions[:, :4], None)[-16:] != states_of(x, positions[:, :4], None)[-16:]
    again, _ = court.run(_steps(court, honest, [(0, y), (4, last)]))[-1]  # the same cache again: the same state
    assert again.state == r3.state
    meta = EvidenceRequest(model=court.model, accused=honest.node.id, start=SPAN.start, end=SPAN.end, steps=2)
    before = evidence_counts(judge)
    stale = [packed([r1, r3]), output, torch.cat([x, last], 1), positions]
    reply = court.testify(judge, meta, stale)
    assert (reply.confirmed, reply.reason) == (False, "forged") and "position 4 ran on another cache" in reply.detail
    genuine = [packed([r2, r3]), output, torch.cat([y, last], 1), positions]  # what its cache held: judged
    reply = court.testify(judge, meta, genuine)
    assert (reply.confirmed, reply.reason) == (False, "framing"), reply
    assert counted(before, evidence_counts(judge)) == {"evidence_received": 2, "evidence_rejected": 2,
                                                       "evidence_forged": 1, "evidence_framing": 1}  # fmt: skip
    assert not judge.server.judge.convicted(honest.node.id)


def test_an_honest_bf16_server_is_not_convicted_by_an_fp32_judge(court):
    """A bf16 server answers fp32 inputs in fp32 (computed in bf16). An fp32 judge that went by the
    dtypes of the output and its own would see bf16 rounding as a lie; the signed compute says bf16."""
    accused = court.swarm.add(SPAN, dtype=torch.bfloat16)
    judge = court.judges[1]
    evidence = court.evidence(accused, seed=6)  # its true outputs, from position 6 on "disputed"
    receipts = msgspec.msgpack.decode(evidence.tensors[0].numpy().tobytes(), type=list[Receipt])
    assert {r.compute for r in receipts} == {"bf16/cpu"} and evidence.tensors[1].dtype == torch.float32
    hidden = evidence.tensors[2]
    recomputed = court.forward(judge, hidden)[:, FIRST_LIE:]  # the judge's fp32 computation of those rows
    assert first_disagreement(recomputed, evidence.tensors[1], tolerance_for(torch.float32)) is not None
    before = evidence_counts(judge)
    reply = court.testify(judge, evidence.meta, evidence.tensors)
    assert (reply.confirmed, reply.reason) == (False, "framing"), reply
    assert counted(before, evidence_counts(judge)) == {"evidence_received": 1, "evidence_rejected": 1,
                                                       "evidence_framing": 1}  # fmt: skip
    assert not judge.server.judge.convicted(accused.node.id)


def packed(receipts: list[Receipt]) -> Tensor:
    return torch.frombuffer(bytearray(msgspec.msgpack.encode(receipts)), dtype=torch.uint8)
