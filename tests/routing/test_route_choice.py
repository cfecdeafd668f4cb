"""Which servers a client routes over: slow servers, servers short of cache, load spreading.

In process (:class:`shoal.launch.InProcessSwarm`): a tiny 6-block llama; ``slow`` (0:3, every reply
delayed 150 ms by testkit's fault seam) starts first, ``fast`` (0:3) joins later; ``roomy`` (3:6) and
``cramped`` (3:6, a cache budget of 16 tokens) host the second half. The client measures what it
routes by itself (info round trips, step latencies), as over iroh.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from testkit.faults import ReplyDelay
from testkit.faulty import make_faulty
from testkit.tiny import save_checkpoint, tiny_model

PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])
FIRST, SECOND = BlockRange(0, 3), BlockRange(3, 6)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(reference model, swarm, server name -> peer id), without ``fast`` yet."""
    model = tiny_model("llama", seed=9, num_hidden_layers=6)
    path = save_checkpoint(model, tmp_path_factory.mktemp("route-model"))
    with InProcessSwarm(path, []) as swarm:
        names = {
            "slow": swarm.add(FIRST, prepare=lambda server: make_faulty(server, [ReplyDelay(0.15)])),
            "roomy": swarm.add(SECOND),
            "cramped": swarm.add(SECOND, cache_tokens=16),
        }
        yield model, swarm, names


def with_fast(swarm: InProcessSwarm, names: dict) -> None:
    if "fast" not in names:
        names["fast"] = swarm.add(FIRST)


def route_names(names: dict, model) -> list[str]:
    by_peer = {local.ticket.peer_id: name for name, local in names.items()}
    with model.inference_session(max_length=32) as cache:
        return [by_peer[span.peer_id] for span in cache.session.chain]


@pytest.mark.timeout(30)
def test_a_slow_server_is_routed_around_once_a_faster_replica_exists(setup):
    reference, swarm, names = setup
    client = swarm.connect(refresh_period=0)
    try:
        assert route_names(names, client) == ["slow", "roomy"]  # the only server for blocks 0:3
    finally:
        client.close()
    with_fast(swarm, names)
    client = swarm.connect(refresh_period=0)
    try:
        assert route_names(names, client) == ["fast", "roomy"]
        rtt = client.blocks.directory.latency.client_rtt_ms  # what the choice rests on: measured, not told
        slow, fast = (names[n].ticket.peer_id for n in ("slow", "fast"))
        # >= 145, not 150: asyncio fires a timer up to its clock resolution early
        assert rtt[slow] >= 145 and rtt[fast] < rtt[slow] - 100, rtt
        expected = reference.generate(PROMPT, max_new_tokens=8, do_sample=False)
        assert torch.equal(client.generate(PROMPT, max_new_tokens=8, do_sample=False), expected)
    finally:
        client.close()


@pytest.mark.timeout(30)
def test_a_server_short_of_free_cache_is_avoided(setup):
    _, swarm, names = setup
    client = swarm.connect(refresh_period=0)
    try:
        for _ in range(3):  # not a coin toss
            assert route_names(names, client)[-1] == "roomy"
        by_peer = {local.ticket.peer_id: name for name, local in names.items()}
        info = {by_peer[s.peer_id]: s.info.free_cache_tokens for s in client.blocks.directory.spans}
        assert info["cramped"] == 16 and info["roomy"] > 32
    finally:
        client.close()


@pytest.mark.timeout(30)
def test_concurrent_forward_requests_spread_across_replicas(setup):
    reference, swarm, names = setup
    with_fast(swarm, names)
    client = swarm.connect(refresh_period=0, routing_seed=7)
    try:
        before = {name: local.server.counters.forward_requests for name, local in names.items()}
        inputs = [torch.tensor([[1, 5 + i, 9, 33, 2]]) for i in range(16)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            logits = list(pool.map(lambda ids: client(ids).logits, inputs))
        for ids, got in zip(inputs, logits, strict=True):
            torch.testing.assert_close(got, reference(ids).logits, atol=1e-4, rtol=0)
        served = {name: local.server.counters.forward_requests - before[name] for name, local in names.items()}
        assert served["fast"] + served["slow"] == 16 and served["roomy"] + served["cramped"] == 16, served
        assert min(served.values()) > 0, f"every replica should get some of the load: {served}"
    finally:
        client.close()
