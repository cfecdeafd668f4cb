"""A session's replay history (shoal.client.remote.history): joined without torch.cat (the client's event
loop thread must not open OpenMP regions, see cat_serial), equal to torch.cat for every wire dtype,
contiguous or not; and what it holds after steps, chain changes, replays and rollbacks."""

from __future__ import annotations

import pytest
import torch

from shoal.client.remote.history import SpanHistory, cat_serial
from shoal.errors import ShoalError
from shoal.wire.tensors import DTYPES

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_join_equals_torch_cat(name):
    generator = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(2, n, 6, generator=generator) * 50).to(DTYPES[name]) for n in (7, 1, 1, 3)]
    chunks.append(torch.randn(2, 6, 4, generator=generator).to(DTYPES[name]).transpose(1, 2))  # not contiguous
    joined = cat_serial(chunks, dim=1)
    assert joined.dtype == DTYPES[name] and torch.equal(joined, torch.cat(chunks, dim=1))


def steps(history: SpanHistory, lengths, starts=(0, 3), seed=0, mask=None):
    """Record steps of the given lengths; returns block -> every input recorded there."""
    generator = torch.Generator().manual_seed(seed)
    seen = {block: [] for block in starts}
    position = history.position_ids().shape[1] if history.blocks() else 0
    for n in lengths:
        inputs = {block: torch.randn(2, n, 4, generator=generator) for block in starts}
        positions = torch.arange(position, position + n).expand(2, -1)
        history.record(inputs, frozenset(starts), positions, mask, position + n)
        position += n
        for block in starts:
            seen[block].append(inputs[block])
    return {block: torch.cat(chunks, dim=1) for block, chunks in seen.items()}


def test_replay_inputs_are_every_step_so_far():
    history = SpanHistory(batch_size=2)
    seen = steps(history, [5, 1, 1, 1])
    hidden, positions = history.replay_inputs(3, 8)  # no mask: nothing padded
    assert torch.equal(hidden, seen[3]) and torch.equal(positions, torch.arange(8).expand(2, -1))
    assert history.blocks() == [0, 3]
    with pytest.raises(ShoalError, match="no history at block 5"):
        history.replay_inputs(5, 8)
    with pytest.raises(ShoalError, match="no history at block 3"):
        history.replay_inputs(3, 7)  # a length the history does not have


def test_a_padded_mask_travels_with_the_replay():
    history = SpanHistory(batch_size=2)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 0] = False
    steps(history, [4], mask=mask)
    *_, replay_mask = history.replay_inputs(0, 4)
    assert torch.equal(replay_mask, mask)


def test_a_block_that_stops_being_a_boundary_loses_its_history_and_a_replay_output_is_adopted():
    history = SpanHistory(batch_size=2)
    steps(history, [3, 1], starts=(0, 3))
    replayed = torch.full((2, 4, 4), 7.0)
    history.adopt(2, replayed)  # a new boundary: the replay's output is its history
    history.adopt(3, torch.zeros(2, 4, 4))  # an existing one keeps what the chain used
    assert torch.equal(history.at(2), replayed) and not torch.equal(history.at(3), torch.zeros(2, 4, 4))
    steps(history, [1], starts=(0, 2), seed=1)
    assert history.blocks() == [0, 2] and history.at(2).shape == (2, 5, 4)


def test_rollback_truncates_every_part():
    history = SpanHistory(batch_size=2)
    seen = steps(history, [4, 1, 1])
    history.truncate(3)
    hidden, positions = history.replay_inputs(0, 3)
    assert torch.equal(hidden, seen[0][:, :3]) and torch.equal(positions, torch.arange(3).expand(2, -1))
    later = steps(history, [2], seed=4)
    hidden, _ = history.replay_inputs(3, 5)
    assert torch.equal(hidden, torch.cat([seen[3][:, :3], later[3]], dim=1))
    history.truncate(0)
    assert history.at(0) is None and history.blocks() == []
