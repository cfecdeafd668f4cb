"""The cache-state chain receipts commit to (:mod:`shoal.verify.state`), the judge's tolerance of how the
accused computed (:func:`shoal.verify.compare.tolerance_of`) and its refusal of a ``compute`` no honest server
signs. Pure: no server."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

import shoal.verify.state as state_module
from shoal.verify.compare import tolerance_for, tolerance_of
from shoal.verify.evidence import Reason, Rejected, check_evidence
from shoal.verify.state import EMPTY_STATE, UNKNOWN_STATE, StateChain, chain_states, states_of, step_states
from shoal.wire import Codec
from tests.unit.test_evidence import Session, bench

pytestmark = pytest.mark.timeout(30)

WIDTH = 8


def inputs(batch: int = 1, n: int = 5, seed: int = 0, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, WIDTH, generator=generator), torch.arange(start, start + n).repeat(batch, 1)


def test_the_chain_is_the_documented_sha256_over_each_positions_rows_ids_and_mask():
    hidden, positions = inputs(batch=2, n=2)
    mask = torch.tensor([[False, True], [True, True]])
    c0 = hashlib.sha256(b"shoal/state/1\0").digest()[:16]
    assert c0 == EMPTY_STATE
    c1 = hashlib.sha256(c0 + hidden[:, 0].numpy().tobytes() + positions[:, 0].numpy().tobytes() + bytes([0, 1]))
    c2 = hashlib.sha256(c1.digest()[:16] + hidden[:, 1].numpy().tobytes() + positions[:, 1].numpy().tobytes()
                        + bytes([1, 1]))  # fmt: skip
    assert chain_states(EMPTY_STATE, hidden, positions, mask) == c1.digest()[:16] + c2.digest()[:16]
    assert states_of(hidden, positions, mask) == EMPTY_STATE + c1.digest()[:16] + c2.digest()[:16]


def test_no_mask_is_a_mask_of_ones_and_every_input_byte_counts():
    hidden, positions = inputs(batch=3)
    base = states_of(hidden, positions, None)
    assert len(base) == 16 * 6
    assert states_of(hidden, positions, torch.ones(3, 5, dtype=torch.bool)) == base
    assert states_of(hidden.transpose(0, 1).contiguous().transpose(0, 1), positions, None) == base  # layout is no data
    bumped = hidden.clone()
    bumped[2, 3, 7] = torch.nextafter(bumped[2, 3, 7], torch.tensor(float("inf")))  # one ulp, the last row
    changed = states_of(bumped, positions, None)
    assert changed[: 16 * 4] == base[: 16 * 4] and changed[16 * 4 :] != base[16 * 4 :]  # from position 3 on
    moved = positions.clone()
    moved[1, 0] = 9
    assert states_of(hidden, moved, None)[16:32] != base[16:32]
    padded = torch.ones(3, 5, dtype=torch.bool)
    padded[0, 0] = False
    assert states_of(hidden, positions, padded)[16:32] != base[16:32]
    half = states_of(hidden.to(torch.bfloat16), positions, None)  # bf16 hashes too (numpy has no bf16)
    assert len(half) == len(base) and half != base


def test_a_step_at_a_time_chains_like_one_prefill():
    hidden, positions = inputs(batch=2, n=6)
    whole = states_of(hidden, positions, None)
    chain = StateChain()
    for start, n in ((0, 3), (3, 1), (4, 2)):
        step = chain.next_states(start, hidden[:, start : start + n], positions[:, start : start + n], None)
        chain.commit(start, step)
    assert len(chain) == 6 and all(chain.at(p) == whole[16 * p : 16 * p + 16] for p in range(7))


def test_the_chain_truncates_on_rollback_and_a_resent_step_rewrites_it():
    """A server's chain after steps [0, 4) on X, then [0, 4) again on Y (a rollback to 0), then [4, 5):
    position 4's state is Y's, never X's; a rollback into a step cuts the chain there."""
    x, positions = inputs(n=5, seed=1)
    y, _ = inputs(n=5, seed=2)
    chain = StateChain()
    chain.commit(0, chain.next_states(0, x[:, :4], positions[:, :4], None))
    on_x = chain.at(4)
    assert on_x == states_of(x[:, :4], positions[:, :4], None)[-16:]
    assert chain.next_states(0, y[:, :4], positions[:, :4], None)  # pure: nothing committed yet
    assert chain.at(4) == on_x
    chain.commit(0, chain.next_states(0, y[:, :4], positions[:, :4], None))
    chain.commit(4, chain.next_states(4, y[:, 4:], positions[:, 4:], None))
    assert chain.at(4) == states_of(y[:, :4], positions[:, :4], None)[-16:] != on_x
    assert chain.at(5) == states_of(y, positions, None)[-16:]
    chain.commit(2, chain.next_states(2, x[:, 2:3], positions[:, 2:3], None))  # back to 2, one position of X
    mixed = torch.cat([y[:, :2], x[:, 2:3]], 1)
    assert len(chain) == 3 and chain.at(3) == states_of(mixed, positions[:, :3], None)[-16:]
    assert chain.at(0) == EMPTY_STATE


def test_positions_the_server_lost_track_of_have_no_chain_state():
    hidden, positions = inputs(n=4)
    chain = StateChain()
    chain.commit(0, chain.next_states(0, hidden, positions, None))
    chain.forget(2)  # a step at 2 failed midway: the cache from 2 on is in no known state
    assert len(chain) == 2 and chain.at(2) == states_of(hidden[:, :2], positions[:, :2], None)[-16:]
    assert chain.at(3) == UNKNOWN_STATE and chain.next_states(3, hidden[:, 3:], positions[:, 3:], None)
    chain.commit(3, chain.next_states(3, hidden[:, 3:], positions[:, 3:], None))  # a step past the gap
    assert len(chain) == 4 and chain.at(3) == UNKNOWN_STATE and chain.at(4) != states_of(hidden, positions, None)[-16:]
    with pytest.raises(ValueError, match="16 bytes"):
        chain_states(b"short", hidden, positions, None)
    with pytest.raises(IndexError):
        chain.at(-1)


def test_the_tolerance_is_the_coarsest_of_both_sides_and_widens_across_devices():
    fp32, bf16 = tolerance_for(torch.float32), tolerance_for(torch.bfloat16)
    judge = dict(wire=torch.float32, computed="float32", codec=Codec.RAW, device="cpu")
    assert tolerance_of(**judge) == tolerance_of(**judge, other="f32/cpu") == fp32
    assert tolerance_of(**judge, other="bf16/cpu") == bf16  # an honest bf16 server's fp32 outputs
    assert tolerance_of(**judge, other="float16/cpu") == tolerance_for(torch.float16)
    across = tolerance_of(**judge, other="f32/cuda")
    assert across.relative == pytest.approx(2 * fp32.relative)  # the uncalibrated-device margin
    assert tolerance_of(**judge, other="bf16/cuda").relative == pytest.approx(2 * bf16.relative)
    on_gpu = dict(judge, device="cuda:0")
    assert tolerance_of(**on_gpu, other="f32/cuda") == tolerance_for(torch.float32, "cuda")  # margin once
    assert tolerance_of(**on_gpu, other="f32/cpu").relative == pytest.approx(2 * fp32.relative)
    for unknown in ("", "float64/cpu", "__dict__", "int8", "/cpu", "f32/TPU", "f32/cuda:0", "f32/"):
        assert tolerance_of(**judge, other=unknown) == fp32  # nothing looser than what is known
    for device in ("mps", "xpu", "cuda", "hpu"):  # a listed device type (COMPUTE_LABELS): the margin (at most 2x)
        assert tolerance_of(**judge, other=f"f32/{device}").relative == pytest.approx(2 * fp32.relative)
    assert tolerance_of(**judge, other="f32/tpu") == fp32  # not on the fixed list: loosens nothing


@pytest.mark.parametrize("compute", ["f32/TPU", "bf16/cuda:0", "float64/cpu", "", "f32"])
def test_evidence_signed_with_an_unknown_compute_is_forged(compute):
    """A liar signing a device type or dtype no honest server names would choose its own tolerance: its
    evidence is forged at the judge (clients refuse such receipts, so honest evidence never has one)."""
    session = Session(lie_from=7, compute=compute)
    evidence = session.evidence(7)
    with pytest.raises(Rejected) as caught:
        check_evidence(evidence.meta, evidence.tensors, bench())
    assert caught.value.reason is Reason.FORGED and "unknown compute" in caught.value.detail
    honest = Session(lie_from=7, compute="bf16/xpu").evidence(7)  # known: judged
    assert check_evidence(honest.meta, honest.tensors, bench()).disputed.compute == "bf16/xpu"


@pytest.mark.parametrize("n, threaded", [(3, False), (64, True)])
def test_step_states_hashes_large_steps_on_a_worker_and_reads_the_chain_first(monkeypatch, n, threaded):
    """What :func:`step_states` returns is :meth:`StateChain.next_states`'s, inline or on a worker thread
    (a step over ``HASH_INLINE_BYTES``, here shrunk); the chain's state at the position is read before a
    worker starts, so a commit meanwhile does not change the answer."""
    monkeypatch.setattr(state_module, "HASH_INLINE_BYTES", 1024)  # 3 x 8 fp32 = 96 bytes inline, 64 x 8 not
    workers: list[str] = []
    to_thread = asyncio.to_thread

    async def spied(function, *args):
        workers.append(function.__name__)
        return await to_thread(function, *args)

    monkeypatch.setattr(state_module.asyncio, "to_thread", spied)
    hidden, positions = inputs(batch=2, n=n + 4, seed=5)
    mask = torch.ones(2, n + 4, dtype=torch.bool)
    mask[1, :2] = False
    chain = StateChain()
    chain.commit(0, chain.next_states(0, hidden[:, :4], positions[:, :4], mask[:, :4]))
    expected = chain.next_states(4, hidden[:, 4:], positions[:, 4:], mask)

    async def run() -> bytes:
        pending = asyncio.ensure_future(step_states(chain, 4, hidden[:, 4:], positions[:, 4:], mask))
        await asyncio.sleep(0)  # the step has started (read c_4, maybe handed off to the worker)
        chain.commit(0, chain.next_states(0, hidden[:, :1] + 1, positions[:, :1], mask[:, :1]))  # c_4 now gone
        return await pending

    assert asyncio.run(run()) == expected and len(expected) == 16 * n
    assert workers == (["chain_states"] if threaded else [])
