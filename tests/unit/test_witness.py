"""Testimony (:mod:`shoal.client.verification.witness`) without servers: a fake node plays the judges.

The witness copies what the evidence needs while the session waits (cheap), and builds the evidence
(signature checks, digests) in a worker thread: generation is not stalled by a long history. The
evidence sent is exactly what :func:`~shoal.verify.evidence.build_evidence` builds from the history;
what is still on its way when the client closes is waited for (bounded), then counted."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from shoal.client.remote import history as history_module
from shoal.client.remote.history import cat_serial
from shoal.client.verification import witness as witness_module
from shoal.client.verification.audit import Verification
from shoal.client.verification.witness import Snapshot, Witness
from shoal.routing import RouteInfo, ServerSpan
from shoal.verify.evidence import NoEvidence, build_evidence, check_evidence
from shoal.wire import Message
from shoal.wire.schema import EVIDENCE, EvidenceReply
from shoal.wire.tensors import serial_copy
from tests.unit.test_evidence import BLOCKS, JUDGE, LIAR, MODEL, OTHER, WIDTH, Session, bench

pytestmark = pytest.mark.timeout(60)

LONG = ((0, 5), *((p, 1) for p in range(5, 1000)))  # a prefill, then 995 decode steps


class Judges:
    """A node whose every ``evidence`` request is confirmed after ``delay`` seconds; keeps what it got."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.got: list[tuple[str, Message]] = []

    async def request(self, ticket, protocol, message: Message, timeout: float | None = None) -> Message:
        await asyncio.sleep(self.delay)
        self.got.append((ticket, message))
        return Message("result", message.id, EvidenceReply(confirmed=True, detail="ok"))


def directory(*judges) -> SimpleNamespace:
    info = RouteInfo(capabilities=frozenset({EVIDENCE}))
    spans = [ServerSpan(peer.peer_id, BLOCKS, ticket=f"ticket-{i}", info=info) for i, peer in enumerate(judges)]
    return SimpleNamespace(model=MODEL, spans=spans)


def liar_span() -> ServerSpan:
    return ServerSpan(LIAR.peer_id, BLOCKS, ticket="liar", info=RouteInfo(capabilities=frozenset({EVIDENCE})))


def test_report_copies_fast_and_the_evidence_is_built_in_a_worker_thread(monkeypatch):
    session = Session(LONG, lie_from=700, batch=3, padded=2, seed=7)
    started = time.perf_counter()
    expected = build_evidence(MODEL, BLOCKS, LIAR.peer_id, 700, session.history)
    building = time.perf_counter() - started
    threads: list[str] = []

    def recording(*args):
        threads.append(threading.current_thread().name)
        return build_evidence(*args)

    monkeypatch.setattr(witness_module, "build_evidence", recording)
    verification, judges = Verification(), Judges()
    witness = Witness(judges, directory(JUDGE, OTHER), verification)

    async def testify() -> float:
        started = time.perf_counter()
        witness.report(liar_span(), LIAR.peer_id, 700, session.history)
        reporting = time.perf_counter() - started
        session.history.truncate(690)  # the rollback right after: the snapshot is a copy
        await witness.close(timeout=30.0)
        return reporting

    reporting = asyncio.run(testify())
    assert reporting < building / 5, (reporting, building)  # signatures and digests are not on the loop
    assert threads and all(name.startswith("shoal-witness") for name in threads), threads
    assert sorted(ticket for ticket, _ in judges.got) == ["ticket-0", "ticket-1"]
    for _, message in judges.got:
        assert message.meta == expected.meta
        assert all(torch.equal(a, b) for a, b in zip(message.tensors, expected.tensors, strict=True))
    assert check_evidence(expected.meta, expected.tensors, bench()).disputed.position == 700
    assert (verification.evidence_sent, verification.evidence_confirmed, verification.evidence_rejected) == (2, 2, 0)


def test_the_snapshot_answers_as_the_history_within_what_it_copied():
    session = Session(lie_from=7, batch=2, padded=1)
    snapshot = Snapshot(session.history, BLOCKS, 7)
    assert (snapshot.begin, snapshot.end) == (7, 8)
    for got, want in zip(snapshot.window(BLOCKS.start, 0, 8), session.history.window(BLOCKS.start, 0, 8), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(snapshot.hidden(BLOCKS.end, 7, 8), session.history.hidden(BLOCKS.end, 7, 8))
    assert snapshot.receipts(BLOCKS.start) == session.receipts[:5] and snapshot.receipts(BLOCKS.end) == []
    with pytest.raises(NoEvidence, match="no receipt covers position 40"):
        Snapshot(session.history, BLOCKS, 40)


def test_testimony_outlives_the_report_and_close_waits_for_it():
    """The judges answer after the session that caught the lie is gone; closing the witness (with
    the client) waits for them, so the counts arrive; a report after closing is ignored."""
    session = Session(lie_from=7)
    verification, judges = Verification(), Judges(delay=0.3)
    witness = Witness(judges, directory(JUDGE), verification)

    async def testify() -> tuple[int, int]:
        witness.report(liar_span(), LIAR.peer_id, 7, session.history)
        session.history.clear()  # the session ended
        await asyncio.sleep(0.05)
        before = verification.evidence_confirmed
        await witness.close(timeout=10.0)
        witness.report(liar_span(), LIAR.peer_id, 7, Session(lie_from=7).history)
        await asyncio.sleep(0.4)
        return before, verification.evidence_confirmed

    assert asyncio.run(testify()) == (0, 1)
    assert len(judges.got) == 1


def test_close_gives_up_after_its_timeout():
    session = Session(lie_from=7)
    verification = Verification()
    witness = Witness(Judges(delay=30.0), directory(JUDGE), verification)

    async def testify() -> float:
        witness.report(liar_span(), LIAR.peer_id, 7, session.history)
        started = time.perf_counter()
        await witness.close(timeout=0.3)
        return time.perf_counter() - started

    assert asyncio.run(testify()) < 5.0
    assert (verification.evidence_sent, verification.evidence_confirmed) == (1, 0)


def test_a_history_past_the_bounds_is_refused_from_its_shapes_before_anything_is_copied(monkeypatch):
    """Sized first: the fewest bytes the evidence carries (hidden states and position ids of 0:8 of
    a batch of 2) over the bound, or a disputed step past the positions' bound, copies nothing."""
    session = Session(lie_from=7, batch=2)
    copies: list[tuple] = []

    def spying(chunks, dim):
        copies.append(tuple(chunks[0].shape))
        return cat_serial(chunks, dim)

    def spying_copy(tensor):
        copies.append(tuple(tensor.shape))
        return serial_copy(tensor)

    monkeypatch.setattr(witness_module, "serial_copy", spying_copy)
    monkeypatch.setattr(history_module, "cat_serial", spying)  # the history joining its chunks is a copy too
    least = 2 * 8 * (WIDTH * 4 + 8)
    assert witness_module.least_evidence_bytes(session.history, BLOCKS.start, 8) == least
    monkeypatch.setattr(witness_module, "MAX_EVIDENCE_BYTES", least - 1)
    with pytest.raises(NoEvidence, match=f"at least {least} bytes"):
        Snapshot(session.history, BLOCKS, 7)
    monkeypatch.setattr(witness_module, "MAX_EVIDENCE_BYTES", least)
    monkeypatch.setattr(witness_module, "MAX_EVIDENCE_POSITIONS", 7)  # the disputed step 7:8 ends past it
    with pytest.raises(NoEvidence, match="past the evidence's 7 positions"):
        Snapshot(session.history, BLOCKS, 7)
    verification, judges = Verification(), Judges()

    async def report() -> None:
        Witness(judges, directory(JUDGE), verification).report(liar_span(), LIAR.peer_id, 7, session.history)
        await asyncio.sleep(0.05)

    asyncio.run(report())
    assert copies == [] and judges.got == [] and verification.evidence_sent == 0
    monkeypatch.setattr(witness_module, "MAX_EVIDENCE_POSITIONS", 8)
    snapshot = Snapshot(session.history, BLOCKS, 7)  # within both bounds: copied, each tensor once
    assert (snapshot.begin, snapshot.end) == (7, 8)
    assert [shape for shape in copies if shape[1] == 8] == [(2, 8, WIDTH), (2, 8)]  # inputs, positions
    assert copies[-1] == (2, 1, WIDTH)  # the output


def test_the_output_handed_to_the_builder_is_contiguous_even_as_a_slice_of_a_batch():
    session = Session(((0, 5), (5, 3)), lie_from=7, batch=2)
    snapshot = Snapshot(session.history, BLOCKS, 7)
    assert (snapshot.begin, snapshot.end) == (5, 8)
    rows = snapshot.hidden(BLOCKS.end, 6, 8)  # rows of a [2, 3, H] copy: a torch slice is not contiguous
    assert rows.is_contiguous() and torch.equal(rows, session.history.hidden(BLOCKS.end, 6, 8))
    assert snapshot.hidden(BLOCKS.end, 5, 8).is_contiguous()
