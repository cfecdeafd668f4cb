"""Verdicts spreading through a swarm (shoal.swarm.verdicts) from a lie caught by an audit.

One in-process swarm that gossips (``InProcessSwarm(swarm=...)``, every server's real swarm presence
over the memory network) of a tiny random llama (4 blocks): ``[0:2]`` x1 and ``[2:4]`` x3, one of
those a liar (:func:`testkit.faulty.make_faulty`, noise 0.1 on every output). A first client with
``verify="audit"`` is steered through the liar, catches it, and testifies to the two honest replicas
(the judges, :mod:`shoal.server.judge`); each confirms, and its presence signs and gossips a verdict.
Then every server's table convicts the liar (2 judges of the 2 other servers on its blocks), a second
client that knows only the ``[0:2]`` server (it never talked to the liar) reads the table and never
routes over the liar, and the swarm's status lists the verdict. A verdict one framing judge signs against an
honest server convicts nobody; a verdict of a key that serves nothing is held but not counted; a
forged one (a receipt the accused never signed) is rejected by every server and counted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.swarm.messages import PushRequest, encode_payload
from shoal.swarm.records import State, sign
from shoal.swarm.service import SWARM, blob, decode_table, fetch_table
from shoal.swarm.status import summarize, to_json
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import convicted, verdict_for
from shoal.transport.identity import generate_key
from shoal.verify.receipts import ReceiptSigner
from shoal.wire import Message
from shoal.wire.schema import Gossip, Receipt
from testkit.faults import Noise
from testkit.faulty import make_faulty
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import connect_over, peer_of, steer_through, would_route_over
from tests.helpers.inprocess import wait_until

pytestmark = pytest.mark.timeout(90)

SWARM_ID = "verdict-spread"
LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
MODEL_SEED = 0
K = 8
NEW_TOKENS = 24
SPREAD_TIMEOUT = 10.0  # gossip rounds of 0.2 s: a verdict reaches 4 servers in well under a second


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("verdict-model"), "llama", MODEL_SEED, tokenizer=char_tokenizer())


class World:
    def __init__(self, swarm: InProcessSwarm):
        self.swarm = swarm
        self.low = swarm.add(LOW)
        self.honest = [swarm.add(HIGH), swarm.add(HIGH)]
        self.liar = swarm.add(HIGH, lambda server: make_faulty(server, [Noise(0.1, seed=1)]))
        self.model = self.low.presence.model

    @property
    def servers(self) -> list[LocalServer]:
        return [self.low, *self.honest, self.liar]

    def on_loop(self, fn):
        async def call():
            return fn()

        return self.swarm.runtime.run(call())

    def convicted_by(self, server: LocalServer) -> set[str]:
        return self.on_loop(lambda: set(convicted(server.presence.service.table, self.model)))

    def status(self, via: LocalServer) -> dict:
        """What ``shoal swarm status --json`` prints through ``via`` (its pull and summary, over this
        swarm's network instead of iroh)."""

        async def pull() -> dict:
            node = await self.swarm.start_node(self.swarm.transport, {})
            try:
                payload = await fetch_table(node, via.ticket, 5.0)
            finally:
                await node.close()
            table = RecordTable(SWARM_ID)
            table.merge_many(decode_table(payload))
            return json.loads(to_json(summarize(table, time.time(), rejected=payload.rejected)))

        return self.swarm.runtime.run(pull())


def online_and_reached(table) -> int:
    """Servers a table lists as online (not still joining) and whose server its peer has reached."""
    return sum(r.state is State.ONLINE for r in table.admitted())


@pytest.fixture(scope="module")
def world(model_dir):
    with InProcessSwarm(model_dir, [], swarm=SWARM_ID) as swarm:
        world = World(swarm)
        tables = [s.presence.service.table for s in world.servers]
        everywhere = lambda: all(world.on_loop(lambda t=t: online_and_reached(t)) == 4 for t in tables)  # noqa: E731
        wait_until(everywhere, SPREAD_TIMEOUT, "every server online and reached everywhere")
        yield world


def prompt() -> torch.Tensor:
    return torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(100))


def test_a_lie_caught_by_audit_convicts_the_liar_everywhere_and_a_second_client_avoids_it(world):
    liar = peer_of(world.liar)
    judges = sorted(peer_of(s) for s in world.honest)
    with connect_over(world.swarm, world.servers, verify="audit", audit_every=K) as first:
        route = steer_through(first, [world.low, world.liar])
        assert route == [peer_of(world.low), liar], "the chain does not go through the liar"
        first.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False)
        verification = first.verification
        assert verification.banned == (liar,), verification
        wait_until(lambda: verification.evidence_confirmed == 2, SPREAD_TIMEOUT, "both judges confirming")
        assert (verification.evidence_sent, verification.evidence_rejected) == (2, 0), verification
        # its audits saw both judges compute 2:4 (the auditor and the third replica): their verdicts count for it
        assert all(HIGH in verification.vouched.get(judge, []) for judge in judges), verification.vouched
        assert liar not in verification.vouched
    for server in world.servers:
        what = f"{peer_of(server)[:10]} convicting the liar"
        wait_until(lambda s=server: world.convicted_by(s) == {liar}, SPREAD_TIMEOUT, what)
    vouched = verification.vouched
    assert world.on_loop(lambda: set(convicted(world.low.presence.service.table, world.model, vouched=vouched))) == {
        liar
    }

    served_before = len(world.liar.server.record)
    with connect_over(world.swarm, [world.low], verify="audit", audit_every=K) as second:  # knows no HIGH server
        directory = second.blocks.directory
        assert sorted(s.peer_id for s in directory.spans) == sorted([peer_of(world.low), *judges])
        assert not would_route_over(second, world.liar)
        tokens = second.generate(prompt(), max_new_tokens=8, do_sample=False)
        assert tokens.shape == (1, 20)
        assert liar not in {s.peer_id for s in second.blocks.chain}
        assert second.verification.banned == ()  # nothing for it to catch: it never met the liar
    assert len(world.liar.server.record) == served_before, "the liar computed for the second client"

    status = world.status(world.low)
    (verdict,) = [v for v in status["verdicts"] if v["accused"] == liar]
    assert verdict == {
        "accused": liar, "model": world.model, "start": 2, "end": 4, "judges": judges, "ignored_judges": [],
        "electorate": 2, "needed": 2, "convicts": True, "advisory_judges": [],
    }  # fmt: skip
    servers = {s["peer"]: s["convicted"] for m in status["models"] for s in m["servers"]}
    assert servers == {peer_of(s): peer_of(s) == liar for s in world.servers}


def receipt_by(server: LocalServer, blocks: BlockRange = HIGH) -> Receipt:
    """A receipt ``server`` really signed (any client of it holds some)."""
    unsigned = Receipt(
        weights=b"w" * 16, start=blocks.start, end=blocks.end, session="framing1", position=0, n=1, step=1,
        inputs=b"i" * 16, outputs=b"o" * 16, codec="raw", adapter=b"", prompts=False, state=b"c" * 16,
        compute="f32/cpu", signature=b"",
    )  # fmt: skip
    return server.server.signer.sign(unsigned)


def test_framing_and_forged_verdicts_convict_nobody_and_are_counted(world):
    framer, framed = world.honest
    evidence = bytes(32)
    # a server of the blocks frames another one, through its own presence (signed, gossiped, re-signed)
    framing = verdict_for(
        swarm=SWARM_ID, judge=peer_of(framer), accused=peer_of(framed), model=world.model, blocks=HIGH,
        evidence=evidence, receipt=receipt_by(framed),
    )  # fmt: skip
    world.on_loop(lambda: framer.presence.jurisdiction.publish(framing))
    # a key that serves nothing, and a forgery (the receipt is the outsider's, not the accused's)
    key = generate_key()
    outsider = ReceiptSigner(key).peer_id
    stranger = verdict_for(
        swarm=SWARM_ID, judge=outsider, accused=peer_of(framed), model=world.model, blocks=HIGH,
        evidence=evidence, receipt=receipt_by(framed),
    )  # fmt: skip
    forged = verdict_for(
        swarm=SWARM_ID, judge=outsider, accused=peer_of(world.low), model=world.model, blocks=LOW,
        evidence=evidence, receipt=ReceiptSigner(key).sign(receipt_by(framed, LOW)),
    )  # fmt: skip
    rejected_before = world.on_loop(lambda: world.low.presence.service.table.rejected["bad_receipt"])

    async def inject() -> None:
        node = await world.swarm.start_node(world.swarm.transport, {}, secret_key=key)
        try:
            push = encode_payload(PushRequest(records=[sign(stranger, key).data, sign(forged, key).data]))
            await node.request(world.low.ticket, SWARM, Message("gossip", 1, Gossip(op="push"), [blob(push)]), 5.0)
        finally:
            await node.close()

    world.swarm.runtime.run(inject())

    def seen(server: LocalServer) -> bool:
        table = server.presence.service.table
        return world.on_loop(lambda: {v.judge for v in table.verdicts() if v.accused == peer_of(framed)}) == {
            peer_of(framer),
            outsider,
        }

    for server in world.servers:
        wait_until(lambda s=server: seen(s), SPREAD_TIMEOUT, f"the framing verdicts at {peer_of(server)[:10]}")
    liar = peer_of(world.liar)
    for server in world.servers:
        assert world.convicted_by(server) <= {liar}, "an honest server is convicted"
        assert world.on_loop(lambda s=server: [v for v in s.presence.service.table.verdicts() if v.judge == outsider
                                                and v.accused == peer_of(world.low)]) == []  # fmt: skip
    assert world.on_loop(lambda: world.low.presence.service.table.rejected["bad_receipt"]) == rejected_before + 1

    status = world.status(world.low)
    (tally,) = [v for v in status["verdicts"] if v["accused"] == peer_of(framed)]
    # the electorate of the framed server's blocks: the framer and the liar (online) - one of two is no majority
    assert (tally["judges"], tally["ignored_judges"], tally["electorate"], tally["needed"], tally["convicts"]) == (
        [peer_of(framer)],
        [outsider],
        2,
        2,
        False,
    )
    assert status["rejected"]["bad_receipt"] >= 1
    with connect_over(world.swarm, [world.low]) as client:
        assert would_route_over(client, framed), "the framed server is avoided"
