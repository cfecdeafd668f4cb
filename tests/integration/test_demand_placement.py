"""Demand-driven placement across models (shoal.server.roam): a server started with ``--join`` and no
model serves the model the swarm is short of.

One in-process swarm lists two tiny random llamas of different shapes, saved as checkpoints in one
folder (``--models-dir``): ``tiny-a`` (4 blocks, hidden 64) is served by two servers; ``tiny-b`` (6
blocks, hidden 32) had one server, which left (its model record stays in the tables). A server
started as ``shoal serve --join TICKET --models-dir DIR`` (:func:`serve_where_needed`, the same
builder steps as ``shoal serve``) takes ``tiny-b``, loads it from ``DIR/tiny-b`` and covers it; a
client then gets local transformers' greedy tokens of ``tiny-b`` through it.

When demand shifts it follows: a server without a model that took ``tiny-a`` (both models served,
equally free) switches to ``tiny-b`` within a few ``--rebalance-period`` s once ``tiny-b``'s server
leaves (``tiny-a`` stays covered by its own two), as a new node of ``tiny-b``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.client import AutoDistributedModelForCausalLM
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import FAST_GOSSIP, LOOPBACK
from shoal.server.config import ServerConfig
from shoal.server.roam import Roaming, serve_where_needed
from shoal.swarm.records import State
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.inprocess import wait_until
from tests.helpers.parity import greedy_with_gap

pytestmark = pytest.mark.timeout(120)

PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    tiny_checkpoint(root / "tiny-a", "llama", 0, tokenizer=char_tokenizer())
    tiny_checkpoint(root / "tiny-b", "llama", 1, tokenizer=char_tokenizer(), num_hidden_layers=6, hidden_size=32,
                    intermediate_size=96)  # fmt: skip
    return root


def test_a_server_without_a_model_covers_the_model_nobody_serves(models_dir):
    reference = AutoModelForCausalLM.from_pretrained(str(models_dir / "tiny-b"), dtype=torch.float32).eval()
    expected, gap = greedy_with_gap(reference, PROMPT, max_new_tokens=NEW_TOKENS)
    assert gap > 1e-3
    with InProcessSwarm(models_dir / "tiny-a", [BlockRange(0, 2), BlockRange(2, 4)], swarm="demand") as a:
        table = a.servers[0].presence.service.table
        join = (a.tickets()[0],)
        with InProcessSwarm(models_dir / "tiny-b", [], swarm="demand", start_node=a.start_node) as b:
            gone = b.add(BlockRange(0, 6), join=join)
            wait_until(lambda: table.model("tiny-b") is not None, 10.0, what="tiny-b's model record")
            b.drain(gone)
        wait_until(lambda: not table.servers("tiny-b"), 10.0, what="tiny-b's last server offline")
        assert len(table.servers("tiny-a")) == 2

        config = ServerConfig(model="", join=join, throughput=100.0, gossip=FAST_GOSSIP, transport=LOOPBACK,
                              cache_tokens=1024, share_counters=True)  # fmt: skip
        tickets, stop = [], asyncio.Event()
        roaming = Roaming((models_dir,), rebalance_period=60.0)
        running = asyncio.run_coroutine_threadsafe(
            serve_where_needed(config, roaming, tickets.append, stop, start_node=a.start_node), a.runtime.loop
        )
        try:
            wait_until(lambda: bool(tickets) or running.done(), 30.0, what="the new server online")
            if running.done():
                running.result()  # its error
            peer = tickets[0].peer_id
            wait_until(lambda: any(r.peer == peer and r.state is State.ONLINE for r in table.servers("tiny-b")),
                       10.0, what="its record online")  # fmt: skip
            online = [r for r in table.servers("tiny-b") if r.peer == peer]
            assert [(r.blocks, r.state) for r in online] == [(BlockRange(0, 6), State.ONLINE)]
            assert all(r.model == "tiny-a" for r in table.servers() if r.peer != peer)
            model = AutoDistributedModelForCausalLM.from_pretrained(
                str(models_dir / "tiny-b"), initial_peers=tickets[:1], transport=LOOPBACK, start_node=a.start_node
            )
            try:
                tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
            finally:
                model.close()
            assert torch.equal(tokens, expected)
        finally:
            a.runtime.loop.call_soon_threadsafe(stop.set)
            running.result(timeout=30)


def test_a_server_without_a_model_switches_to_the_model_left_uncovered(models_dir):
    with InProcessSwarm(models_dir / "tiny-a", [BlockRange(0, 2), BlockRange(2, 4)], swarm="shift") as a:
        table = a.servers[0].presence.service.table
        join = (a.tickets()[0],)
        with InProcessSwarm(models_dir / "tiny-b", [], swarm="shift", start_node=a.start_node) as b:
            last_b = b.add(BlockRange(0, 6), join=join)
            wait_until(lambda: table.model("tiny-b") is not None and table.servers("tiny-b"), 10.0, what="tiny-b")
            config = ServerConfig(model="", join=join, throughput=100.0, gossip=FAST_GOSSIP, transport=LOOPBACK,
                                  cache_tokens=1024)  # fmt: skip
            tickets, stop = [], asyncio.Event()
            roaming = Roaming((models_dir,), rebalance_period=1.0)
            running = asyncio.run_coroutine_threadsafe(
                serve_where_needed(config, roaming, tickets.append, stop, start_node=a.start_node), a.runtime.loop
            )
            try:
                wait_until(lambda: bool(tickets) or running.done(), 30.0, what="the new server online")
                first = tickets[0].peer_id
                wait_until(lambda: any(r.peer == first for r in table.servers("tiny-a")), 10.0, what="it on tiny-a")
                b.drain(last_b)
                wait_until(lambda: len(tickets) == 2 or running.done(), 30.0, what="a switch to tiny-b")
                second = tickets[1].peer_id
                wait_until(lambda: any(r.peer == second and r.state is State.ONLINE for r in table.servers("tiny-b")),
                           10.0, what="it online on tiny-b")  # fmt: skip
                assert [r.blocks for r in table.servers("tiny-b")] == [BlockRange(0, 6)]
                assert [(r.blocks, r.state) for r in table.servers("tiny-a")] == [
                    (BlockRange(0, 2), State.ONLINE), (BlockRange(2, 4), State.ONLINE)
                ]  # fmt: skip
            finally:
                a.runtime.loop.call_soon_threadsafe(stop.set)
                running.result(timeout=30)
