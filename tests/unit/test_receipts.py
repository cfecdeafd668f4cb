"""Signed step receipts (:mod:`shoal.verify.receipts`): what a signature covers, what the digests
name, and what each failed check raises. Pure: no server, no network."""

from __future__ import annotations

import msgspec
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.errors import ShoalError
from shoal.verify.receipts import (
    SIGNING_CONTEXT,
    BadSignature,
    Equivocation,
    MissingReceipt,
    Receipt,
    ReceiptError,
    ReceiptMismatch,
    ReceiptSigner,
    adapter_tag,
    compute_label,
    expected_receipt,
    known_compute,
    receipt_body,
    sign_receipt,
    signed_by,
    tensor_digest,
    verify_receipt,
    weights_digest,
)

pytestmark = pytest.mark.timeout(30)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
FINGERPRINTS = ("ab" * 32, "cd" * 32)
HIDDEN = 576  # SmolLM2's width


def inputs(n: int = 1, seed: int = 0, width: int = HIDDEN) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, width, generator=generator), torch.arange(7, 7 + n)[None]]


def signed(signer: ReceiptSigner | None = None, **changes) -> tuple[Receipt, list[torch.Tensor], torch.Tensor]:
    sent, output = inputs(), torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(9))
    fields = dict(
        weights=weights_digest(FINGERPRINTS, "none"),
        start=2,
        end=4,
        session="0123456789abcdef",
        position=7,
        step=12,
        inputs=sent,
        output=output,
        compute="f32/cpu",
    )
    fields.update(changes)
    return sign_receipt(signer or ReceiptSigner(KEY), **fields), sent, output


def expected_of(sent, output, **changes) -> Receipt:
    fields = dict(
        start=2, end=4, fingerprints=FINGERPRINTS, quantization="none", session="0123456789abcdef",
        position=7, step=12, sent=sent, output=output,
    )  # fmt: skip
    fields.update(changes)
    return expected_receipt(**fields)


def test_a_receipt_verifies_against_what_was_asked_and_received_and_fits_in_200_bytes():
    signer = ReceiptSigner(KEY)
    receipt, sent, output = signed(signer)
    assert signer.peer_id == Ed25519PrivateKey.from_private_bytes(KEY).public_key().public_bytes_raw().hex()
    assert verify_receipt(receipt, signer.peer_id, expected_of(sent, output)) is receipt
    assert (receipt.n, len(receipt.inputs), len(receipt.outputs), len(receipt.signature)) == (1, 16, 16, 64)
    encoded = msgspec.msgpack.encode(receipt)
    assert len(encoded) <= 200, len(encoded)
    assert msgspec.msgpack.decode(encoded, type=Receipt) == receipt  # an array, strictly typed


@pytest.mark.parametrize(
    "field, value",
    [
        ("weights", b"\x00" * 16),
        ("start", 0),
        ("end", 5),
        ("session", "fedcba9876543210"),
        ("position", 8),
        ("n", 2),
        ("step", 13),
        ("inputs", b"\x01" * 16),
        ("outputs", b"\x02" * 16),
        ("adapter", b"\x03" * 16),
        ("prompts", True),
        ("state", b"\x04" * 16),
        ("compute", "bf16/cpu"),
    ],
)
def test_tampering_with_any_field_breaks_the_signature(field, value):
    receipt, _, _ = signed()
    peer = ReceiptSigner(KEY).peer_id
    assert signed_by(receipt, peer)
    forged = msgspec.structs.replace(receipt, **{field: value})
    assert not signed_by(forged, peer)
    with pytest.raises(BadSignature, match="not signed by the server's key") as caught:
        verify_receipt(forged, peer, expected_of(*signed()[1:]))
    assert caught.value.peer == peer and caught.value.what == ("signature",)


def test_a_flipped_signature_bit_or_another_key_fails():
    receipt, sent, output = signed()
    peer = ReceiptSigner(KEY).peer_id
    flipped = bytearray(receipt.signature)
    flipped[10] ^= 1
    assert not signed_by(msgspec.structs.replace(receipt, signature=bytes(flipped)), peer)
    by_other, _, _ = signed(ReceiptSigner(OTHER_KEY))
    assert signed_by(by_other, ReceiptSigner(OTHER_KEY).peer_id)
    with pytest.raises(BadSignature):
        verify_receipt(by_other, peer, expected_of(sent, output))  # valid, but not this server's
    assert not signed_by(receipt, "zz" * 32)  # not a key at all: refused, not an exception


def test_the_signature_is_domain_separated():
    """The same key signing the same bytes without the receipt context (a record, anything else)
    does not make a receipt."""
    receipt, _, _ = signed()
    key = Ed25519PrivateKey.from_private_bytes(KEY)
    bare = msgspec.structs.replace(receipt, signature=key.sign(receipt_body(receipt)))
    assert not signed_by(bare, ReceiptSigner(KEY).peer_id)
    assert SIGNING_CONTEXT == b"shoal/receipt/1\0"
    with_context = msgspec.structs.replace(receipt, signature=key.sign(SIGNING_CONTEXT + receipt_body(receipt)))
    assert with_context == receipt  # ed25519 is deterministic: the signer signs exactly this


def test_tensor_digest_names_values_dtype_shape_count_and_order():
    x, positions = inputs(3)
    base = tensor_digest([x, positions])
    assert len(base) == 16
    assert tensor_digest([x.clone(), positions.clone()]) == base
    assert tensor_digest([x.transpose(0, 1).contiguous().transpose(0, 1), positions]) == base  # layout is not data
    bumped = x.clone()
    bumped[0, 1, 5] = torch.nextafter(bumped[0, 1, 5], torch.tensor(float("inf")))  # one ulp
    different = [
        [bumped, positions],
        [x.to(torch.float64), positions],
        [x.reshape(1, 1, 3 * HIDDEN), positions],
        [x, positions.to(torch.int32)],
        [positions, x],
        [x],
        [x, positions, torch.ones(1, 3, dtype=torch.bool)],
    ]
    digests = {tensor_digest(tensors) for tensors in different}
    assert len(digests) == len(different) and base not in digests
    assert tensor_digest([x.to(torch.bfloat16)]) != tensor_digest([x.to(torch.float16)])  # bf16 digests too


def test_each_failed_check_names_what_did_not_match():
    receipt, sent, output = signed()
    peer = ReceiptSigner(KEY).peer_id
    with pytest.raises(ReceiptMismatch, match=r"position 7 \(expected 8\)") as caught:
        verify_receipt(receipt, peer, expected_of(sent, output, position=8), hop=1)
    assert caught.value.what == ("position",) and caught.value.hop == 1 and str(caught.value).startswith("hop 1 ")
    other_output = output + 1
    with pytest.raises(ReceiptMismatch) as caught:
        verify_receipt(receipt, peer, expected_of(sent, other_output, step=3, session="s"), hop=0)
    assert caught.value.what == ("session", "step", "outputs")
    with pytest.raises(MissingReceipt, match="got none"):
        verify_receipt(None, peer, expected_of(sent, output))
    unknown_weights = expected_of(sent, output, fingerprints=())  # routing does not know them: not compared
    assert verify_receipt(receipt, peer, unknown_weights) is receipt
    with pytest.raises(ReceiptMismatch) as caught:
        verify_receipt(receipt, peer, expected_of(sent, output, quantization="nf4"))
    assert caught.value.what == ("weights",)
    assert issubclass(ReceiptError, ShoalError)


def test_other_inputs_on_a_pushed_hop_blame_the_server_before_it():
    """Hop 2 was pushed its inputs by hop 1, whose reply the client holds: a receipt of other
    inputs is hop 1's equivocation (the witness is hop 2)."""
    receipt, sent, output = signed()
    witness = ReceiptSigner(KEY).peer_id
    previous = "ee" * 32
    what_the_client_got = [sent[0] * 1.01, sent[1]]
    with pytest.raises(Equivocation) as caught:
        verify_receipt(receipt, witness, expected_of(what_the_client_got, output), hop=2, previous=previous)
    error = caught.value
    assert (error.peer, error.hop, error.witness, error.what) == (previous, 1, witness, ("inputs",))
    with pytest.raises(ReceiptMismatch) as caught:  # not pushed: the server itself signed other inputs
        verify_receipt(receipt, witness, expected_of(what_the_client_got, output), hop=2)
    assert caught.value.peer == witness and caught.value.what == ("inputs",)


def test_strict_decoding_refuses_a_malformed_receipt():
    receipt, _, _ = signed()
    fields = list(msgspec.structs.astuple(receipt))
    bad_fields = [(0, b"short"), (7, b"\x00" * 17), (9, b"\x00" * 63), (4, -1), (10, b"\x00" * 17), (10, "chat"),
                  (12, b"\x00" * 15), (13, "x" * 25), (14, b"\x00" * 63)]  # fmt: skip
    for index, bad in bad_fields:
        wrong = list(fields)
        wrong[index] = bad
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(wrong), type=Receipt)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode([*fields, 1]), type=Receipt)


def test_the_client_compares_adapter_digest_compute_and_the_cache_state_it_knows():
    """The rules of verify_receipt for ``adapter`` (the announced digest), ``compute`` (a known label;
    the announced dtype; then the session's first label exactly) and ``state`` (the client's chain at
    the step's position, when it states one)."""
    chat = adapter_tag("c1" * 32)
    assert chat == bytes.fromhex("c1" * 16) and adapter_tag(None) == b"" and adapter_tag("") == b""
    assert compute_label("bfloat16", "cuda:1") == "bf16/cuda" and compute_label("float32", "cpu") == "f32/cpu"
    receipt, sent, output = signed(adapter=chat, state=b"\x07" * 16, compute="bf16/cuda")
    peer = ReceiptSigner(KEY).peer_id
    assert verify_receipt(receipt, peer, expected_of(sent, output, adapter=chat, dtype="bfloat16")) is receipt
    assert verify_receipt(receipt, peer, expected_of(sent, output, adapter=chat)) is receipt  # dtype not known
    assert expected_of(sent, output).state == b""  # state not known (None): not compared
    assert verify_receipt(receipt, peer, expected_of(sent, output, adapter=chat, state=b"\x07" * 16)) is receipt
    with pytest.raises(ReceiptMismatch, match="state 0707") as caught:  # not the chain of what the client sent
        verify_receipt(receipt, peer, expected_of(sent, output, adapter=chat, state=bytes(16)))
    assert caught.value.what == ("state",)
    with pytest.raises(ReceiptMismatch) as caught:  # a server announcing fp32 that signs bf16 (or computes it)
        verify_receipt(receipt, peer, expected_of(sent, output, adapter=chat, dtype="float32"))
    assert caught.value.what == ("compute",)
    assert verify_receipt(receipt, peer, expected_of(sent, output, adapter=chat, compute="bf16/cuda")) is receipt
    for first in ("bf16/cpu", "f32/cuda"):  # the session's first receipt said otherwise: another device or dtype
        with pytest.raises(ReceiptMismatch) as caught:
            verify_receipt(receipt, peer, expected_of(sent, output, adapter=chat, dtype="bfloat16", compute=first))
        assert caught.value.what == ("compute",)
    with pytest.raises(ReceiptMismatch) as caught:  # another adapter than the one the server announced
        verify_receipt(receipt, peer, expected_of(sent, output, adapter=adapter_tag("c2" * 32), dtype="bfloat16"))
    assert caught.value.what == ("adapter",)
    with pytest.raises(ReceiptMismatch) as caught:  # ran with an adapter, none was asked for
        verify_receipt(receipt, peer, expected_of(sent, output))
    assert caught.value.what == ("adapter",)


@pytest.mark.parametrize(
    "compute", ["", "f32", "f32/", "bf16/TPU", "float32/cpu", "f64/cpu", "/cpu", "f32/cpu/x", "bf16/zz", "f32/tpu"]
)
def test_a_compute_label_judges_do_not_know_is_refused_whatever_was_expected(compute):
    """Judges reject evidence with such a ``compute`` as forged (a liar would pick its tolerance), so a
    client accepting one could never get its liar convicted: it is a mismatch even when nothing is known."""
    assert not known_compute(compute)
    receipt, sent, output = signed(compute=compute)
    for expected in (expected_of(sent, output), expected_of(sent, output, dtype="float32")):
        with pytest.raises(ReceiptMismatch) as caught:
            verify_receipt(receipt, ReceiptSigner(KEY).peer_id, expected)
        assert caught.value.what == ("compute",)
    devices = ("cpu", "cuda", "mps", "xpu", "hpu", "npu")  # the fixed list's device types
    assert all(known_compute(f"{dtype}/{device}") for dtype in ("f32", "bf16", "f16") for device in devices)
