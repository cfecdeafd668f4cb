"""Audit mode's decisions and its rounds (shoal.client.verification: audit, auditors, repair).

The pure parts alone: when an audit is due, the majority rule, the tolerance a comparison gets, what a
new hop's track inherits, where a repaired generation resumes, what a streamer holding tokens back
lets through. The rounds over stand-in servers, and a real swarm: ``test_audit_rounds.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from shoal.client import AutoDistributedModelForCausalLM
from shoal.client.remote.history import SpanHistory
from shoal.client.verification.audit import (
    Caught,
    Track,
    Verdict,
    Verification,
    audit_due,
    check_verify,
    majority,
    successor,
    take_spare,
    tolerance_of,
    verification_for,
)
from shoal.client.verification.repair import HeldStreamer, _as_one_run, resume_length
from shoal.errors import UsageError
from shoal.ids import BlockRange, PeerId
from shoal.verify.compare import tolerance_for
from shoal.wire import Codec
from shoal.wire.schema import Receipt
from tests.helpers.audits import HIDDEN, SPAN, FakeHop, span_of

pytestmark = pytest.mark.timeout(60)


# ---- pure decisions -------------------------------------------------------------------------------


def test_verify_modes():
    assert check_verify("off", 8) == "off" and check_verify("audit", 1) == "audit"
    assert check_verify("redundant") == check_verify("redundant", 1) == "redundant"
    with pytest.raises(UsageError, match=r"redundant.*checks every step: audit_every=8 contradicts it"):
        check_verify("redundant", 8)
    with pytest.raises(UsageError, match="one of 'off', 'audit', 'redundant'"):
        check_verify("paranoid", 8)
    with pytest.raises(UsageError, match="audit_every"):
        check_verify("audit", 0)


def test_each_mode_audits_at_its_own_period():
    """Audit mode every ``audit_every`` (16 unless given: bench.verify's pick), redundant every step; both audit."""
    assert verification_for("audit") == Verification("audit", 16)
    assert verification_for("audit", 3) == Verification("audit", 3)
    redundant = verification_for("redundant")
    assert (redundant.mode, redundant.audit_every) == ("redundant", 1) and redundant.auditing and redundant.redundant
    assert not verification_for("audit").redundant and not verification_for("off").auditing


def test_from_pretrained_refuses_contradictory_verify_arguments_before_any_io():
    with pytest.raises(UsageError, match="audit_every=4 contradicts"):
        AutoDistributedModelForCausalLM.from_pretrained("no-such-model", [], verify="redundant", audit_every=4)
    with pytest.raises(UsageError, match="one of"):
        AutoDistributedModelForCausalLM.from_pretrained("no-such-model", [], verify="always")


def test_a_conviction_is_recorded_with_where_it_was_caught():
    verification = Verification("redundant", 1)
    verification.convicted(PeerId("liar"), SPAN, 17)
    verification.convicted(PeerId("other"))  # convicted without a comparison's position: counted, not placed
    assert verification.bans == 2 and verification.banned == ("liar", "other")
    assert verification.caught == (Caught(PeerId("liar"), SPAN, 17),)


def test_an_audit_is_due_every_k_positions():
    assert [p for p in range(0, 30) if audit_due(12, p, 8)] == list(range(20, 30))
    assert audit_due(0, 12, 8)  # a prompt longer than K is audited at once
    assert not audit_due(5, 5, 1)


def test_majority_names_the_one_the_third_disagrees_with():
    assert majority(audited_vs_third=0, auditor_vs_third=None) is Verdict.AUDITED
    assert majority(audited_vs_third=None, auditor_vs_third=3) is Verdict.AUDITOR
    assert majority(audited_vs_third=0, auditor_vs_third=0) is Verdict.UNSETTLED  # three different answers
    assert majority(audited_vs_third=None, auditor_vs_third=None) is Verdict.UNSETTLED  # it sits between both


def test_tolerance_is_the_coarsest_of_wire_compute_and_codec():
    fp32, bf16 = tolerance_for(torch.float32), tolerance_for(torch.bfloat16)
    assert tolerance_of(torch.float32, "float32", Codec.RAW) == fp32
    assert tolerance_of(torch.float32, None, Codec.RAW) == fp32
    assert tolerance_of(torch.float32, "bfloat16", Codec.RAW) == bf16  # servers computing in bf16
    assert tolerance_of(torch.float32, "float32", Codec.Q8) == bf16  # a lossy codec on the wire
    assert tolerance_of(torch.bfloat16, "float32", Codec.RAW) == bf16
    assert tolerance_of(torch.float16, None, Codec.RAW) == tolerance_for(torch.float16)


def test_a_repair_resumes_after_the_token_at_the_lie_or_from_the_prompt():
    assert resume_length(lie_position=20, prefix=0, prompt_length=12) == 21  # ids [0, 20]: the token AT 20 stands
    assert resume_length(lie_position=12, prefix=0, prompt_length=12) == 13
    assert resume_length(lie_position=5, prefix=0, prompt_length=12) == 12  # inside the prompt: all of it
    assert resume_length(lie_position=2, prefix=4, prompt_length=12) == 12  # inside trained prompts
    assert resume_length(lie_position=24, prefix=4, prompt_length=12) == 21  # session positions count the prefix


def test_a_new_hop_inherits_what_the_old_one_left_unaudited():
    old = Track(FakeHop(span_of("old")), audited=16, since=0)
    new = successor(FakeHop(span_of("new")), [old], position=20, adopted=False)
    assert (new.audited, new.since, new.before) == (16, 20, "old")
    assert (new.producer(17), new.producer(20)) == ("old", "new")
    wider = Track(FakeHop(span_of("wide", BlockRange(0, 4))), audited=12)
    part = successor(FakeHop(span_of("part", BlockRange(2, 4))), [wider], position=20, adopted=False)
    assert (part.audited, part.since, part.before) == (12, 20, None)  # no one server to blame before 20
    fresh = successor(FakeHop(span_of("fresh")), [old], position=20, adopted=True)
    assert (fresh.audited, fresh.since) == (0, 0)  # its replay's output is the history now: all its own
    first = successor(FakeHop(span_of("first")), [], position=0, adopted=False)
    assert (first.audited, first.since, first.before) == (0, 0, None)


def test_a_spare_auditor_never_audits_its_own_server_nor_a_banned_one():
    hop = FakeHop(span_of("a"))
    same, banned, good = FakeHop(span_of("a")), FakeHop(span_of("x")), FakeHop(span_of("b"))
    other_blocks = FakeHop(span_of("c", BlockRange(2, 4)))
    spare = [same, banned, other_blocks, good]
    assert take_spare(spare, hop, banned={"x"}) is good and spare == [same, banned, other_blocks]
    assert take_spare(spare, hop, banned={"x"}) is None


def test_a_held_streamer_passes_only_audited_tokens_and_the_prompt_once():
    seen: list[list[int]] = []
    frontier = {"at": 0}

    class Collect:
        ended = 0

        def put(self, value: Tensor) -> None:
            seen.append(value.flatten().tolist())

        def end(self) -> None:
            Collect.ended += 1

    inner = Collect()
    held = HeldStreamer(inner, hold_back=True, frontier=lambda: frontier["at"])
    held.put(torch.tensor([[1, 2, 3]]))  # the prompt, positions 0-2
    for token in (10, 11, 12):  # positions 3, 4, 5
        held.put(torch.tensor([token]))
    assert seen == [[1, 2, 3]]  # nothing audited past the prompt yet
    frontier["at"] = 4  # positions [0, 4) audited: tokens at <= 4 stand
    held.put(torch.tensor([13]))  # position 6
    assert seen == [[1, 2, 3], [10], [11]]
    held.end()  # generate's own end: deferred
    held.restart(5)  # a lie at 4: ids [0, 5) stand, the held 12 and 13 are dropped
    held.put(torch.tensor([[1, 2, 3, 10, 11]]))  # the repaired attempt's prompt: swallowed
    held.put(torch.tensor([20]))  # position 5 again
    assert seen == [[1, 2, 3], [10], [11]] and inner.ended == 0
    held.finish()
    assert seen == [[1, 2, 3], [10], [11], [20]] and inner.ended == 1

    seen.clear()
    passing = HeldStreamer(inner, hold_back=False, frontier=lambda: 0)
    passing.put(torch.tensor([[1, 2]]))
    passing.put(torch.tensor([7]))
    passing.restart(3)
    passing.put(torch.tensor([[1, 2, 7]]))
    passing.put(torch.tensor([8]))
    assert seen == [[1, 2], [7], [8]]  # without hold-back: every attempt's new tokens, the prompt once


def test_one_run_pads_rows_that_ended_before_a_repair_and_ends_with_the_last():
    config = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    prompt = torch.tensor([[7, 7], [8, 8]])
    out = torch.tensor([[7, 7, 5, 2, 9, 9], [8, 8, 6, 6, 2, 4]])  # row 0 went on after its EOS
    assert _as_one_run(out, prompt, config).tolist() == [[7, 7, 5, 2, 0], [8, 8, 6, 6, 2]]
    unfinished = torch.tensor([[7, 7, 5, 2, 9, 9], [8, 8, 6, 6, 6, 4]])
    assert torch.equal(_as_one_run(unfinished, prompt, config), unfinished)  # a row still running: unchanged


def test_the_history_keeps_receipts_and_forgets_those_past_a_rollback():
    def receipt(position: int, n: int) -> Receipt:
        zero = bytes(16)
        return Receipt(zero, 0, 2, "s", position, n, position + 1, zero, zero, Codec.RAW, b"", False, zero,
                       "f32/cpu", bytes(64))  # fmt: skip

    history = SpanHistory(batch_size=1)
    for position, n in ((0, 6), (6, 1), (7, 1)):
        inputs = {0: torch.zeros(1, n, HIDDEN), 2: torch.ones(1, n, HIDDEN)}
        positions = torch.arange(position, position + n)[None]
        history.record(inputs, frozenset({0, 2}), positions, None, position + n, {0: receipt(position, n)})
    assert [(r.position, r.n) for r in history.receipts(0)] == [(0, 6), (6, 1), (7, 1)] and history.receipts(2) == []
    history.truncate(7)
    assert [(r.position, r.n) for r in history.receipts(0)] == [(0, 6), (6, 1)]
    window = history.window(0, 6, 7)
    assert len(window) == 2 and window[1].tolist() == [[6]] and history.hidden(2, 0, 7).shape == (1, 7, HIDDEN)
