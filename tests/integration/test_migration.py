"""KV migration on drain (:mod:`shoal.server.migrate`): a session whose server drains goes on on a
replacement of the same span that took the session's KV pages, with no replay, and its greedy tokens
equal local ``transformers``; when the replacement refuses the pages, or reports another chain digest
than the client's own (pages tampered with by the sender, :mod:`testkit.migration`), the client
replays the history instead and the tokens still do not change.

A tiny random llama of 4 blocks in an in-process swarm: servers of blocks 0:2 and two of 2:4 (the
route's, and the replacement). The 2,000-token SmolLM2 session is the slow test at the end.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from shoal.checkpoints.fetch import model_cache_dir
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.models.base import CacheGeometry
from shoal.models.kv import PagedCache, PagePool
from shoal.server.migrate import read_pages, write_pages
from testkit.migration import refusing, tampering
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.inprocess import wait_until
from tests.helpers.parity import min_top2_gap
from tests.routing.helpers import AtStep

PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3, 250, 8]])
NEW_TOKENS = 24
DRAIN_AT = 9  # the new token (0-based) after which the server starts leaving: its next reply says so
A, B = BlockRange(0, 2), BlockRange(2, 4)


@pytest.fixture(scope="module")
def reference_and_dir(tmp_path_factory):
    model = tiny_model("llama", seed=5)
    path = save_checkpoint(model, tmp_path_factory.mktemp("migration-model"))
    expected = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert min_top2_gap(model, PROMPT, max_new_tokens=NEW_TOKENS) > 1e-3  # no near-ties
    return expected, path


def generate_draining(swarm: InProcessSwarm, blocks: BlockRange, max_new_tokens: int = NEW_TOKENS, verify: str = "off"):
    """Greedy tokens of one session whose server of ``blocks`` starts draining at step ``DRAIN_AT``;
    returns (tokens, session, the leaving server, the one the session moved to)."""
    # verify='off': the replacement's counters must be the migrated session's alone (with the default
    # audits the other server of the span also audits the session, adding its own positions)
    model = swarm.connect(refresh_period=0, routing_seed=0, verify=verify)
    drains: list[threading.Thread] = []
    with model.inference_session(max_length=PROMPT.shape[1] + max_new_tokens) as cache:
        route = {span.peer_id for span in cache.session.chain}
        leaving = next(s for s in swarm.servers if s.blocks == blocks and s.node.id in route)

        def drain() -> None:  # as SIGTERM: the drain runs while generation goes on
            thread = threading.Thread(target=swarm.runtime.run, args=(leaving.server.drain(10.0),))
            thread.start()
            drains.append(thread)
            wait_until(lambda: leaving.server.draining, what="draining")

        out = model.generate(PROMPT, max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=[AtStep(DRAIN_AT, drain)])  # fmt: skip
        session = cache.session
        taker = next(s for s in swarm.servers if s.blocks == blocks and s.node.id == session.chain[-1].peer_id)
    for thread in drains:
        thread.join(15)
    return out, session, leaving, taker


@pytest.mark.timeout(60)
def test_a_drained_session_moves_its_pages_and_keeps_the_tokens(reference_and_dir):
    expected, path = reference_and_dir
    with InProcessSwarm(path, [A, B, B]) as swarm:
        out, session, leaving, taker = generate_draining(swarm, B)
        assert torch.equal(out, expected)
        (record,) = session.recoveries
        position = PROMPT.shape[1] + DRAIN_AT + 1  # the positions the leaving server held
        assert record.drain and record.failed == leaving.node.id
        assert dict(record.migrated) == {taker.node.id: position} and record.replayed == {}  # no replay
        assert leaving.server.counters.sessions_migrated_out == 1
        assert taker.server.counters.sessions_migrated_in == 1
        # the replacement computed only the steps after the hand-over, never the history
        assert taker.server.counters.positions_processed == PROMPT.shape[1] + NEW_TOKENS - 1 - position
        assert leaving.server.counters.sessions_drained == 0  # the session left: the drain cut nothing off


@pytest.mark.timeout(60)
def test_an_audited_session_moves_its_pages_too(reference_and_dir):
    """With the default audits, the span's other server both audits the session and takes its pages."""
    expected, path = reference_and_dir
    with InProcessSwarm(path, [A, B, B]) as swarm:
        out, session, _, taker = generate_draining(swarm, B, verify="audit")
        assert torch.equal(out, expected)
        (record,) = session.recoveries
        assert dict(record.migrated) == {taker.node.id: PROMPT.shape[1] + DRAIN_AT + 1} and record.replayed == {}
        assert taker.server.counters.sessions_migrated_in == 1


@pytest.mark.timeout(60)
def test_a_refused_hand_over_falls_back_to_a_replay(reference_and_dir):
    expected, path = reference_and_dir
    with InProcessSwarm(path, [A, B, B], prepare=refusing) as swarm:  # every server refuses pages
        out, session, leaving, taker = generate_draining(swarm, B)
        assert torch.equal(out, expected)
        (record,) = session.recoveries
        position = PROMPT.shape[1] + DRAIN_AT + 1
        assert record.migrated == {} and dict(record.replayed) == {taker.node.id: position}
        assert taker.server.counters.migrations_failed == 1 and taker.server.counters.sessions_migrated_in == 0
        assert leaving.server.counters.migrations_failed == 1 and leaving.server.counters.sessions_migrated_out == 0


@pytest.mark.timeout(60)
def test_pages_of_another_chain_are_caught_and_the_session_replayed(reference_and_dir, caplog):
    """The leaving server sends its pages with a wrong chain digest: the replacement takes them and
    reports that digest, the client sees it is not its own and replays the history to it instead."""
    expected, path = reference_and_dir
    with InProcessSwarm(path, [A, B, B], prepare=tampering) as swarm:  # every server's pages go out altered
        with caplog.at_level(logging.WARNING, "shoal.client"):
            out, session, _, taker = generate_draining(swarm, B)
        assert torch.equal(out, expected)
        (record,) = session.recoveries
        position = PROMPT.shape[1] + DRAIN_AT + 1
        assert record.migrated == {} and dict(record.replayed) == {taker.node.id: position}
        assert session.migration_mismatches == 1
        assert taker.server.counters.sessions_migrated_in == 1  # it took them; the client did not switch
        assert any("took pages of other inputs" in r.getMessage() for r in caplog.records)


def test_pages_read_from_one_pool_are_written_into_another_bit_for_bit():
    geometry = CacheGeometry(num_kv_heads=2, head_dim=8, dtype=torch.float32)
    source, target = (PagePool(3, geometry, 4, 16, "cpu") for _ in range(2))
    cache = PagedCache(source, 2, 32)
    cache.prepare(0, 11)
    for tensor in source.keys + source.values:
        tensor.normal_(generator=torch.Generator().manual_seed(1))
    keys, values = read_pages(cache, 11)
    assert keys.shape == (3, 2, 11, 2, 8)
    taken = PagedCache(target, 2, 32)
    taken.prepare(0, 3)  # pages held before are rolled back
    write_pages(taken, keys, values)
    assert taken.length == 11
    again = read_pages(taken, 11)
    assert torch.equal(again[0], keys) and torch.equal(again[1], values)
    with pytest.raises(ValueError, match="not finite"):
        write_pages(PagedCache(target, 2, 32), keys.clone().fill_(float("nan")), values)


# ---- the target: 2,000 tokens of SmolLM2 -------------------------------------------------
SMOLLM2 = model_cache_dir("smollm2")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_2000_token_smollm2_session_drained_keeps_its_tokens():
    """A 2,000-token prompt on SmolLM2 (two servers of all 30 blocks), drained after a few tokens:
    the pages move (no replay) and the greedy tokens equal local transformers."""
    from transformers import AutoModelForCausalLM

    if not SMOLLM2.is_dir():
        pytest.skip("SmolLM2 is not fetched (shoal models list)")
    prompt = torch.randint(100, 40000, (1, 2000), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    span = BlockRange(0, reference.config.num_hidden_layers)
    del reference
    with InProcessSwarm(SMOLLM2, [span, span], cache_tokens=4096) as swarm:
        model = swarm.connect(refresh_period=0, routing_seed=0)
        drains = []
        with model.inference_session(max_length=prompt.shape[1] + 12) as cache:
            leaving = next(s for s in swarm.servers if s.node.id == cache.session.chain[0].peer_id)

            def drain() -> None:
                thread = threading.Thread(target=swarm.runtime.run, args=(leaving.server.drain(30.0),))
                thread.start()
                drains.append(thread)
                wait_until(lambda: leaving.server.draining, what="draining")

            out = model.generate(prompt, max_new_tokens=12, do_sample=False, logits_processor=[AtStep(3, drain)])
            session = cache.session
        for thread in drains:
            thread.join(60)
    assert torch.equal(out, expected)
    (record,) = session.recoveries
    assert dict(record.migrated) == {session.chain[0].peer_id: prompt.shape[1] + 4} and record.replayed == {}
