"""A SIGKILLed server, listed by the swarm until its record expires, costs nobody a wait: the swarm
marks it unreachable within two gossip periods (:mod:`shoal.swarm.liveness`: its ring watchers'
probes fail, and their word spreads), and a new client that starts while it is still listed gets
its first token about as fast as a client that never saw it (the silent server is left out once
the others cover every block).

``shoal serve`` processes, because SIGKILL is the point: a 6-block tiny llama, three servers of
blocks 0:3 and one of 3:6, records that live far longer than the test (``--expiry 120``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from shoal import AutoDistributedModelForCausalLM
from shoal.launch import LocalSwarm
from shoal.swarm.status import swarm_status
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.registry import ENV, LOOPBACK, ONE_THREAD

PERIOD = 2.0  # --gossip-period: "within two gossip periods" is 4 s here
FLAGS = ("--gossip-period", str(PERIOD), "--refresh-period", "30", "--expiry", "120", *ONE_THREAD)
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_checkpoint(tiny_model("llama", seed=5, num_hidden_layers=6), tmp_path_factory.mktemp("dead-servers"))


def first_token_seconds(model_dir: Path, ticket) -> tuple[float, torch.Tensor]:
    """From ``from_pretrained`` to the first generated token, and the greedy tokens of 4 steps."""
    started = time.perf_counter()
    with AutoDistributedModelForCausalLM.from_pretrained(
        str(model_dir), initial_peers=[ticket], transport=LOOPBACK, refresh_period=0
    ) as model:
        out = model.generate(PROMPT, max_new_tokens=1, do_sample=False)
        elapsed = time.perf_counter() - started
        more = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    assert torch.equal(out[0], more[0, : out.shape[1]])
    return elapsed, more


def server_states(ticket) -> dict[str, str]:
    status = asyncio.run(swarm_status(ticket, LOOPBACK))
    return {s["peer"]: s["state"] for m in status["models"] for s in m["servers"]}


def wait_marked(ticket, peer: str, timeout: float) -> float:
    """Seconds until ``swarm status`` through ``ticket`` shows ``peer`` unreachable."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if server_states(ticket).get(peer) == "unreachable":
            return time.perf_counter() - started
        time.sleep(0.2)
    raise AssertionError(f"{peer[:10]} still listed as {server_states(ticket).get(peer)} after {timeout} s")


def test_a_killed_server_is_marked_and_costs_a_new_client_no_wait(model_dir):
    with LocalSwarm(model_dir, extra_args=FLAGS, swarm=True, env=ENV, ready_timeout=120) as swarm:
        a1, a2, a3, b = swarm.start([(0, 3), (0, 3), (0, 3), (3, 6)])
        swarm.wait_converged()
        time.sleep(2 * PERIOD)  # every member has probed (admitted) the others
        baseline, expected = first_token_seconds(model_dir, a1.ticket)

        # the swarm finds a killed server by itself, no client involved
        a2.kill()
        killed = time.perf_counter()
        marked = wait_marked(a1.ticket, a2.ticket.peer_id, timeout=4 * PERIOD)
        assert time.perf_counter() - killed <= 2 * PERIOD, f"marked {marked:.1f} s after the kill"
        assert server_states(b.ticket)[a2.ticket.peer_id] == "unreachable"  # not only its watchers know

        # a new client while a freshly killed server is still listed everywhere
        a3.kill()
        assert server_states(a1.ticket)[a3.ticket.peer_id] == "online"
        after, tokens = first_token_seconds(model_dir, a1.ticket)
        assert torch.equal(tokens, expected)
        print(f"marked after {marked:.2f} s; first token {baseline:.2f} s before the kill, {after:.2f} s after")
        assert after <= baseline + 1.5, f"first token {after:.2f} s after the kill, {baseline:.2f} s before it"
        swarm.check_alive(expected_gone=[a2, a3])
