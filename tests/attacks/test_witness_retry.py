"""Testimony that a dead or busy judge cannot swallow, and a judge's queue that throwaway keys
cannot fill (issue 34).

* The witness sends evidence to at most MAX_JUDGES judges at once; one that does not answer, or
  answers busy or draining, is replaced by the next server covering the blocks (a fake node plays
  the judges: the first is down).
* A judge's queue (MAX_WAITING pieces) gives evidence against a peer it convicted already (what a
  flood of valid evidence against throwaway liars becomes once judged) the lowest priority: other
  evidence is recomputed first, and displaces a low piece when the queue is full. Real judges of
  an in-process swarm (tests/server/judge's court).
"""

from __future__ import annotations

import asyncio

import pytest

from shoal.client.verification import witness as witness_module
from shoal.client.verification.audit import Verification
from shoal.client.verification.witness import Witness
from shoal.errors import ShoalError
from shoal.ids import PeerId
from shoal.server.judge import DISPLACED, MAX_WAITING
from shoal.wire import Message
from shoal.wire.schema import EvidenceReply
from tests.server.judge.bench import evidence_counts
from tests.server.judge.conftest import court  # noqa: F401  (the judge tests' fixture)
from tests.unit.test_evidence import JUDGE, LIAR, OTHER, Session
from tests.unit.test_witness import directory, liar_span

pytestmark = pytest.mark.timeout(90)


class FlakyJudges:
    """Judges on a fake node: ``down`` tickets fail to connect, ``busy`` ones answer busy, the rest confirm."""

    def __init__(self, down=(), busy=()):
        self.down, self.busy = set(down), set(busy)
        self.asked: list[str] = []

    async def request(self, ticket, protocol, message: Message, timeout: float | None = None) -> Message:
        self.asked.append(ticket)
        if ticket in self.down:
            raise ShoalError(f"{ticket}: connection refused")
        if ticket in self.busy:
            reply = EvidenceReply(confirmed=False, reason="not_judged", detail="busy: 4 pieces of evidence are waiting")
        else:
            reply = EvidenceReply(confirmed=True, detail="ok")
        return Message("result", message.id, reply)


def send_evidence(node, judges, monkeypatch, max_judges: int = 1) -> Verification:
    monkeypatch.setattr(witness_module, "MAX_JUDGES", max_judges)
    session = Session(lie_from=7)
    verification = Verification()
    witness = Witness(node, directory(*judges), verification)

    async def run() -> None:
        witness.report(liar_span(), LIAR.peer_id, 7, session.history)
        await witness.close(timeout=20.0)

    asyncio.run(run())
    return verification


def test_the_witness_retries_another_judge_when_the_first_is_down(monkeypatch):
    node = FlakyJudges(down={"ticket-0"})
    verification = send_evidence(node, [JUDGE, OTHER], monkeypatch)
    assert node.asked == ["ticket-0", "ticket-1"]
    assert (verification.evidence_sent, verification.evidence_confirmed, verification.evidence_rejected) == (2, 1, 0)


def test_a_busy_judge_is_replaced_and_every_lane_stops_at_its_first_finding(monkeypatch):
    node = FlakyJudges(busy={"ticket-0"})
    verification = send_evidence(node, [JUDGE, OTHER], monkeypatch)
    assert node.asked == ["ticket-0", "ticket-1"] and verification.evidence_confirmed == 1
    node = FlakyJudges()
    verification = send_evidence(node, [JUDGE, OTHER], monkeypatch, max_judges=2)  # both asked at once, once each
    assert sorted(node.asked) == ["ticket-0", "ticket-1"] and verification.evidence_confirmed == 2


def test_with_every_judge_down_the_witness_gives_up_after_each_once(monkeypatch):
    node = FlakyJudges(down={"ticket-0", "ticket-1"})
    verification = send_evidence(node, [JUDGE, OTHER], monkeypatch)
    assert node.asked == ["ticket-0", "ticket-1"] and verification.evidence_confirmed == 0


def test_evidence_against_a_convicted_liar_waits_last_and_is_displaced(court):  # noqa: F811
    """The judge convicted ``zeros`` already. With the recompute turn held, four pieces against it
    fill the queue; a piece against ``noise`` (not convicted) displaces one of them, is recomputed
    first once the turn is free, and is confirmed; the displaced one is told busy."""
    judge = court.judges[0]
    zeros, noise = court.liars["zeros"], court.liars["noise"]
    first = court.evidence(zeros, seed=40)
    assert court.testify(judge, first.meta, first.tensors).confirmed
    assert judge.server.judge.convicted(PeerId(zeros.node.id))
    floods = [court.evidence(zeros, seed=41 + i) for i in range(MAX_WAITING)]
    real = court.evidence(noise, seed=50)
    turns = judge.server.judge._lock
    finished: list[str] = []

    async def flood_then_real() -> tuple[list[EvidenceReply], EvidenceReply]:
        await turns.acquire()  # the judge is busy recomputing something else
        try:
            lows = []
            for i, evidence in enumerate(floods):
                message = Message("evidence", 1, evidence.meta, evidence.tensors)
                task = asyncio.ensure_future(judge.server.judge.judge(message, PeerId(f"flooder-{i}")))
                task.add_done_callback(lambda _, name=f"low-{i}": finished.append(name))
                lows.append(task)
            while judge.server.judge._waiting < MAX_WAITING or len(turns._queue) < MAX_WAITING:
                await asyncio.sleep(0.01)  # all four checked and waiting for their turn
            message = Message("evidence", 1, real.meta, real.tensors)
            high = asyncio.ensure_future(judge.server.judge.judge(message, PeerId("honest-client")))
            high.add_done_callback(lambda _: finished.append("high"))
            done, _ = await asyncio.wait(lows, timeout=10.0, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1  # the displaced one, answered at once
            while not any(not entry.low for _, _, entry in turns._queue):
                await asyncio.sleep(0.01)  # the real piece checked and waiting for its turn too
        finally:
            turns.release()
        replies = await asyncio.wait_for(asyncio.gather(*lows), 30.0)
        return [r.meta for r in replies], (await asyncio.wait_for(high, 30.0)).meta

    before = evidence_counts(judge)
    lows, high = court.run(flood_then_real(), timeout=60.0)
    assert high.confirmed
    displaced = [r for r in lows if r.detail == DISPLACED]
    assert len(displaced) == 1 and displaced[0].reason == "not_judged"
    assert finished.index("high") == 1, finished  # after the displaced one, before every other low piece
    assert all(r.confirmed for r in lows if r.detail != DISPLACED)  # still judged, only later
    after = evidence_counts(judge)
    assert after["evidence_received"] - before["evidence_received"] == MAX_WAITING + 1
    assert judge.server.judge._waiting == 0 and not turns.locked()


def test_a_full_queue_of_evidence_worth_judging_is_never_displaced(court):  # noqa: F811
    """Low evidence arriving at a full queue is busy; it displaces nothing."""
    judge = court.judges[1]
    zeros = court.liars["zeros"]
    evidence = court.evidence(zeros, seed=60)
    turns = judge.server.judge._lock

    async def full() -> EvidenceReply:
        judge.server.judge._liars[PeerId(zeros.node.id)] = float("inf")  # convicted here
        entries = [judge.server.judge._admit(evidence.meta, PeerId(f"s{i}")) for i in range(MAX_WAITING)]
        for entry in entries:
            entry.low = False  # four pieces against servers not convicted here
        try:
            message = Message("evidence", 1, evidence.meta, evidence.tensors)
            return (await judge.server.judge.judge(message, PeerId("flooder"))).meta
        finally:
            for entry in entries:
                judge.server.judge._entries.remove(entry)
            judge.server.judge._liars.pop(PeerId(zeros.node.id), None)

    reply = court.run(full())
    assert reply.reason == "not_judged" and reply.detail.startswith("busy: 4 pieces")
    assert judge.server.judge._waiting == 0 and not turns.locked()
