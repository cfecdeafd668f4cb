"""A client's view of a swarm outlives the members it was given (found by the soak: the gateway's one
ticket was its first server, which a kill took away; from then on every look for servers failed, so it
never saw the replacements, and requests failed for want of servers and checkers).

A tiny random llama with 4 blocks, servers ``[0:2]`` x2 and ``[2:4]`` x2 in one gossiping swarm.
"""

from __future__ import annotations

import time

import pytest
import torch

from shoal.client.remote import listing
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.byzantine import connect_over, peer_of
from tests.helpers.inprocess import wait_until
from tests.helpers.parity import min_top2_gap

pytestmark = pytest.mark.timeout(90)

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3, 250, 8]])
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference_and_dir(tmp_path_factory):
    model = tiny_model("llama", seed=5, num_hidden_layers=4)
    path = save_checkpoint(model, tmp_path_factory.mktemp("lost-members-model"))
    assert min_top2_gap(model, PROMPT, max_new_tokens=NEW_TOKENS) > 1e-3  # no near-ties
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False), path


def test_a_client_whose_only_ticket_died_still_sees_newcomers(reference_and_dir):
    expected, model_dir = reference_and_dir
    with InProcessSwarm(model_dir, [LOW, LOW, HIGH, HIGH], swarm="lost-members") as swarm:
        first, low_b, high_a, high_b = swarm.servers
        table, everyone = first.presence.service.table, {peer_of(s) for s in swarm.servers}
        wait_until(lambda: {r.peer for r in table.servers()} == everyone, 20.0,
                   what="every server in the first one's table, the client's only ticket")  # fmt: skip
        with connect_over(swarm, [first], route_wait=20.0) as model:
            directory, runtime = model.blocks.directory, model.blocks.runtime
            deadline = time.monotonic() + 20.0
            while {s.peer_id for s in directory.spans} != everyone:  # the swarm's gossip converging
                assert time.monotonic() < deadline, f"the client lists {directory.spans}"
                time.sleep(0.2)
                runtime.run(directory.refresh())
            swarm.kill(first)
            swarm.kill(high_a)
            swarm.kill(high_b)
            newcomer = swarm.add(HIGH)
            deadline = time.monotonic() + 20.0
            while True:  # until the newcomer's record has reached the live member
                started = time.monotonic()
                runtime.run(directory.refresh())
                took = time.monotonic() - started
                # the dead members asked get a grace once the live one answered, not the whole timeout
                assert took < model.blocks.config.listing_timeout, f"a look took {took:.1f} s"
                listed = {s.peer_id for s in directory.spans}
                if peer_of(newcomer) in listed:
                    break
                assert time.monotonic() < deadline, f"the newcomer is not listed: {listed}"
                time.sleep(0.2)
            assert peer_of(low_b) in listed, listed
            out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(out, expected)
            assert {s.peer_id for s in model.blocks.chain} == {peer_of(low_b), peer_of(newcomer)}


def test_a_dead_member_is_not_awaited_once_a_live_one_answered(reference_and_dir):
    """Once a live member's table is in, a dead one is given ``LATE_VIEW_GRACE``, not the timeout."""
    _, model_dir = reference_and_dir
    with InProcessSwarm(model_dir, [LOW, LOW, HIGH], swarm="enough-views") as swarm:
        dead, *alive = swarm.servers
        tickets = [dead.ticket, *(s.ticket for s in alive)]
        swarm.kill(dead)
        with connect_over(swarm, alive) as model:
            node = model.blocks.node
            started = time.monotonic()
            views = model.blocks.runtime.run(listing._views(node, tickets, tickets[0].swarm_id, 30.0))
            took = time.monotonic() - started
        assert [t.peer_id for t, _ in views] == [s.ticket.peer_id for s in alive]
        assert took < 30.0 / 2, f"waited {took:.1f} s for the dead member"
