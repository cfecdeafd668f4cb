"""Concurrent sessions through a 2-server swarm run in batches and each get exactly its solo tokens.

A tiny random llama (4 blocks, :mod:`testkit.tiny`, whose large init keeps greedy choices far from
ties) served as ``[0:2]`` and ``[2:4]`` by an :class:`~shoal.launch.InProcessSwarm`. Four clients, each
on a thread of its own, generate greedily at once: different prompt lengths, batch sizes (one
left-padded) and so different ``max_length``\\ s. Each one's tokens equal local transformers' exactly
and its logits are within 1e-4. The first server's batched forward is slowed by 30 ms (a wrapper
here, in the test), so steps that arrive while it runs must wait and share the next forward: the
counters show forwards that carried more than one session's step.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.models.packed import PackedLinear
from testkit.tiny import tiny_checkpoint
from tests.helpers.parity import left_padded

pytestmark = pytest.mark.timeout(120)

ATOL = 1e-4
SLOW_FORWARD_S = 0.03
#: (prompt rows, new tokens): one row of 5, two left-padded rows (7 and 12), three rows of 3, one row of 20
RUNS = [
    ([list(range(10, 15))], 20),
    ([list(range(30, 37)), list(range(40, 52))], 12),
    ([[3, 4, 5], [6, 7, 8], [9, 10, 11]], 16),
    ([list(range(60, 80))], 8),
]


def generate(model, rows: list[list[int]], new_tokens: int):
    ids, mask = left_padded(rows)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)  # fmt: skip


def slowed(span) -> None:
    """The span's batched forward, ``SLOW_FORWARD_S`` slower (the compute thread stays busy)."""
    forward_steps = span.forward_steps

    def slow(steps):
        time.sleep(SLOW_FORWARD_S)
        return forward_steps(steps)

    span.forward_steps = slow


@pytest.mark.parametrize("packed", [False, True], ids=["plain-weights", "packed-weights"])
def test_concurrent_sessions_through_two_servers_are_batched_and_equal_their_solo_runs(tmp_path, packed):
    """Also with ``--packed-weights`` (:mod:`shoal.models.packed`): batched decode steps through
    oneDNN's layout, the same tokens, logits within the same 1e-4."""
    checkpoint = tiny_checkpoint(tmp_path / "tiny", "llama", seed=0)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [generate(reference, rows, n) for rows, n in RUNS]
    with InProcessSwarm(checkpoint, [BlockRange(0, 2), BlockRange(2, 4)], packed_weights=packed) as swarm:
        first = swarm.server(BlockRange(0, 2)).server.backend
        assert any(isinstance(m, PackedLinear) for m in first.span.modules()) == packed
        slowed(first.span)
        clients = [swarm.connect() for _ in RUNS]
        with ThreadPoolExecutor(len(RUNS)) as pool:
            futures = [pool.submit(generate, client, rows, n) for client, (rows, n) in zip(clients, RUNS, strict=True)]
            results = [future.result(timeout=90) for future in futures]
        counters = [local.server.backend.compute_counters() for local in swarm.servers]
    for (rows, _), want, got in zip(RUNS, expected, results, strict=True):
        assert torch.equal(got.sequences, want.sequences), f"{len(rows)} rows: tokens differ"
        err = max(float((g - w).abs().max()) for g, w in zip(got.logits, want.logits, strict=True))
        assert err <= ATOL, f"{len(rows)} rows: max |logits diff| {err} > {ATOL}"
    steps = sum(n for _, n in RUNS)  # each session: a prefill and n - 1 decode steps, on each server
    for server in counters:
        assert server["batched_steps"] >= steps  # more if the client cut a prefill in pieces
    assert counters[0]["batches"] < steps  # the slowed server ran some steps of several sessions together
    assert first.batcher.batch_steps_max >= 2
    assert counters[0]["batch_rows_max"] >= 2
