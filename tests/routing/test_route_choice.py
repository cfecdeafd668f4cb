"""Which servers a client routes over: slow servers, servers short of cache, load spreading.

One swarm of a tiny 6-block llama: ``slow`` (0:3, every reply delayed by a test-only flag) starts
first, ``fast`` (0:3) joins later; ``roomy`` (3:6) and ``cramped`` (3:6, a cache budget of 16
tokens) host the second half.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from tests.helpers.parity import tiny_causal_lm
from tests.helpers.swarm import write_checkpoint
from tests.routing.helpers import KillableSwarm, connect, counters

PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])
SLOW = ("--test-reply-delay-ms", "150")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_causal_lm("llama", seed=9, num_hidden_layers=6)
    path = write_checkpoint(model, tmp_path_factory.mktemp("route-model"))
    swarm = KillableSwarm(path)
    try:
        swarm.start([("slow", (0, 3), SLOW), ("roomy", (3, 6), ()), ("cramped", (3, 6), ("--cache-tokens", "16"))])
        yield model, swarm
    finally:
        swarm.close()


def route_names(swarm: KillableSwarm, model) -> list[str]:
    with model.inference_session(max_length=32) as cache:
        return [swarm.by_peer(span.peer_id).name for span in cache.session.chain]


@pytest.mark.timeout(120)
def test_a_slow_server_is_routed_around_once_a_faster_replica_exists(setup):
    reference, swarm = setup
    client = connect(swarm)
    try:
        assert route_names(swarm, client) == ["slow", "roomy"]  # the only server for blocks 0:3
    finally:
        client.blocks.close()
    swarm.start([("fast", (0, 3), ())])
    client = connect(swarm, first="slow")  # the table comes through the slow one: both are listed
    try:
        assert route_names(swarm, client) == ["fast", "roomy"]
        expected = reference.generate(PROMPT, max_new_tokens=8, do_sample=False)
        assert torch.equal(client.generate(PROMPT, max_new_tokens=8, do_sample=False), expected)
    finally:
        client.blocks.close()


@pytest.mark.timeout(120)
def test_a_server_short_of_free_cache_is_avoided(setup):
    _, swarm = setup
    client = connect(swarm)
    try:
        for _ in range(3):  # not a coin toss
            assert route_names(swarm, client)[-1] == "roomy"
        info = {swarm.by_peer(s.peer_id).name: s.info["free_cache_tokens"] for s in client.blocks.directory.spans}
        assert info["cramped"] == 16 and info["roomy"] > 32
    finally:
        client.blocks.close()


@pytest.mark.timeout(120)
def test_concurrent_forward_requests_spread_across_replicas(setup):
    reference, swarm = setup
    if "fast" not in swarm.members:
        swarm.start([("fast", (0, 3), ())])
    client = connect(swarm, routing_seed=7)
    try:
        before = {swarm.by_peer(p).name: c["forward_requests"] for p, c in counters(client).items()}
        inputs = [torch.tensor([[1, 5 + i, 9, 33, 2]]) for i in range(16)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            logits = list(pool.map(lambda ids: client(ids).logits, inputs))
        for ids, got in zip(inputs, logits, strict=True):
            torch.testing.assert_close(got, reference(ids).logits, atol=1e-4, rtol=0)
        after = {swarm.by_peer(p).name: c["forward_requests"] for p, c in counters(client).items()}
        served = {name: after[name] - before.get(name, 0) for name in after}
        assert served["fast"] + served["slow"] == 16 and served["roomy"] + served["cramped"] == 16, served
        assert min(served.values()) > 0, f"every replica should get some of the load: {served}"
    finally:
        client.blocks.close()
