"""Receipts are held to the swarm's pinned model and to what their server announced (issue 34).

A liar that signs random ``weights`` (the fingerprints of no pinned block), a compute label off the
fixed list (``bf16/zz``) or a listed label other than the one it announced (``bf16/cpu`` from an
``f32/cpu`` server, to buy the bf16 tolerance) is refused by a swarm client at its first step: it is
banned, the answer equals the honest one, and no honest server is banned. Judges hold evidence to the
same: the pinned weights whatever the receipts sign, the announced label whatever they claim.

In process: a 4-block tiny llama, ``[0:2]`` x1 and ``[2:4]`` x2 (one a liar), in one swarm.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import msgspec
import pytest
import torch

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.swarm.records import FINGERPRINT_BYTES, RecordError, State, decode, sign
from shoal.verify.compare import tolerance_of
from shoal.verify.evidence import Announced, Reason, Rejected, check_evidence, finding
from shoal.verify.receipts import (
    COMPUTE_LABELS,
    ReceiptMismatch,
    ReceiptSigner,
    compute_label,
    known_compute,
    verify_receipt,
)
from shoal.wire import Codec
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import connect_over, peer_of, steer_through
from tests.helpers.inprocess import wait_until
from tests.helpers.registry import server_record
from tests.unit.test_evidence import FP32, Session, bench, honest
from tests.unit.test_receipts import KEY, expected_of, signed

pytestmark = pytest.mark.timeout(120)

SWARM_ID = "forged-receipts"
LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
RANDOM_WEIGHTS = bytes(range(16))


class ForgingSigner:
    """A server's real key signing receipts with ``changes`` made first (its own signature: valid)."""

    def __init__(self, real: ReceiptSigner, **changes):
        self.real, self.changes, self.peer_id = real, changes, real.peer_id

    def sign(self, receipt):
        return self.real.sign(msgspec.structs.replace(receipt, **self.changes))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("forged-receipts"), "llama", 0, tokenizer=char_tokenizer())


def prompt() -> torch.Tensor:
    return torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"weights": RANDOM_WEIGHTS}, "weights"),
        ({"compute": "bf16/zz"}, "compute"),
        ({"compute": "bf16/cpu"}, "compute"),
    ],
    ids=["random-weights", "bogus-label", "unannounced-label"],
)
def test_a_swarm_client_refuses_receipts_off_the_pinned_model_or_the_announced_label(model_dir, caplog, changes, field):
    with InProcessSwarm(model_dir, [], swarm=SWARM_ID) as swarm:
        low, good = swarm.add(LOW), swarm.add(HIGH)

        def forge(server):
            server.signer = ForgingSigner(server.signer, **changes)
            return server

        liar = swarm.add(HIGH, forge)
        servers = [low, good, liar]
        table = low.presence.service.table
        wait_until(lambda: len([r for r in table.admitted() if r.state is State.ONLINE]) == 3, 10.0, "all online")
        assert {r.compute for r in table.servers()} == {"f32/cpu"}  # announced in the signed records
        with connect_over(swarm, [good], verify="off") as reference:
            steer_through(reference, [low, good])
            expected = reference.generate(prompt(), max_new_tokens=8, do_sample=False)
        with connect_over(swarm, servers, verify="audit", audit_every=4) as client:
            spans = {s.peer_id: s for s in client.blocks.directory.spans}
            assert spans[peer_of(liar)].info.compute == "f32/cpu" and len(spans[peer_of(liar)].info.fingerprints) == 2
            assert steer_through(client, [low, liar]) == [peer_of(low), peer_of(liar)]
            with caplog.at_level(logging.WARNING, "shoal.client.remote.driver"):
                out = client.generate(prompt(), max_new_tokens=8, do_sample=False)
            assert torch.equal(out, expected)
            assert client.verification.banned == (peer_of(liar),)  # and no honest server
            refused = [r.getMessage() for r in caplog.records if "refused a receipt" in r.getMessage()]
            assert refused and peer_of(liar)[:10] in refused[0] and field in refused[0], refused


def test_compute_labels_come_from_one_fixed_list():
    assert compute_label("float32", "cpu") == "f32/cpu" and compute_label("bfloat16", "cuda:1") == "bf16/cuda"
    assert {"f32/cpu", "bf16/cpu", "f16/cuda", "bf16/cuda", "f32/cuda"} <= COMPUTE_LABELS
    for bogus in ("bf16/zz", "f32/tpu", "f64/cpu", "bf16/cuda:0", ""):
        assert not known_compute(bogus)
    with pytest.raises(ValueError, match="no compute label"):
        compute_label("float32", "meta")
    # a listed label that is not the announced one: refused, so it cannot buy bf16's tolerance
    receipt, sent, output = signed(compute="bf16/cpu")
    with pytest.raises(ReceiptMismatch) as caught:
        verify_receipt(receipt, ReceiptSigner(KEY).peer_id, expected_of(sent, output, compute="f32/cpu"))
    assert caught.value.what == ("compute",)


def test_a_record_announces_its_label_and_one_off_the_list_is_refused():
    fps = (b"\x01" * FINGERPRINT_BYTES, b"\x02" * FINGERPRINT_BYTES)
    key = bytes(range(32))
    peer = ReceiptSigner(key).peer_id
    now = time.time()
    record = dataclasses.replace(server_record(SWARM_ID, peer, "m", (0, 2), fps, now, 60.0), compute="bf16/cuda")
    assert decode(sign(record, key).data).record.compute == "bf16/cuda"
    plain = server_record(SWARM_ID, peer, "m", (0, 2), fps, now, 60.0)
    assert decode(sign(plain, key).data).record.compute == ""  # a server predating the field
    with pytest.raises(RecordError):
        decode(sign(dataclasses.replace(record, compute="bf16/zz"), key).data)


def test_judges_hold_evidence_to_the_pinned_weights_and_the_announced_label():
    """Receipts signing random weights: outside a swarm nobody can say what they should be
    (``not_judged``); in one, the judge recomputes with the pinned weights and convicts. A liar
    signing bf16 while announcing f32 is judged at f32's tolerance."""
    session = Session(lie_from=7, weights=RANDOM_WEIGHTS, compute="bf16/cpu")
    evidence = session.evidence(7)
    with pytest.raises(Rejected) as caught:
        check_evidence(evidence.meta, evidence.tensors, bench())
    assert caught.value.reason is Reason.NOT_JUDGED
    judge = bench()
    pinned = Announced(judge.weights(BlockRange(2, 4)), "f32/cpu")
    case = check_evidence(evidence.meta, evidence.tensors, judge, announced=pinned)
    assert case.compute == "f32/cpu"  # not the receipts' bf16
    assert tolerance_of(torch.float32, "float32", Codec.RAW, other=case.compute) == FP32
    assert finding(case, honest(case.hidden), FP32) == 7
    other_format = Announced(b"\x00" * 16, "f32/cpu")  # announces another quantization than the judge's
    with pytest.raises(Rejected) as caught:
        check_evidence(evidence.meta, evidence.tensors, judge, announced=other_format)
    assert caught.value.reason is Reason.NOT_JUDGED
