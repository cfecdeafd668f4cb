"""A client given several tickets routes over the servers of all of them together: standalone
servers (each its own swarm of none), mixed with a swarm's member. Generation equals local
transformers greedy. When no given server hosts some blocks, connecting fails at once with the
one line that names them and how to add a server for them.

In process, on one in-memory network: the swarm server and the standalone one are two
:class:`~shoal.launch.InProcessSwarm` harnesses that share it (``start_node``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.client import AutoDistributedModelForCausalLM
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LOOPBACK
from shoal.routing import NoRouteError
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.timeout(120)

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
PROMPT = torch.tensor([[5, 6, 7, 8]])
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 4-block random llama."""
    return tiny_checkpoint(tmp_path_factory.mktemp("standalone") / "tiny", "llama", seed=4)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[int]:
    """Local transformers' greedy continuation of :data:`PROMPT`."""
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.inference_mode():
        out = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, PROMPT.shape[1] :].tolist()


def greedy(model_dir: Path, tickets: list, start_node) -> list[int]:
    with AutoDistributedModelForCausalLM.from_pretrained(
        str(model_dir), tickets, transport=LOOPBACK, start_node=start_node
    ) as model:
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1] :].tolist()


def test_two_standalone_servers_answer_as_transformers(model_dir: Path, expected: list[int]):
    with InProcessSwarm(model_dir, [LOW, HIGH]) as servers:
        assert all(not ticket.swarm_id for ticket in servers.tickets())
        assert greedy(model_dir, servers.tickets([LOW, HIGH]), servers.start_node) == expected


def test_a_swarm_member_and_a_standalone_server_answer_together(model_dir: Path, expected: list[int]):
    with (
        InProcessSwarm(model_dir, [LOW], swarm="mixed") as swarm,
        InProcessSwarm(model_dir, [HIGH], start_node=swarm.start_node) as alone,
    ):
        (member,), (standalone,) = swarm.tickets(), alone.tickets()
        assert member.swarm_id == "mixed" and not standalone.swarm_id
        assert greedy(model_dir, [member, standalone], swarm.start_node) == expected


def test_blocks_no_server_hosts_fail_the_connect_in_one_line(model_dir: Path):
    with InProcessSwarm(model_dir, [LOW]) as servers, pytest.raises(NoRouteError) as raised:
        greedy(model_dir, servers.tickets(), servers.start_node)
    assert raised.value.missing == [2, 3]
    assert str(raised.value) == (
        "no server hosts blocks 2-3: start one with `shoal serve MODEL --blocks 2:4` and pass its ticket "
        "with another --join"
    )
