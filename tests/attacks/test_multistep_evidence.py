"""Evidence spanning several steps (issue 34): a lie spread over one-position decode steps is seen
only by the window rule (shoal.verify.compare), over a whole audit's comparison. Evidence of the
disputed step alone shows a judge one position of it: framing. So evidence carries the steps the
audit compared (``EvidenceRequest.disputed``), and a judge applies the same rule over them: the lie
is confirmed at the position the client's audit found; an honest server's steps are still framing.

bf16 tolerance, noise of 0.06 of the row norm on every other position of single-position steps:
each position reads about 0.05 (above ``sustained`` 0.035, below ``relative`` 0.13, never two in a
row), 4 of every 8 positions beyond it.
"""

from __future__ import annotations

import pytest
import torch

from shoal.client.remote.history import SpanHistory
from shoal.verify.compare import first_disagreement, row_discrepancy, tolerance_for
from shoal.verify.evidence import Reason, Rejected, build_evidence, check_evidence, check_part, finding
from shoal.wire.schema import MAX_DISPUTED_STEPS
from tests.unit.test_evidence import BLOCKS, LIAR, MODEL, bench, honest, receipt_of

pytestmark = pytest.mark.timeout(30)

WIDTH = 64
BF16 = tolerance_for(torch.bfloat16)
STEPS = ((0, 5), *((p, 1) for p in range(5, 24)))  # a prefill, then one position a step
FIRST_LIE = 9
AUDITED = (8, 24)  # the audit that found it compared these positions


def session(lie: bool = True, seed: int = 0, steps=STEPS) -> tuple[SpanHistory, torch.Tensor]:
    """The liar's history at blocks 2 (inputs) and 4 (outputs), its receipts signed step by step;
    ``lie``: noise on positions FIRST_LIE, +2, +4... (else honest outputs)."""
    generator = torch.Generator().manual_seed(seed)
    total = steps[-1][0] + steps[-1][1]
    hidden = torch.randn(1, total, WIDTH, generator=generator)
    position_ids = torch.arange(total)[None]
    history = SpanHistory(1)
    for start, n in steps:
        out = honest(hidden[:, start : start + n])
        for q in range(start, start + n):
            if lie and q >= FIRST_LIE and (q - FIRST_LIE) % 2 == 0:
                row = out[:, q - start]
                noise = torch.randn(row.shape, generator=generator)
                out[:, q - start] = row + 0.06 * row.norm() * noise / noise.norm()
        receipt = receipt_of(LIAR, hidden, position_ids, None, start, n, out)
        recorded = {BLOCKS.start: hidden[:, start : start + n].clone(), BLOCKS.end: out}
        history.record(recorded, {BLOCKS.start, BLOCKS.end}, position_ids[:, start : start + n], None, start + n,
                       {BLOCKS.start: receipt})  # fmt: skip
    return history, hidden


def judged(evidence):
    """What a judge of this span finds: (the case, its finding or the Rejected)."""
    judge = bench(hidden_size=WIDTH)
    case = check_evidence(evidence.meta, evidence.tensors, judge, costly=False)
    for first in range(0, len(case.receipts), 7):  # the judge's signature checks, in parts
        check_part(case, first, min(first + 7, len(case.receipts)))
    try:
        return case, finding(case, honest(case.hidden), BF16)
    except Rejected as exc:
        return case, exc


def test_the_lie_reads_as_the_window_rule_alone_catches_it():
    history, hidden = session()
    start, end = AUDITED
    got = history.hidden(BLOCKS.end, start, end)
    readings = row_discrepancy(honest(hidden[:, start:end]), got)[0]
    lied = readings[FIRST_LIE - start :: 2]
    assert (lied > BF16.sustained).all() and (lied < BF16.relative).all(), readings
    assert first_disagreement(honest(hidden[:, start:end]), got, BF16) == FIRST_LIE - start  # the audit's view
    alone = history.hidden(BLOCKS.end, FIRST_LIE, FIRST_LIE + 1)
    assert first_disagreement(honest(hidden[:, FIRST_LIE : FIRST_LIE + 1]), alone, BF16) is None  # one position


def test_evidence_of_the_audited_steps_is_confirmed_where_the_disputed_step_alone_is_framing():
    history, _ = session()
    alone = build_evidence(MODEL, BLOCKS, LIAR.peer_id, FIRST_LIE, history)
    assert alone.meta.disputed == 1
    _, found = judged(alone)
    assert isinstance(found, Rejected) and found.reason is Reason.FRAMING  # what judges said before

    spanning = build_evidence(MODEL, BLOCKS, LIAR.peer_id, FIRST_LIE, history, through=AUDITED[1])
    assert spanning.meta.disputed == AUDITED[1] - FIRST_LIE  # the lie's step and the 14 after it
    assert spanning.tensors[1].shape[1] == AUDITED[1] - FIRST_LIE and spanning.positions == AUDITED[1]
    case, found = judged(spanning)
    assert found == FIRST_LIE and case.first_disputed.position == FIRST_LIE


def test_an_honest_servers_audited_steps_are_framing_and_tampering_with_one_is_forged():
    history, _ = session(lie=False)
    evidence = build_evidence(MODEL, BLOCKS, LIAR.peer_id, FIRST_LIE, history, through=AUDITED[1])
    _, found = judged(evidence)
    assert isinstance(found, Rejected) and found.reason is Reason.FRAMING
    tampered = list(evidence.tensors)
    tampered[1] = tampered[1].clone()
    tampered[1][:, 3] += 0.1  # a later disputed step's output the accused never signed
    with pytest.raises(Rejected) as caught:
        check_evidence(evidence.meta, tampered, bench(hidden_size=WIDTH))
    assert caught.value.reason is Reason.FORGED


def test_the_disputed_steps_are_bounded():
    long_steps = ((0, 5), *((p, 1) for p in range(5, 5 + 2 * MAX_DISPUTED_STEPS)))
    history, _ = session(steps=long_steps)
    evidence = build_evidence(MODEL, BLOCKS, LIAR.peer_id, FIRST_LIE, history, through=5 + 2 * MAX_DISPUTED_STEPS)
    assert evidence.meta.disputed == MAX_DISPUTED_STEPS
    _, found = judged(evidence)
    assert found == FIRST_LIE
