"""Records are claims: a key that only publishes records (no server answers at its addresses) is
never routed over and never counted as a judge, and one member that hides the swarm from a client
(a short table) is named in a warning while the client still finds the honest servers through the
other members (:mod:`shoal.swarm.liveness`, :func:`shoal.client.remote.listing.pull_table`).

In process: a 6-block tiny llama, servers of 0:3 and 3:6 in one swarm (fast gossip), the attacker's
records pushed to a member as gossip, as any peer may.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace

import msgspec
import pytest
import torch

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.swarm.liveness import Liveness, Reach
from shoal.swarm.messages import PushRequest, encode_payload
from shoal.swarm.records import decode
from shoal.swarm.service import SWARM, blob
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import convicted
from shoal.verify.receipts import ReceiptSigner
from shoal.wire import Message
from shoal.wire.schema import Gossip
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.parity import min_top2_gap
from tests.helpers.registry import server_record, sign_with

pytestmark = pytest.mark.timeout(90)

LOW, HIGH = BlockRange(0, 3), BlockRange(3, 6)
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])
NEW = 12
SWARM_ID = "admission"


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    model = tiny_model("llama", seed=5, num_hidden_layers=6)
    assert min_top2_gap(model, PROMPT, max_new_tokens=NEW) > 1e-3
    path = save_checkpoint(model, tmp_path_factory.mktemp("admission"))
    return path, model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)


def record_only_keys(n: int, seed: int) -> list[tuple[bytes, str]]:
    rng = random.Random(seed)
    return [(key, ReceiptSigner(key).peer_id) for key in (rng.randbytes(32) for _ in range(n))]


def push(swarm: InProcessSwarm, records: list[bytes]) -> None:
    """Gossip ``records`` to the first member, from a node of the attacker's."""

    async def send() -> None:
        node = await swarm.start_node(swarm.transport)
        try:
            payload = encode_payload(PushRequest(records=records))
            await node.request(swarm.tickets()[0], SWARM, Message("gossip", 1, Gossip(op="push"), [blob(payload)]), 5)
        finally:
            await node.close()

    swarm.runtime.run(send())


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def table_of(swarm: InProcessSwarm) -> RecordTable:
    return swarm.servers[0].presence.service.table


def test_record_only_servers_are_listed_unreachable_and_never_routed(model_and_reference):
    path, expected = model_and_reference
    with InProcessSwarm(path, [LOW, HIGH], swarm=SWARM_ID) as swarm:
        table = table_of(swarm)
        wait_until(lambda: len(table.admitted()) == 2)
        honest = table.servers()[1]  # of HIGH: its fingerprints, its model
        fakes = record_only_keys(3, seed=7)
        now = time.time()
        forged = [
            sign_with(
                replace(
                    server_record(SWARM_ID, peer, honest.model, (3, 6), honest.fingerprints, now, 120.0),
                    step_ms=0.001,  # the fastest servers there are: routing would pick them
                    throughput=1e6,
                ),
                key,
            )
            for key, peer in fakes
        ]
        push(swarm, forged)
        fake_peers = {peer for _, peer in fakes}
        wait_until(lambda: fake_peers <= {r.peer for r in table.servers(include_unreachable=True)})
        wait_until(lambda: all(table.reach(table.get(f"s:{p}").record) is Reach.UNREACHABLE for p in fake_peers))
        assert fake_peers.isdisjoint(r.peer for r in table.servers())  # left out where it counts
        assert fake_peers.isdisjoint(r.peer for r in table.admitted())

        model = swarm.connect(refresh_period=0)
        out = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, expected)
        routed = {entry["peer"] for entry in model.blocks.describe_route()}
        assert routed.isdisjoint(fake_peers)
        assert fake_peers.isdisjoint(s.peer_id for s in model.blocks.directory.spans)


def test_record_only_judges_convict_nobody():
    """Verdicts need judges the deciding peer has reached: 10 keys that only publish records (and
    verdicts) beside 3 honest replicas convict nobody; the same keys, once they answer probes, would."""
    from tests.unit.test_verdicts import (
        ACCUSED,
        JUDGE_KEY,
        MODEL,
        OTHER_KEY,
        add_server,
        replicas,
        signed_verdict,
        table_at,
    )

    table = table_at()
    replicas(table)  # the accused and two honest replicas of blocks 2:4
    sybils = record_only_keys(10, seed=11)
    for key, _ in sybils:
        add_server(table, key, (2, 4))
        table.merge(signed_verdict(key))
    assert ACCUSED in convicted(table, MODEL)  # were records enough, the keys alone would convict

    table.liveness = Liveness(self_id="deciding-peer")
    honest = [ACCUSED, *(ReceiptSigner(k).peer_id for k in (JUDGE_KEY, OTHER_KEY))]
    for peer in honest:  # the honest servers answer this peer's probes; the keys never do
        table.liveness.probed(table.get(f"s:{peer}").record, ok=True, now=0.0)
    for _, peer in sybils:
        table.liveness.probed(table.get(f"s:{peer}").record, ok=False, now=0.0)
    assert convicted(table, MODEL) == {}
    for _, peer in sybils:  # only keys that run reachable servers of those blocks could judge
        table.liveness.probed(table.get(f"s:{peer}").record, ok=True, now=1.0)
    assert ACCUSED in convicted(table, MODEL)


def test_a_member_hiding_the_swarm_is_named_and_routes_are_still_found(model_and_reference, caplog):
    path, expected = model_and_reference
    with InProcessSwarm(path, [LOW, LOW, HIGH, HIGH], swarm=SWARM_ID) as swarm:
        eclipser = swarm.servers[0].presence.service
        wait_until(lambda: len(eclipser.table.admitted()) == 4)
        MODEL_NAME = eclipser.table.models()[0].name
        real_reply = eclipser._table_reply

        def short_reply():  # the model record and itself: the other servers hidden
            reply = real_reply()
            kept = [d for d in reply.records if decode(d).key in ("s:" + eclipser.node.id, "m:" + MODEL_NAME)]
            return msgspec.structs.replace(reply, records=tuple(kept))

        eclipser._table_reply = short_reply
        with caplog.at_level(logging.WARNING, "shoal.client.remote.listing"):
            model = swarm.connect(refresh_period=0)  # every member's ticket, the eclipser's first
            out = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, expected)
        warnings = [r.getMessage() for r in caplog.records if "may be hiding the swarm" in r.getMessage()]
        assert len(warnings) == 1 and eclipser.node.id[:10] in warnings[0], warnings
        assert {s.peer_id for s in model.blocks.directory.spans} == {s.node.id for s in swarm.servers}
