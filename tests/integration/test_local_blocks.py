"""A client that serves blocks itself (``from_pretrained(..., local_blocks="0:2")``): the span is a
whole server in the client's process, announced to the swarm, reached by its own client without a
network hop (over in-process pipes), and used by other clients' sessions like any server's.
Generation equals local transformers greedy, for both clients at once; the span leaves with
``model.close()``.

In process, on one in-memory network: the swarm's other server is an
:class:`~shoal.launch.InProcessSwarm` member; the hosted span's node starts on the same network.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.client import AutoDistributedModelForCausalLM
from shoal.errors import UsageError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LOOPBACK
from shoal.routing import NoRouteError
from shoal.server.hosted import beside
from shoal.transport import TransportConfig
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.timeout(180)

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
PROMPT = torch.tensor([[5, 6, 7, 8]])
OTHER = torch.tensor([[9, 3, 11]])
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 4-block random llama."""
    return tiny_checkpoint(tmp_path_factory.mktemp("local-blocks") / "tiny", "llama", seed=4)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def greedy_reference(reference, prompt: torch.Tensor) -> list[int]:
    with torch.inference_mode():
        out = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, prompt.shape[1] :].tolist()


def new_tokens(model, prompt: torch.Tensor) -> list[int]:
    return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1] :].tolist()


def connect_when_listed(swarm: InProcessSwarm, peer_id: str, timeout: float = 20.0, **settings):
    """A plain client of ``swarm`` once the swarm's table lists ``peer_id`` (gossip takes a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            model = swarm.connect(routing_seed=0, **settings)
        except NoRouteError:  # the table does not list it yet: nobody serves blocks 0:2
            model = None
        if model is not None and any(span.peer_id == peer_id for span in model.blocks.directory.spans):
            return model
        if model is not None:
            model.close()
        if time.monotonic() > deadline:
            raise AssertionError(f"the swarm never listed the hosted span {peer_id[:10]}")
        time.sleep(0.5)


def test_local_blocks_answer_as_transformers_and_serve_another_clients_session(model_dir: Path, reference):
    with InProcessSwarm(model_dir, [HIGH], swarm="peers") as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), swarm.tickets(), transport=LOOPBACK, start_node=swarm.start_node, local_blocks="0:2"
        )
        with model:
            hosted = model.blocks.hosted
            assert model.blocks.config.local_blocks == LOW
            assert hosted is not None and hosted.ticket.swarm_id == "peers"
            # only the hosted span serves blocks 0:2: the route goes through it, over in-process pipes
            assert next((s.peer_id, s.start, s.end) for s in model.blocks.chain) == (hosted.peer_id, 0, 2)
            assert new_tokens(model, PROMPT) == greedy_reference(reference, PROMPT)
            assert model.blocks.node.is_local(hosted.peer_id)  # reached in-process
            other = connect_when_listed(swarm, hosted.peer_id)  # another peer of the swarm
            try:
                assert not other.blocks.node.is_local(hosted.peer_id)  # through its network, as any server
                with ThreadPoolExecutor(2) as pool:  # both clients' sessions on the hosted span at once
                    mine, theirs = pool.submit(new_tokens, model, OTHER), pool.submit(new_tokens, other, PROMPT)
                    assert mine.result(60) == greedy_reference(reference, OTHER)
                    assert theirs.result(60) == greedy_reference(reference, PROMPT)
                assert other.blocks.chain[0].peer_id == hosted.peer_id  # it served that session
            finally:
                other.close()
        assert hosted.task.done() and hosted.node.closed  # the span left with the model


def test_audits_trust_the_own_span_and_others_audit_it_as_a_server(model_dir: Path, reference):
    """The client's own span needs no auditor (and costs none); another client audits it as any hop."""
    with InProcessSwarm(model_dir, [LOW, HIGH, HIGH], swarm="audited") as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), swarm.tickets(), transport=LOOPBACK, start_node=swarm.start_node, local_blocks="0:2",
            verify="audit", audit_every=2,
        )  # fmt: skip
        with model:
            hosted = model.blocks.hosted
            assert new_tokens(model, PROMPT) == greedy_reference(reference, PROMPT)
            route = model.blocks.describe_route()
            assert route[0]["peer"] == hosted.peer_id and all(hop["verified"] for hop in route)
            assert model.verification.unverified_blocks == 0 and model.verification.audits > 0
            assert swarm.server(LOW).server.counters.sessions_opened == 0  # nobody audited the client's own span
            other = connect_when_listed(swarm, hosted.peer_id, verify="audit", audit_every=2)
            try:
                assert new_tokens(other, OTHER) == greedy_reference(reference, OTHER)
                assert all(hop["verified"] for hop in other.blocks.describe_route())  # blocks 0:2 too: audited
                assert other.verification.unverified_blocks == 0
            finally:
                other.close()


def test_local_blocks_are_checked_before_anything_starts(model_dir: Path):
    with InProcessSwarm(model_dir, [HIGH], swarm="checked") as swarm:
        for wrong, why in (("2", "START:END"), ("3:9", "4 blocks"), ("2:1", "0 <= start < end")):
            with pytest.raises(UsageError, match=why):
                AutoDistributedModelForCausalLM.from_pretrained(
                    str(model_dir), swarm.tickets(), start_node=swarm.start_node, local_blocks=wrong
                )


def test_the_span_takes_the_given_address_and_the_client_any_port_beside_it():
    assert beside(TransportConfig(bind_addr="0.0.0.0:4000")).bind_addr == "0.0.0.0:0"
    assert beside(TransportConfig(bind_addr="[::]:4000")).bind_addr == "[::]:0"
    assert beside(TransportConfig()).bind_addr is None  # iroh chooses, for both
