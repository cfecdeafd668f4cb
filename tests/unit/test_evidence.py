"""Evidence of a lie (:mod:`shoal.verify.evidence`): built from a session's history, and every check a
judge makes, each failing with its own reason, in order. Pure: signed receipts over made-up
tensors, no server; "outputs" are a fixed function of the inputs, so a recomputation is exact."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import Tensor

from shoal.client.remote.history import SpanHistory
from shoal.ids import BlockRange
from shoal.verify import evidence as ev
from shoal.verify import testimony
from shoal.verify.compare import tolerance_for, tolerance_of
from shoal.verify.evidence import (
    Bench,
    Evidence,
    Ledger,
    NoEvidence,
    Reason,
    Rejected,
    build_evidence,
    check_evidence,
    check_part,
    covering_receipts,
    finding,
    step_tensors,
)
from shoal.verify.receipts import ReceiptSigner, adapter_tag, sign_receipt, weights_digest
from shoal.verify.state import EMPTY_STATE, states_of
from shoal.wire import Codec
from shoal.wire.schema import EvidenceRequest, Receipt

pytestmark = pytest.mark.timeout(30)

LIAR, OTHER, JUDGE = (ReceiptSigner(bytes([seed] * 32)) for seed in (1, 2, 3))
BLOCKS = BlockRange(2, 4)
FINGERPRINTS = ("ab" * 32, "cd" * 32, "ef" * 32, "01" * 32)  # blocks 0..3
WIDTH = 8
MODEL = "tiny"
FP32 = tolerance_for(torch.float32)
CHAT, OTHER_CHAT, MATH = "c1" * 32, "c2" * 32, "aa" * 32  # adapter digests: two different adapters named "chat"
#: one prefill of 5 positions, then single-position steps
STEPS = ((0, 5), (5, 1), (6, 1), (7, 1), (8, 1))


def honest(hidden: Tensor) -> Tensor:
    """What the span computes (a stand-in: any fixed function of the inputs)."""
    return torch.tanh(hidden * 1.5) + 0.25


def bench(**changes) -> Bench:
    fields = dict(model=MODEL, blocks=BLOCKS, fingerprints=FINGERPRINTS[2:4], quantization="none",
                  adapters={adapter_tag(CHAT): "chat"}, hidden_size=WIDTH, peer_id=JUDGE.peer_id)  # fmt: skip
    fields.update(changes)
    return Bench(**fields)


def receipt_of(signer, hidden, position_ids, mask, start, n, output, *, session="s-liar", **changes) -> Receipt:
    """A receipt of the step over ``[start, start + n)`` (``mask``: the one it sent, of ``[0, start + n)``),
    on the cache an honest server holds: the chain of ``hidden`` up to ``start``."""
    state = states_of(hidden[:, :start], position_ids[:, :start], None if mask is None else mask[:, :start])[-16:]
    fields = dict(weights=weights_digest(FINGERPRINTS[2:4], "none"), start=BLOCKS.start, end=BLOCKS.end,
                  session=session, position=start, step=start + 1,
                  inputs=step_tensors(hidden, position_ids, mask, start, start + n), output=output, state=state,
                  compute="f32/cpu")  # fmt: skip
    fields.update(changes)
    return sign_receipt(signer, **fields)


class Session:
    """A session's history at blocks 2 (inputs) and 4 (outputs) with the liar's signed receipts;
    ``lie_from``: the liar adds 0.5 to its outputs from that position on."""

    def __init__(self, steps=STEPS, *, lie_from: int | None = None, batch: int = 1, padded: int = 0, seed: int = 0,
                 signer=LIAR, session="s-liar", **receipt_changes):  # fmt: skip
        total = max(s + n for s, n in steps)
        generator = torch.Generator().manual_seed(seed)
        self.hidden = torch.randn(batch, total, WIDTH, generator=generator)
        self.position_ids = torch.arange(total).repeat(batch, 1)
        self.mask = torch.ones(batch, total, dtype=torch.bool)
        self.mask[0, :padded] = False
        self.history = SpanHistory(batch)
        self.receipts: list[Receipt] = []
        for start, n in steps:
            end = start + n
            out = honest(self.hidden[:, start:end])
            if lie_from is not None and end > lie_from:
                out[:, max(0, lie_from - start) :] += 0.5
            mask = self.mask[:, :end] if padded else None
            receipt = receipt_of(signer, self.hidden, self.position_ids, mask, start, n, out, session=session,
                                 **receipt_changes)  # fmt: skip
            self.receipts.append(receipt)
            inputs = {BLOCKS.start: self.hidden[:, start:end].clone(), BLOCKS.end: out}
            self.history.record(inputs, {BLOCKS.start, BLOCKS.end}, self.position_ids[:, start:end], mask, end,
                                {BLOCKS.start: receipt})  # fmt: skip

    def evidence(self, position: int) -> Evidence:
        return build_evidence(MODEL, BLOCKS, LIAR.peer_id, position, self.history)


def rejected(meta, tensors, judge: Bench | None = None) -> Rejected:
    with pytest.raises(Rejected) as caught:
        check_evidence(meta, tensors, judge or bench())
    return caught.value


def test_built_evidence_covers_zero_to_the_disputed_step_and_passes_every_check():
    session = Session(lie_from=7)
    evidence = session.evidence(7)
    assert evidence.meta == EvidenceRequest(model=MODEL, accused=LIAR.peer_id, start=2, end=4, steps=4)
    receipts, output, hidden, position_ids = evidence.tensors
    assert msgspec.msgpack.decode(receipts.numpy().tobytes(), type=list[Receipt]) == session.receipts[:4]
    assert torch.equal(output, honest(session.hidden[:, 7:8]) + 0.5)  # the disputed step's (wrong) answer
    assert torch.equal(hidden, session.hidden[:, :8]) and torch.equal(position_ids, session.position_ids[:, :8])
    case = check_evidence(evidence.meta, evidence.tensors, bench())
    assert case.disputed == session.receipts[3] and case.accused == LIAR.peer_id and case.blocks == BLOCKS
    assert len(case.digest) == 32 and len(case.key) == 32
    assert finding(case, honest(case.hidden), FP32) == 7  # the first wrong position


def test_a_lie_inside_the_prefill_is_found_at_its_first_wrong_position():
    session = Session(lie_from=3)
    evidence = session.evidence(3)
    assert evidence.meta.steps == 1 and evidence.positions == 5
    assert finding(check_evidence(evidence.meta, evidence.tensors, bench()), honest(session.hidden[:, :5]), FP32) == 3


def test_padded_batches_carry_the_mask_and_their_digests_match():
    session = Session(lie_from=6, batch=3, padded=2)
    evidence = session.evidence(6)
    assert len(evidence.tensors) == 5 and torch.equal(evidence.tensors[4], session.mask[:, :7])
    case = check_evidence(evidence.meta, evidence.tensors, bench())
    assert finding(case, honest(case.hidden), FP32) == 6


def test_the_evidence_is_a_copy_the_rollback_cannot_change():
    session = Session(lie_from=7)
    evidence = session.evidence(7)
    session.history.truncate(7)
    case = check_evidence(evidence.meta, evidence.tensors, bench())
    assert case.hidden.shape[1] == 8


def test_a_resent_step_overwrites_the_earlier_receipts_of_its_positions():
    session = Session(((0, 5), (5, 1), (6, 1), (5, 1), (6, 1), (7, 1)), lie_from=6)
    chosen = covering_receipts(session.receipts, LIAR.peer_id, BLOCKS, 6)
    assert chosen == [session.receipts[0], session.receipts[3], session.receipts[4]]
    assert chosen[-1] is session.receipts[4]  # the latest covering position 6 is the disputed step


def test_no_evidence_when_a_resent_step_split_an_earlier_one():
    session = Session(((0, 5), (3, 3)))
    with pytest.raises(NoEvidence, match="split"):
        covering_receipts(session.receipts, LIAR.peer_id, BLOCKS, 4)


def test_only_the_liars_receipts_of_the_disputed_session_count():
    liar = Session(lie_from=6)
    others = Session(signer=OTHER).receipts  # another server's steps of the same hop (before a replacement)
    old = Session(session="s-old").receipts  # the liar's earlier session
    mixed = [*old, *others, *liar.receipts]
    assert covering_receipts(mixed, LIAR.peer_id, BLOCKS, 6) == liar.receipts[:3]
    with pytest.raises(NoEvidence, match="no receipt"):
        covering_receipts(others, LIAR.peer_id, BLOCKS, 6)


def test_no_evidence_without_receipts_from_position_zero():
    session = Session()
    with pytest.raises(NoEvidence, match="do not cover positions 0:5"):
        covering_receipts(session.receipts[1:], LIAR.peer_id, BLOCKS, 6)


def test_no_evidence_when_the_history_is_not_what_the_liar_signed():
    session = Session(lie_from=6)
    session.history.at(BLOCKS.start)[0, 2, 0] += 1.0  # the recorded inputs differ from the signed ones
    with pytest.raises(NoEvidence, match="inputs at 0"):
        session.evidence(6)
    session = Session(lie_from=6)
    session.history.at(BLOCKS.end)[0, 6, 0] += 1.0
    with pytest.raises(NoEvidence, match="output"):
        session.evidence(6)


def test_no_evidence_past_the_position_bound(monkeypatch):
    monkeypatch.setattr(testimony, "MAX_EVIDENCE_POSITIONS", 6)
    session = Session(lie_from=6)
    with pytest.raises(NoEvidence, match="past 6"):
        session.evidence(6)
    assert session.evidence(5).positions == 6  # a lie up to the bound is still testified to


def test_no_evidence_past_the_size_bound(monkeypatch):
    monkeypatch.setattr(testimony, "MAX_EVIDENCE_BYTES", 200)
    with pytest.raises(NoEvidence, match="bytes of evidence"):
        Session(lie_from=6).evidence(6)


# ---- the judge's checks, one reason each --------------------------------------------------------


@pytest.fixture
def sent() -> tuple[EvidenceRequest, list[Tensor], Session]:
    session = Session(lie_from=7)
    evidence = session.evidence(7)
    return evidence.meta, evidence.tensors, session


def packed(receipts: list[Receipt]) -> Tensor:
    return torch.frombuffer(bytearray(msgspec.msgpack.encode(receipts)), dtype=torch.uint8)


@pytest.mark.parametrize(
    "breaking",
    [
        lambda meta, t: (meta, t[:3]),
        lambda meta, t: (meta, [torch.tensor([0xC1], dtype=torch.uint8), *t[1:]]),  # not msgpack
        lambda meta, t: (meta, [t[0].to(torch.int16), *t[1:]]),
        lambda meta, t: (msgspec.structs.replace(meta, steps=3), t),
        lambda meta, t: (meta, [t[0], t[1], t[2][..., :4], t[3]]),  # another width than the model's
        lambda meta, t: (meta, [t[0], t[1], t[2], t[3].to(torch.int32)]),
        lambda meta, t: (meta, [*t, torch.ones(1, 8, dtype=torch.int64)]),  # a mask must be bool
        lambda meta, t: (meta, [t[0], t[1][:, :0], t[2], t[3]]),
        lambda meta, t: (msgspec.structs.replace(meta, start=4, end=4), t),
    ],
)
def test_malformed(sent, breaking):
    meta, tensors = breaking(*sent[:2])
    assert rejected(meta, tensors).reason is Reason.MALFORMED


@pytest.mark.parametrize(
    ("judge", "what"),
    [
        (bench(model="other"), "model"),
        (bench(blocks=BlockRange(0, 2), fingerprints=FINGERPRINTS[:2]), "blocks"),
        (bench(blocks=BlockRange(2, 3), fingerprints=FINGERPRINTS[2:3]), "blocks"),
        (bench(peer_id=LIAR.peer_id), "itself"),
        (bench(fingerprints=FINGERPRINTS[:2]), "other weights"),
        (bench(quantization="int8"), "other weights"),
    ],
)
def test_not_judged_by_this_server(sent, judge, what):
    meta, tensors, _ = sent
    found = rejected(meta, tensors, judge)
    assert found.reason is Reason.NOT_JUDGED and what in found.detail


def test_a_judge_serving_more_blocks_judges_its_sub_span(sent):
    meta, tensors, _ = sent
    case = check_evidence(meta, tensors, bench(blocks=BlockRange(0, 4), fingerprints=FINGERPRINTS))
    assert case.blocks == BLOCKS


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        (dict(prompts=True), "deep prompts"),
        (dict(adapter=adapter_tag(MATH)), f"digest {MATH[:32]}"),
        (dict(adapter=adapter_tag(OTHER_CHAT)), "lacks"),  # another adapter its server also calls "chat"
        (dict(adapter=adapter_tag(CHAT)), None),
    ],
)
def test_adapters_and_prompts(changes, what):
    """An adapter is judged by its digest: a judge's "chat" of other tensors than the accused's is not
    the adapter the accused ran (recomputing with it would frame an honest server)."""
    session = Session(lie_from=6, **changes)
    evidence = session.evidence(6)
    if what is None:  # an adapter the judge has: judged with the judge's own name for it
        case = check_evidence(evidence.meta, evidence.tensors, bench())
        assert case.adapter == "chat" and case.disputed.adapter == adapter_tag(CHAT)
        return
    found = rejected(evidence.meta, evidence.tensors)
    assert found.reason is Reason.NOT_JUDGED and what in found.detail


def test_too_large_to_judge(sent, monkeypatch):
    monkeypatch.setattr(ev, "MAX_EVIDENCE_POSITIONS", 7)
    found = rejected(*sent[:2])
    assert found.reason is Reason.NOT_JUDGED and "too large" in found.detail


def test_not_judged_comes_before_forged(sent):
    meta, tensors, _ = sent
    tampered = [tensors[0], tensors[1], tensors[2] + 1.0, tensors[3]]
    assert rejected(meta, tampered, bench(model="other")).reason is Reason.NOT_JUDGED


def forged(meta, tensors) -> str:
    found = rejected(meta, tensors)
    assert found.reason is Reason.FORGED, found
    return found.detail


def test_forged_signature(sent):
    meta, tensors, session = sent
    framed = msgspec.structs.replace(meta, accused=OTHER.peer_id)  # the liar's receipts pinned on another
    assert "not signed by the accused" in forged(framed, tensors)
    fake = receipt_of(OTHER, session.hidden, session.position_ids, None, 5, 1, honest(session.hidden[:, 5:6]))
    receipts = [*session.receipts[:1], fake, *session.receipts[2:4]]
    assert "position 5 is not signed" in forged(meta, [packed(receipts), *tensors[1:]])


def test_forged_tensors(sent):
    meta, tensors, _ = sent
    hidden = tensors[2].clone()
    hidden[0, 6, 3] += 1e-3
    assert "inputs at position 6" in forged(meta, [tensors[0], tensors[1], hidden, tensors[3]])
    assert "output" in forged(meta, [tensors[0], tensors[1] - 0.5, tensors[2], tensors[3]])  # the lie undone
    positions = tensors[3].clone()
    positions[0, 0] = 3
    assert "inputs at position 0" in forged(meta, [*tensors[:3], positions])
    padding = torch.ones(1, 8, dtype=torch.bool)
    assert check_evidence(meta, [*tensors, padding], bench())  # nothing padded: the same as no mask
    padding[0, 0] = False
    assert "inputs at position 0" in forged(meta, [*tensors, padding])  # padding the accused never saw


def test_forged_positions_sessions_and_blocks(sent):
    meta, tensors, session = sent
    gap = [session.receipts[0], *session.receipts[2:4]]
    assert "not contiguous" in forged(msgspec.structs.replace(meta, steps=3), [packed(gap), *tensors[1:]])
    short = session.receipts[:3]  # the receipts end before the inputs do
    assert "cover 7 positions" in forged(msgspec.structs.replace(meta, steps=3), [packed(short), *tensors[1:]])
    other = Session(lie_from=7, session="s-other").receipts
    mixed = [*session.receipts[:2], *other[2:4]]
    assert "mixed sessions" in forged(meta, [packed(mixed), *tensors[1:]])
    moved = [msgspec.structs.replace(r, start=3) for r in session.receipts[:4]]
    assert "blocks 3:4" in forged(msgspec.structs.replace(meta, start=2), [packed(moved), *tensors[1:]])


def test_framing_an_honest_server():
    session = Session()  # honest throughout
    evidence = session.evidence(7)
    case = check_evidence(evidence.meta, evidence.tensors, bench())
    with pytest.raises(Rejected) as caught:
        finding(case, honest(case.hidden), FP32)
    assert caught.value.reason is Reason.FRAMING
    # and within tolerance: rounding noise far below it is no lie either
    with pytest.raises(Rejected):
        finding(case, honest(case.hidden) * (1 + 1e-6), FP32)


def test_the_tolerance_follows_the_signed_codec():
    """A lie of 0.5% is one in fp32, but within what a lossy codec (bf16) rounds to."""
    session = Session(codec=Codec.BF16)
    evidence = session.evidence(7)
    case = check_evidence(evidence.meta, evidence.tensors, bench())
    recomputed = honest(case.hidden) * 1.005
    assert finding(case, recomputed, FP32) == 7
    with pytest.raises(Rejected):
        finding(case, recomputed, tolerance_for(torch.bfloat16))


def test_replays_are_recognised_by_their_signatures_and_the_ledger_is_bounded(sent):
    meta, tensors, _ = sent
    ledger = Ledger(capacity=2)
    first = check_evidence(meta, tensors, bench()).key
    ledger.add(first)
    assert check_evidence(meta, [t.clone() for t in tensors], bench()).key in ledger  # the same evidence again
    other = Session(lie_from=7, seed=1).evidence(7)
    second = check_evidence(other.meta, other.tensors, bench()).key
    assert second != first and second not in ledger
    ledger.add(second)
    ledger.add(b"third")
    assert first not in ledger and second in ledger  # the oldest evicted
    ledger.discard(second)
    assert second not in ledger


# ---- the cache state and how the accused computed (review findings 3 and 5) ----------------------


def evidence_of(receipts: list[Receipt], output: Tensor, hidden: Tensor, position_ids: Tensor):
    meta = EvidenceRequest(model=MODEL, accused=LIAR.peer_id, start=BLOCKS.start, end=BLOCKS.end, steps=len(receipts))
    return meta, [packed(receipts), output, hidden, position_ids]


def test_receipts_from_before_a_rollback_cannot_frame_an_honest_server():
    """An honest server ran [0, 4) on X (r1), [0, 4) again on Y (r2: a rollback to 0), then [4, 5) (r3)
    on the cache holding Y. Every receipt is genuine, so [r1, r3] with X would pass every other check,
    and judges recomputing r3 from X would find it "wrong": r3's state names Y's chain, not X's."""
    generator = torch.Generator().manual_seed(7)
    x, y, last = (torch.randn(1, n, WIDTH, generator=generator) for n in (4, 4, 1))
    on_x, on_y, positions = torch.cat([x, last], 1), torch.cat([y, last], 1), torch.arange(5)[None]
    answer = honest(last) + y.mean()  # what it answered at 4: it depends on the cache (Y)
    r1 = receipt_of(LIAR, on_x, positions, None, 0, 4, honest(x))
    r2 = receipt_of(LIAR, on_y, positions, None, 0, 4, honest(y))
    r3 = receipt_of(LIAR, on_y, positions, None, 4, 1, answer)
    assert r1.state == r2.state == EMPTY_STATE and r3.state != states_of(on_x, positions, None)[64:80]
    meta, tensors = evidence_of([r1, r3], answer, on_x, positions)
    assert "position 4 ran on another cache" in forged(meta, tensors)
    case = check_evidence(meta, tensors, bench(), costly=False)  # the judge's way: the costly checks in parts
    check_part(case, 0, 1)  # r1 alone is fine
    with pytest.raises(Rejected, match="position 4 ran on another cache") as caught:
        check_part(case, 1, 2)  # r3 chained from r1 across a part boundary
    assert caught.value.reason is Reason.FORGED
    meta, tensors = evidence_of([r2, r3], answer, on_y, positions)  # what the cache really held: judged
    case = check_evidence(meta, tensors, bench())
    check_part(case, 1, 2)
    assert case.disputed == r3


def test_a_first_receipt_must_state_the_empty_cache():
    session = Session(lie_from=7)
    evidence = session.evidence(7)
    meta, tensors = evidence.meta, evidence.tensors
    first = receipt_of(LIAR, session.hidden, session.position_ids, None, 0, 5, honest(session.hidden[:, :5]),
                       state=b"\x01" * 16)  # fmt: skip
    receipts = [first, *session.receipts[1:4]]
    assert "position 0 ran on another cache" in forged(meta, [packed(receipts), *tensors[1:]])


def test_an_honest_bf16_server_is_not_convicted_by_an_fp32_judge():
    """A bf16 server answers fp32 hidden states for fp32 inputs; an fp32 judge recomputes in fp32. The
    output's and the judge's dtypes alone would call bf16 rounding a lie; the accused's signed
    ``compute`` makes the judge compare within bf16's tolerance (a real lie still stands out)."""
    generator = torch.Generator().manual_seed(3)
    hidden, positions = torch.randn(1, 8, WIDTH, generator=generator) * 2, torch.arange(8)[None]
    in_bf16 = honest(hidden.bfloat16()).float()  # how the accused computed, answered in fp32
    receipts = [receipt_of(LIAR, hidden, positions, None, start, n, in_bf16[:, start : start + n],
                           compute="bf16/cpu") for start, n in ((0, 5), (5, 1), (6, 1), (7, 1))]  # fmt: skip
    case = check_evidence(*evidence_of(receipts, in_bf16[:, 7:], hidden, positions), bench())
    judge_computes = honest(hidden)  # the fp32 judge's recomputation
    outputs_and_judge_only = tolerance_of(torch.float32, "float32", Codec.RAW, "cpu")
    assert outputs_and_judge_only == FP32 and finding(case, judge_computes, FP32) == 7  # the old rule: framed
    rule = tolerance_of(case.output.dtype, "float32", case.disputed.codec, "cpu", other=case.disputed.compute)
    assert rule == tolerance_for(torch.bfloat16)
    with pytest.raises(Rejected) as caught:
        finding(case, judge_computes, rule)
    assert caught.value.reason is Reason.FRAMING
    lie = in_bf16[:, 7:] + 0.5
    receipts[-1] = receipt_of(LIAR, hidden, positions, None, 7, 1, lie, compute="bf16/cpu")
    assert finding(check_evidence(*evidence_of(receipts, lie, hidden, positions), bench()), judge_computes, rule) == 7
