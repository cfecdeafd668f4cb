"""The judge tests' court: one in-process swarm of a tiny llama (4 blocks) per test module."""

from __future__ import annotations

import pytest

from shoal.launch import InProcessSwarm
from testkit.tiny import save_checkpoint, tiny_model
from tests.server.judge.bench import Court


@pytest.fixture(scope="module")
def court(tmp_path_factory):
    model_dir = save_checkpoint(tiny_model("llama", seed=5), tmp_path_factory.mktemp("tiny-judge"))
    with InProcessSwarm(model_dir, []) as swarm:
        court = Court(swarm)
        yield court
        court.run(court.node.close())
