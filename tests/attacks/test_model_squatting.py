"""Squatting a swarm's model (issue #33): an attacker signs a model record of the swarm's model
name with its own weights' fingerprints, and server records of its own servers (really serving
those weights), hoping its record defines the model where the real one is absent, so that clients
route over its servers and honest servers' records are purged.

A pinned swarm (its id carries the digest of its model, :mod:`shoal.swarm.swarmid`) refuses that
record in every table, the client's too: with the honest model record absent the client holding the
real ticket refuses to route at all (and says why); with it present nothing changes: the client
gets local transformers' tokens over the honest servers. The same attack on an unpinned swarm id
succeeds (the control): the client routes over the attacker's servers.

Everything runs in one process on one memory network: honest servers (:class:`InProcessSwarm`),
the attacker's standalone servers of another tiny llama saved under the same directory name, and
the attacker's gossip peer, which answers any table pull with its forgeries.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import torch

from shoal.checkpoints import model_fingerprints, model_name
from shoal.client import AutoDistributedModelForCausalLM
from shoal.errors import ShoalError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.swarm.members import public_key
from shoal.swarm.messages import PushReply, PushRequest, SyncReply, TableReply, encode_payload
from shoal.swarm.records import ModelRecord, ServerRecord, SignedRecord, State, sign
from shoal.swarm.service import SWARM, blob
from shoal.swarm.swarmid import model_digest, new_swarm_id
from shoal.transport import Ticket
from shoal.transport.identity import generate_key
from shoal.wire import Message, error_message
from shoal.wire.schema import Gossip
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.inprocess import wait_until
from tests.helpers.parity import honest_greedy

pytestmark = pytest.mark.timeout(120)

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])
NEW_TOKENS = 12


def prints(model_dir: Path) -> tuple[bytes, ...]:
    return tuple(bytes.fromhex(f) for f in model_fingerprints(model_dir))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    """The honest checkpoint and the attacker's, under the same directory name (the same model name)."""
    root = tmp_path_factory.mktemp("squat")
    honest = tiny_checkpoint(root / "honest" / "tiny", "llama", 0, tokenizer=char_tokenizer())
    attacker = tiny_checkpoint(root / "attacker" / "tiny", "llama", 1, tokenizer=char_tokenizer())
    assert model_name(str(honest)) == model_name(str(attacker)) and prints(honest) != prints(attacker)
    return honest, attacker


@pytest.fixture(scope="module")
def expected(dirs) -> torch.Tensor:
    return honest_greedy(dirs[0], PROMPT, NEW_TOKENS)


def pinned_id(model_dir: Path) -> str:
    fps = prints(model_dir)
    return new_swarm_id(model_digest(model_name(str(model_dir)), len(fps), fps))


class Attacker:
    """The attacker's servers (standalone, on the honest swarm's network) and its forged records."""

    def __init__(self, honest: InProcessSwarm, attacker_dir: Path, swarm_id: str, keys_dir: Path):
        self.honest, self.swarm_id = honest, swarm_id
        self.servers = InProcessSwarm(attacker_dir, [], start_node=honest.start_node)
        self.keys: dict[str, bytes] = {}
        for i, span in enumerate((LOW, HIGH)):
            keyfile = keys_dir / f"attacker-{i}.key"
            local = self.servers.add(span, identity_file=keyfile)
            self.keys[local.node.id] = keyfile.read_bytes()
        self.name, fps = model_name(str(attacker_dir)), prints(attacker_dir)
        now = time.time()
        publisher = generate_key()
        forged_model = ModelRecord(swarm_id, public_key(publisher), self.name, len(fps), fps, now, now + 120)
        self.records = [sign(forged_model, publisher), *(self.server_record(s, fps, now) for s in self.servers.servers)]

    def server_record(self, local: LocalServer, fps: tuple[bytes, ...], now: float) -> SignedRecord:
        ticket = local.node.ticket()
        record = ServerRecord(
            self.swarm_id, local.node.id, ticket.addrs, None, self.name, local.blocks,
            fps[local.blocks.start : local.blocks.end], State.ONLINE, 1e6, 4096, (), "9.9", now, now + 120,
            step_ms=0.001,
        )  # fmt: skip
        return sign(record, self.keys[local.node.id])

    @property
    def peers(self) -> set[str]:
        return {s.node.id for s in self.servers.servers}

    @contextlib.contextmanager
    def gossip_peer(self):
        """A node of the network that answers every swarm request with the forgeries (a table that
        lacks the honest model record); yields its ticket, with the swarm id."""

        async def handle(stream, peer_id: str) -> None:
            request = await stream.recv(5.0)
            op, records = request.meta.op, [s.data for s in self.records]
            payload = {
                "table": TableReply(records=records, rejected={}),
                "sync": SyncReply(records=records),
                "push": PushReply(),
            }.get(op)
            if payload is None:
                await stream.send(error_message(request.id, "bad_request", "no"))
            else:
                await stream.send(Message("result", request.id, tensors=[blob(encode_payload(payload))]))

        run = self.honest.runtime.run
        node = run(self.honest.start_node(self.honest.transport, {SWARM: handle}))
        try:
            yield node.ticket(self.swarm_id)
        finally:
            run(node.close())

    def push_to(self, server: LocalServer) -> None:
        """Gossip the forgeries straight into an honest server's table (as any peer may)."""
        message = Message("gossip", 1, Gossip(op="push"), [blob(encode_payload(PushRequest(records=[
            s.data for s in self.records])))])  # fmt: skip

        async def push() -> None:
            node = await self.honest.start_node(self.honest.transport)
            try:
                await node.request(server.ticket, SWARM, message, 5.0)
            finally:
                await node.close()

        self.honest.runtime.run(push())

    def close(self) -> None:
        self.servers.close()


def connect(swarm: InProcessSwarm, model_dir: Path, tickets: list[Ticket]):
    return AutoDistributedModelForCausalLM.from_pretrained(
        str(model_dir), initial_peers=tickets, transport=swarm.transport, start_node=swarm.start_node,
        refresh_period=0, route_wait=0,
    )  # fmt: skip


def generate(model) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.mark.parametrize("pinned", [True, False])
def test_with_the_model_record_absent_a_squatter_cannot_draw_a_client(dirs, expected, tmp_path, pinned):
    honest_dir, attacker_dir = dirs
    swarm_id = pinned_id(honest_dir) if pinned else "unpinned-swarm"
    with InProcessSwarm(honest_dir, []) as network:
        attacker = Attacker(network, attacker_dir, swarm_id, tmp_path)
        try:
            with attacker.gossip_peer() as real_ticket:  # the swarm's real id; its table lacks the honest record
                if pinned:
                    with pytest.raises(ShoalError, match=r"has no model 'tiny'.*1 model records refused"):
                        connect(network, honest_dir, [real_ticket])
                    assert all(s.server.counters.sessions_opened == 0 for s in attacker.servers.servers)
                else:  # the control: first come defines the model, and the client routes over the squatter
                    with connect(network, honest_dir, [real_ticket]) as model:
                        got = generate(model)
                        assert {s.peer_id for s in model.blocks.chain} <= attacker.peers
                    assert not torch.equal(got, expected)
        finally:
            attacker.close()


def test_with_the_model_record_present_a_squatter_changes_nothing(dirs, expected, tmp_path):
    honest_dir, attacker_dir = dirs
    swarm_id = pinned_id(honest_dir)
    with InProcessSwarm(honest_dir, [], swarm=swarm_id) as swarm:
        honest = [swarm.add(LOW), swarm.add(HIGH)]
        tables = [s.presence.service.table for s in honest]
        wait_until(lambda: all(len(t.servers("tiny")) == 2 and t.model("tiny") for t in tables), 10.0,
                   what="both honest servers and the model record in every table")  # fmt: skip
        attacker = Attacker(swarm, attacker_dir, swarm_id, tmp_path)
        try:
            before = [t.rejected["fingerprint_mismatch"] for t in tables]
            for server in honest:
                attacker.push_to(server)
            for table, count in zip(tables, before, strict=True):
                assert table.rejected["fingerprint_mismatch"] >= count + 3  # the model record and both servers
                assert table.model("tiny").fingerprints == prints(honest_dir)
                assert {r.peer for r in table.servers("tiny")} == {s.node.id for s in honest}
            time.sleep(0.5)  # a few gossip rounds: nothing forged comes back
            with connect(swarm, honest_dir, [honest[0].ticket]) as model:
                assert torch.equal(generate(model), expected)
                assert {s.peer_id for s in model.blocks.chain} == {s.node.id for s in honest}
        finally:
            attacker.close()
