"""Judges of evidence (:mod:`shoal.server.judge`) on live in-process servers of a tiny llama (4 blocks).

A plain client node runs one session of positions 0:5, 5, 6, 7 with receipts on a server of blocks
2:4 (a liar from the fault seam, or an honest one), keeps its history as an audited session does,
and builds evidence from it (:func:`shoal.verify.evidence.build_evidence`). It goes to two honest
servers of 2:4 and to one of 0:4 (a superset: it judges its sub-span). Each finding is checked in the
reply and in the judges' counters, and every judge still serves correct forwards afterwards.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgspec
import pytest
import torch
from torch import Tensor

from shoal.checkpoints import load_span
from shoal.client.remote.history import SpanHistory
from shoal.ids import BlockRange, PeerId
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.protocols import BLOCKS
from shoal.server import backend as backend_module
from shoal.server import judge as judge_module
from shoal.server.backend import SpanBackend, compute_thread
from shoal.server.judge import MAX_FORGERIES, MAX_WAITING, Judge
from shoal.server.metrics import EVIDENCE_REASONS, ServerCollector
from shoal.server.push import Pusher
from shoal.server.scheduler import Priority
from shoal.swarm.records import State
from shoal.transport.identity import generate_key
from shoal.verify.compare import first_disagreement, tolerance_for
from shoal.verify.evidence import Evidence, Reason, Rejected, build_evidence
from shoal.verify.receipts import LIAR_BAN_SECONDS
from shoal.verify.state import EMPTY_STATE, states_of
from shoal.wire import Message
from shoal.wire.schema import (
    EVIDENCE,
    EvidenceReply,
    EvidenceRequest,
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
from tests.helpers.registry import server_record

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


# ---- receipts that commit to the cache state and to how the server computed (review findings 3, 5) ----


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


# ---- a judge that cannot be abused (work, memory, errors), and a recompute in short tasks ------------


class Listing:
    """A swarm table as the judge reads it (:meth:`clock`, :meth:`servers`), listing ``records``."""

    def __init__(self, records: list):
        self.records = records

    def clock(self) -> float:
        return time.time()

    def servers(self, model: str | None = None) -> list:
        return [r for r in self.records if model is None or r.model == model]


def listed(court: Court, server: LocalServer, span: BlockRange = SPAN, state: State = State.ONLINE):
    """``server``'s record on ``span``, with the model's fingerprints of those blocks (court.judges[2]
    serves 0:4, every block there is)."""
    whole = court.judges[2].server.info.fingerprints
    fingerprints = tuple(bytes.fromhex(f) for f in whole[span.start : span.end])
    return server_record("s", server.node.id, court.model, (span.start, span.end), fingerprints, time.time(),
                         100.0, state=state)  # fmt: skip


def test_in_a_swarm_only_an_accused_listed_online_on_those_blocks_is_judged(court):
    liar, judge = court.liars["zeros"], court.judges[0]
    evidence = court.evidence(liar, seed=5)
    before, chunks = evidence_counts(judge), judge.server.describe().counters.training_chunks
    unlisted = [
        [],  # a throwaway key: not a server of the swarm
        [listed(court, court.judges[1])],  # another server
        [listed(court, liar, state=State.OFFLINE)],
        [listed(court, liar, BlockRange(0, 2))],  # a server of other blocks
    ]
    try:
        for records in unlisted:
            judge.server.judge.table = Listing(records)
            reply = court.testify(judge, evidence.meta, evidence.tensors)
            assert (reply.confirmed, reply.reason) == (False, "not_judged") and "swarm table" in reply.detail
        assert judge.server.describe().counters.training_chunks == chunks  # no work for any of them
        judge.server.judge.table = Listing([listed(court, liar, BlockRange(0, 4))])  # covering the blocks
        assert court.testify(judge, evidence.meta, evidence.tensors).confirmed
    finally:
        judge.server.judge.table = None
    expected = {"evidence_received": 5, "evidence_rejected": 4, "evidence_not_judged": 4, "evidence_confirmed": 1}
    assert counted(before, evidence_counts(judge)) == expected


def test_at_most_four_pieces_of_evidence_wait_the_fifth_is_busy(court):
    """Five senders at once (one piece each, straight into the judge): four wait, the fifth is busy."""
    liar, judge = court.liars["noise"], court.judges[1]
    evidence = court.evidence(liar, seed=6)
    before = evidence_counts(judge)
    lock = judge.server.judge._lock  # held: the judge is busy judging something else

    async def five_at_once() -> list[EvidenceReply]:
        await lock.acquire()
        message = Message("evidence", 1, evidence.meta, evidence.tensors)
        sends = [asyncio.ensure_future(judge.server.judge.judge(message, PeerId(f"sender-{i}")))
                 for i in range(MAX_WAITING + 1)]  # fmt: skip
        try:
            done, _ = await asyncio.wait(sends, timeout=10.0, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1 and judge.server.judge._waiting == MAX_WAITING
        finally:
            lock.release()
        return [reply.meta for reply in await asyncio.wait_for(asyncio.gather(*sends), 20.0)]

    replies = court.run(five_at_once())
    reasons = sorted(r.reason for r in replies if not r.confirmed)
    assert sum(r.confirmed for r in replies) == 1 and reasons == ["not_judged", "replayed", "replayed", "replayed"]
    assert any(r.detail.startswith("busy") for r in replies)
    assert counted(before, evidence_counts(judge)) == {
        "evidence_received": 5, "evidence_confirmed": 1, "evidence_rejected": 4, "evidence_not_judged": 1,
        "evidence_replayed": 3,
    }  # fmt: skip
    assert judge.server.judge._waiting == 0 and not judge.server.judge._senders


def test_one_senders_second_piece_at_once_is_busy_while_another_senders_is_judged(court):
    """Over the wire (the handler names the sender): the client node's second piece while its first
    waits is busy at once; another node's piece, sent meanwhile, is judged; so is the first."""
    judge = court.judges[1]
    mine, theirs = court.evidence(court.liars["noise"], seed=12), court.evidence(court.liars["zeros"], seed=13)
    other = court.run(court.swarm.start_node(court.swarm.transport, {}, secret_key=generate_key()))
    lock = judge.server.judge._lock
    before = evidence_counts(judge)

    async def send(node, evidence: Evidence):
        return (await node.request(judge.ticket, BLOCKS, evidence.message(), timeout=20.0)).reply(EvidenceReply)

    async def at_once() -> tuple[EvidenceReply, EvidenceReply, EvidenceReply]:
        await lock.acquire()
        try:
            first = asyncio.ensure_future(send(court.node, mine))
            while court.node.id not in judge.server.judge._senders:  # the first is in the judge
                await asyncio.sleep(0.01)
            second = await asyncio.wait_for(send(court.node, theirs), 10.0)  # answered while the lock is held
            another = asyncio.ensure_future(send(other, theirs))
            while other.id not in judge.server.judge._senders:
                await asyncio.sleep(0.01)
            assert not first.done() and not another.done()
        finally:
            lock.release()
        return await asyncio.wait_for(first, 20.0), second, await asyncio.wait_for(another, 20.0)

    try:
        first, second, another = court.run(at_once(), timeout=40.0)
    finally:
        court.run(other.close())
    assert first.confirmed and another.confirmed, (first, another)
    assert (second.confirmed, second.reason) == (False, "not_judged") and "of this sender" in second.detail
    assert counted(before, evidence_counts(judge)) == {"evidence_received": 3, "evidence_confirmed": 2,
                                                       "evidence_rejected": 1, "evidence_not_judged": 1}  # fmt: skip
    assert not judge.server.judge._senders


def test_the_same_forged_blob_twice_costs_one_check_and_gets_the_same_finding(court, monkeypatch):
    """Forged or malformed evidence never enters the ledger; its digest does: sent again, the very
    same blob is answered from memory (one compute task for its digest, no checks), counted as
    before. A forged copy never stands for the genuine evidence, which is judged afterwards."""
    liar, judge = court.liars["other-weights"], court.judges[2]
    evidence = court.evidence(liar, seed=14)
    tampered = evidence.tensors[2].clone()
    tampered[0, 4, 1] -= 0.01
    forged = [evidence.tensors[0], evidence.tensors[1], tampered, *evidence.tensors[3:]]
    malformed = [evidence.tensors[0], torch.cat([evidence.tensors[1]] * 2, dim=1), *evidence.tensors[2:]]
    checks: list[str] = []

    def counting(name: str, check):
        def counted_check(*args, **kwargs):
            checks.append(name)
            return check(*args, **kwargs)

        return counted_check

    monkeypatch.setattr(judge_module, "check_evidence", counting("structure", judge_module.check_evidence))
    monkeypatch.setattr(judge_module, "check_part", counting("signatures", judge_module.check_part))
    before = evidence_counts(judge)
    for tensors, reason, work in ((forged, "forged", ["structure", "signatures"]), (malformed, "malformed",
                                                                                    ["structure"])):  # fmt: skip
        checks.clear()
        chunks = judge.server.describe().counters.training_chunks
        first = court.testify(judge, evidence.meta, tensors)
        assert (first.confirmed, first.reason) == (False, reason) and checks == work
        assert judge.server.describe().counters.training_chunks - chunks == len(work)
        checks.clear()
        chunks = judge.server.describe().counters.training_chunks
        again = court.testify(judge, evidence.meta, tensors)
        assert again == first and checks == []  # the same finding, without its checks
        assert judge.server.describe().counters.training_chunks - chunks == 1  # the digest alone
    assert counted(before, evidence_counts(judge)) == {"evidence_received": 4, "evidence_rejected": 4,
                                                       "evidence_forged": 2, "evidence_malformed": 2}  # fmt: skip
    assert court.testify(judge, evidence.meta, evidence.tensors).confirmed  # the genuine blob: judged


def test_forgeries_remembered_are_bounded_least_recently_seen_first(monkeypatch):
    judge = Judge(None, None, ServerCounters())
    monkeypatch.setattr(judge_module, "MAX_FORGERIES", 2)
    for digest in (b"a", b"b"):
        judge._remember(digest, Rejected(Reason.FORGED, digest.decode()))
    judge._forgeries.move_to_end(b"a")  # seen again: as a hit in _checked does
    judge._remember(b"c", Rejected(Reason.MALFORMED, "c"))
    assert list(judge._forgeries) == [b"a", b"c"]
    assert judge_module.MAX_FORGERIES == 2 and MAX_FORGERIES == 1024


@pytest.mark.parametrize(("error", "reason"), [(ValueError("bad shape"), "malformed"),
                                               (RuntimeError("out of memory"), "not_judged")])  # fmt: skip
def test_an_unforeseen_error_is_a_counted_rejection_and_releases_the_evidence(court, monkeypatch, error, reason):
    liar, judge = court.liars["skip-block"], court.judges[0]
    evidence = court.evidence(liar, seed=7 if reason == "malformed" else 8)
    before = evidence_counts(judge)

    async def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(judge.server.judge.backend, "recompute", failing)
    reply = court.testify(judge, evidence.meta, evidence.tensors)
    assert (reply.confirmed, reply.reason) == (False, reason) and str(error) in reply.detail
    monkeypatch.undo()
    assert court.testify(judge, evidence.meta, evidence.tensors).confirmed  # not "replayed": the key was released
    assert counted(before, evidence_counts(judge)) == {"evidence_received": 2, "evidence_rejected": 1,
                                                       f"evidence_{reason}": 1, "evidence_confirmed": 1}  # fmt: skip


def test_an_output_of_other_positions_than_the_disputed_step_is_malformed(court):
    liar, judge = court.liars["noise"], court.judges[2]
    evidence = court.evidence(liar, seed=9)
    before = evidence_counts(judge)
    longer = torch.cat([evidence.tensors[1], evidence.tensors[1]], dim=1)  # 2 positions; the receipt says 1
    reply = court.testify(judge, evidence.meta, [evidence.tensors[0], longer, *evidence.tensors[2:]])
    assert (reply.confirmed, reply.reason) == (False, "malformed") and "the disputed step 1" in reply.detail
    assert counted(before, evidence_counts(judge)) == {"evidence_received": 1, "evidence_rejected": 1,
                                                       "evidence_malformed": 1}  # fmt: skip


def test_convictions_remembered_are_bounded_and_expired_ones_pruned(monkeypatch):
    judge = Judge(None, None, ServerCounters())  # convicting needs neither backend nor span
    clock = [1000.0]
    monkeypatch.setattr(judge_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(judge_module, "MAX_LIARS", 3)
    for peer in ("a", "b"):
        judge._convict(SimpleNamespace(accused=PeerId(peer)))
    clock[0] += LIAR_BAN_SECONDS + 1  # a and b are free again
    for peer in ("c", "d", "e", "f"):
        judge._convict(SimpleNamespace(accused=PeerId(peer)))
    assert list(judge._liars) == ["d", "e", "f"]  # a, b pruned on insert; c the oldest past the cap
    assert [judge.convicted(PeerId(p)) for p in "abcdef"] == [False, False, False, True, True, True]


# ---- the recompute: chunks of positions through a KV cache, one task each ---------------------------


@pytest.fixture(scope="module")
def spans(tmp_path_factory):
    model_dir = save_checkpoint(tiny_model("llama", seed=5), tmp_path_factory.mktemp("tiny-recompute"))
    return {torch.float32: load_span(model_dir, 0, 3)[0]}


def recompute(span, hidden, positions, mask, chunk: int, monkeypatch) -> tuple[Tensor, int]:
    """(blocks 0:3 recomputed with ``chunk`` positions a task, how many tasks)."""
    monkeypatch.setattr(backend_module, "RECOMPUTE_CHUNK_POSITIONS", chunk)
    backend = SpanBackend(span, HIDDEN, executor=compute_thread(1))
    try:
        out = asyncio.run(backend.recompute(hidden, positions, mask, 0, 3))
        return out, backend.compute_counts().ran[Priority.TRAINING]
    finally:
        backend.shutdown()


def test_the_recompute_in_chunks_equals_one_pass_within_fp32_noise(spans, monkeypatch):
    generator = torch.Generator().manual_seed(12)
    hidden = torch.randn(3, 50, HIDDEN, generator=generator)
    positions = torch.arange(50).repeat(3, 1)
    mask = torch.ones(3, 50, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded row
    span = spans[torch.float32]
    with torch.inference_mode():
        whole = span(hidden, positions, mask)
    out, tasks = recompute(span, hidden, positions, mask, 48, monkeypatch)  # 16 positions of 3 rows a task
    assert tasks == 3 * 4  # 3 blocks x ceil(50 / 16) chunks
    assert out.dtype == torch.float32 and out.shape == whole.shape
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-4 * float(whole.abs().max()))
    single, tasks = recompute(span, hidden, positions, mask, 1000, monkeypatch)  # one chunk: one task per block
    assert tasks == 3
    torch.testing.assert_close(single, whole, rtol=0, atol=1e-4 * float(whole.abs().max()))


def test_the_recompute_keeps_the_spans_dtype_between_blocks_and_casts_once(spans, monkeypatch):
    """bf16 inputs through an fp32 span: as a step computes (fp32 throughout, one rounding at the end),
    not rounded to bf16 after every block."""
    span = spans[torch.float32]
    hidden = torch.randn(1, 20, HIDDEN, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    positions = torch.arange(20)[None]
    with torch.inference_mode():
        once = span(hidden, positions, None)
    out, _ = recompute(span, hidden, positions, None, 8, monkeypatch)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), once.to(torch.bfloat16).float(), rtol=0,
                               atol=2**-7 * float(once.abs().max()))  # fmt: skip
    exact = (out == once.to(torch.bfloat16)).float().mean()
    assert exact > 0.95, exact  # rounding per block would leave far fewer bits equal
