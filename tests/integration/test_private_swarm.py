"""Private swarms (issue #33): an owner key, member certificates, revocation.

One in-process private swarm of a tiny random llama (``[0:2]`` and ``[2:4]``, each server a member
with its own key and certificate). A member client gets local transformers' tokens, its steps pushed
from server to server (each server presents its certificate to the next). Everyone else is refused
where its streams enter, with an error that says why: a client or node without a certificate, with
an expired one, with one for another peer, a serve-only member asking for a session; a server
without a valid certificate does not start. The owner revokes a member by a signed record gossiped
through the tables: its records leave every table and its client is refused.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.checkpoints import model_fingerprints, model_name
from shoal.client import AutoDistributedModelForCausalLM
from shoal.errors import Forbidden, UsageError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.protocols import BLOCKS
from shoal.swarm.members import certificate_text, issue, public_key
from shoal.swarm.messages import PushRequest, encode_payload
from shoal.swarm.records import ModelRecord, RevocationRecord, State, sign
from shoal.swarm.service import SWARM, blob
from shoal.swarm.swarmid import model_digest, new_swarm_id, owner_tag
from shoal.transport.identity import generate_key
from shoal.wire import Message
from shoal.wire.schema import Gossip
from shoal.wire.schema import PushRequest as StepPush
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.inprocess import wait_until
from tests.helpers.parity import greedy_with_gap, honest_greedy

pytestmark = pytest.mark.timeout(120)

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])
NEW_TOKENS = 12
OWNER = generate_key()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("private") / "tiny", "llama", 0, tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def expected(model_dir) -> torch.Tensor:
    return honest_greedy(model_dir, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("private") / "tiny2", "llama", 2, tokenizer=char_tokenizer())


def invite(key: bytes, **kwargs) -> bytes:
    return issue(OWNER, public_key(key), now=time.time(), **kwargs)


class Private:
    """The swarm, its two member servers, and helpers to act as members, strangers and the owner."""

    def __init__(self, swarm: InProcessSwarm, keys: Path):
        self.swarm, self.keys = swarm, keys
        self.low, self.high = self.member_server(LOW, "low"), self.member_server(HIGH, "high")
        self.servers = [self.low, self.high]

    def keyfile(self, name: str) -> tuple[Path, bytes]:
        path = self.keys / f"{name}.key"
        path.write_bytes(generate_key())
        return path, path.read_bytes()

    def member_server(self, span: BlockRange, name: str, **cert) -> LocalServer:
        path, key = self.keyfile(name)
        return self.swarm.add(span, identity_file=path, member_cert=invite(key, **cert))

    def client(self, key: bytes | None = None, cert: bytes | None = None, model_dir: Path | None = None, **kwargs):
        return AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir or self.swarm.model_dir), initial_peers=[self.low.ticket], transport=self.swarm.transport,
            start_node=self.swarm.start_node, refresh_period=0, identity=key,
            member_cert=certificate_text(cert) if cert is not None else None, **kwargs,
        )  # fmt: skip

    def request(self, key: bytes, server: LocalServer, protocol, message: Message, credential: bytes | None = None):
        """One request from a node of key ``key`` (presenting ``credential``) to ``server``."""

        async def call():
            node = await self.swarm.start_node(self.swarm.transport, secret_key=key)
            node.credential = credential
            try:
                return await node.request(server.ticket, protocol, message, 5.0)
            finally:
                await node.close()

        return self.swarm.runtime.run(call())

    def gossip_push(self, key: bytes, server: LocalServer, records: list[bytes], credential: bytes | None = None):
        payload = blob(encode_payload(PushRequest(records=records)))
        return self.request(key, server, SWARM, Message("gossip", 1, Gossip(op="push"), [payload]), credential)

    def online(self, n: int, model: str = "tiny") -> bool:
        """Whether every table holds ``model`` and ``n`` online servers of it, each reached by that
        table's peer (a server pushes only to a next hop it has reached)."""
        return all(
            t.model(model) and sum(r.state is State.ONLINE for r in t.admitted(model)) == n for t in self.tables()
        )

    def tables(self):
        return [s.presence.service.table for s in self.swarm.servers if s.alive]


@pytest.fixture
def private(model_dir, tmp_path):
    fps = [bytes.fromhex(f) for f in model_fingerprints(model_dir)]
    pin = model_digest(model_name(str(model_dir)), len(fps), fps)
    with InProcessSwarm(model_dir, [], swarm=new_swarm_id(pin, owner_tag(public_key(OWNER)))) as swarm:
        world = Private(swarm, tmp_path)
        wait_until(lambda: world.online(2), 10.0, what="both members online and the model in every table")
        yield world


def generate(model) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)


def test_a_member_client_gets_the_tokens_of_transformers_pushed_between_members(private, expected):
    key = generate_key()
    with private.client(key, invite(key)) as model:
        assert torch.equal(generate(model), expected)
    assert private.high.server.counters.pushes_received > 0  # the low server presented its certificate
    assert all(t.rejected["not_member"] == 0 for t in private.tables())


def test_a_member_fetches_a_span_under_its_own_key_and_certificate(private, tmp_path, monkeypatch):
    """A private swarm's members give their files to members only: a server joining with no files
    fetches from the endpoint of its own key (``shoal serve --identity``), not a fresh one."""
    from shoal.weights.join import fetch_weights

    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    key, swarm = generate_key(), private.swarm

    def fetch(**kwargs):
        tickets = tuple(swarm.tickets())
        fetching = fetch_weights(swarm.start_node, swarm.transport, tickets, "tiny", LOW, credential=invite(key),
                                 **kwargs)  # fmt: skip
        return swarm.runtime.run(fetching, timeout=60)

    with pytest.raises(Forbidden):  # its certificate presented by a node of another key
        fetch()
    report = fetch(secret_key=key)
    assert report.fetched > 0 and report.rejected == 0


def test_strangers_are_refused_where_they_enter_and_told_why(private):
    stranger = generate_key()
    with pytest.raises(Forbidden, match=r"is not a member of private swarm .* presented no certificate"):
        private.client()
    with pytest.raises(Forbidden, match="presented no certificate"):  # blocks protocol: info
        private.request(stranger, private.low, BLOCKS, Message("info", 1)).reply()
    record = sign(RevocationRecord(private.swarm.swarm_id, public_key(stranger), public_key(stranger), 1.0, 2.0),
                  stranger).data  # fmt: skip
    with pytest.raises(Forbidden, match="presented no certificate"):  # swarm protocol: a gossip push
        private.gossip_push(stranger, private.high, [record]).reply()
    push = Message("push", 1, StepPush(session="s", token="t", position=0, step=0))
    with pytest.raises(Forbidden, match="presented no certificate"):  # a server-to-server push
        private.request(stranger, private.high, BLOCKS, push).reply()
    other_owner = issue(generate_key(), public_key(stranger), now=time.time())
    with pytest.raises(Forbidden, match="its certificate is for another swarm"):
        private.request(stranger, private.low, BLOCKS, Message("info", 1), other_owner).reply()
    borrowed = invite(generate_key())  # a member's certificate, presented by someone else
    with pytest.raises(Forbidden, match="presented the certificate of peer"):
        private.request(stranger, private.low, BLOCKS, Message("info", 1), borrowed).reply()
    assert all(len(t.servers()) == 2 for t in private.tables())


def test_expired_and_serve_only_certificates_and_non_member_servers(private):
    key = generate_key()
    with pytest.raises(Forbidden, match="expired"):
        private.client(key, invite(key, expires=time.time() - 1))
    serve_only = private.client(key, invite(key, servers_only=True))  # it may read the table, not open
    with serve_only as model, pytest.raises(Forbidden, match="may only serve"):
        generate(model)
    path, _ = private.keyfile("stranger")
    with pytest.raises(UsageError, match="presented no certificate"):
        private.swarm.add(HIGH, identity_file=path)
    with pytest.raises(UsageError, match="expired"):
        private.member_server(HIGH, "late", expires=time.time() - 1)


def test_the_owner_revokes_a_member_and_its_records_leave_every_table(private, expected):
    third = private.member_server(HIGH, "third")
    wait_until(lambda: private.online(3), 10.0, what="the third member online in every table")
    client_key = generate_key()
    cert = invite(client_key)
    now = time.time()
    revocations = [
        sign(RevocationRecord(private.swarm.swarm_id, public_key(OWNER), member, now, now + 86400), OWNER).data
        for member in (third.node.id, public_key(client_key))
    ]
    private.gossip_push(OWNER, private.low, revocations)  # the owner's node needs no certificate
    members = [s.presence.service.table for s in private.servers]  # the revoked one hears no more gossip
    wait_until(lambda: all(len(t.servers("tiny")) == 2 for t in members), 10.0,
               what="the revoked server out of every member's table")  # fmt: skip
    with pytest.raises(Forbidden, match="revoked the membership"):
        private.client(client_key, cert)
    time.sleep(0.5)  # gossip rounds: the revoked server's refreshes stay out
    assert all(third.node.id not in {r.peer for r in t.servers()} and t.rejected["not_member"] for t in members)
    key = generate_key()
    with private.client(key, invite(key)) as model:  # the others serve on
        assert torch.equal(generate(model), expected)
        assert third.node.id not in {s.peer_id for s in model.blocks.chain}


def test_the_owner_adds_a_second_model_that_members_serve_and_use(private, second_dir):
    reference = AutoModelForCausalLM.from_pretrained(str(second_dir), dtype=torch.float32).eval()
    expected, gap = greedy_with_gap(reference, PROMPT, max_new_tokens=NEW_TOKENS)
    assert gap > 1e-3
    fps = tuple(bytes.fromhex(f) for f in model_fingerprints(second_dir))
    now = time.time()
    added = ModelRecord(private.swarm.swarm_id, public_key(OWNER), "tiny2", len(fps), fps, now, now + 86400)
    private.gossip_push(OWNER, private.low, [sign(added, OWNER).data])
    wait_until(lambda: all(t.model("tiny2") for t in private.tables()), 10.0, what="the added model in every table")
    with InProcessSwarm(second_dir, [], swarm=private.swarm.swarm_id, start_node=private.swarm.start_node) as second:
        for span, name in ((LOW, "second-low"), (HIGH, "second-high")):
            path, key = private.keyfile(name)
            second.add(span, join=(private.low.ticket,), identity_file=path, member_cert=invite(key))
        wait_until(lambda: private.online(2, "tiny2") and private.online(2), 10.0, what="both models served")
        key = generate_key()
        with private.client(key, invite(key), model_dir=second_dir) as model:
            assert torch.equal(generate(model), expected)
