"""A judge that cannot be abused (the setting: ``test_findings.py``): it judges only an accused
listed online on those blocks, holds at most four pieces of evidence and one per sender at once,
checks a forged blob once, bounds what it remembers, and counts an unforeseen error as a rejection."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from shoal.ids import BlockRange, PeerId
from shoal.launch.inprocess import LocalServer
from shoal.protocols import BLOCKS
from shoal.server import judge as judge_module
from shoal.server.judge import MAX_FORGERIES, MAX_WAITING, Judge
from shoal.swarm.records import State
from shoal.transport.identity import generate_key
from shoal.verify.evidence import Evidence, Reason, Rejected
from shoal.verify.receipts import LIAR_BAN_SECONDS
from shoal.wire import Message
from shoal.wire.schema import EvidenceReply, ServerCounters
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.registry import server_record
from tests.server.judge.bench import SPAN, Court, counted, evidence_counts

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]


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
