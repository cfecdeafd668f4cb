"""The receipt tests' model (a tiny llama and its local reference), fresh in-process swarms of it,
and what the client kept of the receipts and replies."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from shoal.client.remote.driver import ChainDriver
from shoal.client.remote.hops import Hop
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import Prepare
from shoal.verify.receipts import Receipt
from testkit.tiny import save_checkpoint, tiny_model


@pytest.fixture(scope="module")
def reference():
    return tiny_model("llama", seed=5)


@pytest.fixture(scope="module")
def model_dir(reference, tmp_path_factory):
    return save_checkpoint(reference, tmp_path_factory.mktemp("tiny-receipts"))


@pytest.fixture
def swarms(model_dir):
    made: list[InProcessSwarm] = []

    def make(spans: Sequence[tuple[BlockRange, Prepare | None]]) -> InProcessSwarm:
        swarm = InProcessSwarm(model_dir, [])
        made.append(swarm)
        for span, prepare in spans:
            swarm.add(span, prepare)
        return swarm

    yield make
    for swarm in made:
        swarm.close()


@pytest.fixture
def kept_receipts(monkeypatch) -> list[dict[int, Receipt]]:
    """Every step's receipts as :meth:`ChainDriver.run` reports them (one dict per call)."""
    kept: list[dict[int, Receipt]] = []
    run = ChainDriver.run

    async def spy(self, index, inputs, position_ids, mask, position, receipts=None):
        receipts = {} if receipts is None else receipts
        kept.append(receipts)
        return await run(self, index, inputs, position_ids, mask, position, receipts)

    monkeypatch.setattr(ChainDriver, "run", spy)
    return kept


@pytest.fixture
def reply_metadata(monkeypatch) -> list[bytes]:
    """The encoded metadata of every step reply a client received (as it came off the wire)."""
    seen: list[bytes] = []
    receive = Hop.receive

    async def spy(self, timeout):
        message = await receive(self, timeout)
        if message is not None and message.kind == "result":
            assert isinstance(message.meta, msgspec.Raw)  # not decoded yet: exactly what travelled
            seen.append(bytes(message.meta))
        return message

    monkeypatch.setattr(Hop, "receive", spy)
    return seen
