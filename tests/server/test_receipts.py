"""Signed step receipts end to end, on an in-process swarm of real block servers: servers sign what
they computed when asked, clients check every receipt, and a receipt that does not vouch for the
answer (another key, an equivocating server in a push chain) fails its hop like a crash and bans
the server blamed. A server that does not announce receipts is never asked for one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import pytest
import torch
from torch import Tensor

from shoal.client.remote.driver import ChainDriver
from shoal.client.remote.hops import Hop
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer, Prepare
from shoal.protocols import BLOCKS
from shoal.server.handler import BlockServer
from shoal.verify.receipts import (
    LIAR_BAN_SECONDS,
    Equivocation,
    Receipt,
    ReceiptMismatch,
    ReceiptSigner,
    signed_by,
    tensor_digest,
)
from shoal.wire import Message
from shoal.wire.schema import CAPABILITIES, RECEIPTS, Empty, ForwardReply, ForwardRequest, StepReply
from testkit.faults import Equivocate
from testkit.faulty import make_faulty
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.inprocess import blocks_output, no_server_errors  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]

A, B = BlockRange(0, 2), BlockRange(2, 4)
HIDDEN = 64
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])
MAX_RECEIPT_BYTES = 200


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


def hidden(total: int, seed: int = 3) -> Tensor:
    return torch.randn(1, total, HIDDEN, generator=torch.Generator().manual_seed(seed))


def assert_close(got: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.abs().max()))


def peer(server: LocalServer) -> str:
    return server.node.id


def prefer(model, preferred: Sequence[LocalServer], avoided: Sequence[LocalServer]) -> None:
    """Make ``preferred`` the cheapest servers of the next route (their steps seem free)."""
    latency = model.blocks.directory.latency
    for server in preferred:
        latency.observed_ms[peer(server)] = 0.0
    for server in avoided:
        latency.observed_ms[peer(server)] = 50.0


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


def feed(session, x: Tensor, prefill: int = 5) -> Tensor:
    outputs = [session.step(x[:, :prefill], torch.arange(prefill)[None], None)]
    for t in range(prefill, x.shape[1]):
        outputs.append(session.step(x[:, t : t + 1], torch.full((1, 1), t), None))
    return torch.cat(outputs, dim=1)


def asked_receipts(record: list[bool]) -> Prepare:
    """A server that notes, for every step it runs, whether the step asked for a receipt."""

    def prepare(server: BlockServer) -> BlockServer:
        step = server._step

        async def spy(session, message, **options):
            record.append(message.meta.receipt)
            return await step(session, message, **options)

        server._step = spy
        return server

    return prepare


def without_receipts(record: list[bool]) -> Prepare:
    """A server of an older version: it does not announce RECEIPTS."""

    def prepare(server: BlockServer) -> BlockServer:
        server = asked_receipts(record)(server)
        server.info = msgspec.structs.replace(server.info, capabilities=CAPABILITIES - {RECEIPTS})
        return server

    return prepare


# ---- honest servers ------------------------------------------------------------------------------
@pytest.mark.parametrize("push", [True, False])
def test_every_step_of_every_hop_carries_a_receipt_that_verifies_in_at_most_200_bytes(
    swarms, reference, kept_receipts, reply_metadata, push
):
    swarm = swarms([(A, None), (B, None)])
    model = swarm.connect(push=push, refresh_period=0, routing_seed=0)
    session = model.blocks.open_session(batch_size=1, max_length=16)
    x = hidden(9)
    assert_close(feed(session, x), blocks_output(reference, x))
    assert len(kept_receipts) == 5  # the prefill and 4 one-token steps, each with a receipt per hop
    servers = {span.start: swarm.server(span) for span in (A, B)}
    hops = {hop.span.start: hop for hop in session._driver.hops}
    steps = [(0, 5), (5, 1), (6, 1), (7, 1), (8, 1)]  # (position, n)
    for receipts, (position, n) in zip(kept_receipts, steps, strict=True):
        assert sorted(receipts) == [0, 2]
        for start, receipt in receipts.items():
            assert signed_by(receipt, peer(servers[start]))
            assert (receipt.start, receipt.end) == (start, start + 2)
            assert (receipt.session, receipt.position, receipt.n) == (hops[start].session, position, n)
        # pushed: one client step id down the chain; driven hop by hop: one per hop
        assert (receipts[0].step == receipts[2].step) is push
    # on the wire: each reply's metadata with its receipt, less the same reply without it
    replies = [msgspec.msgpack.decode(raw, type=StepReply) for raw in reply_metadata]
    assert len(replies) == 10 and all(reply.receipt is not None for reply in replies)
    sizes = [len(raw) - len(msgspec.msgpack.encode(msgspec.structs.replace(reply, receipt=None)))
             for raw, reply in zip(reply_metadata, replies, strict=True)]  # fmt: skip
    assert max(sizes) <= MAX_RECEIPT_BYTES, sizes
    assert min(sizes) >= 64 + 2 * 16  # the signature and both digests really are there
    session.close()


def test_a_pushed_hops_receipt_digests_exactly_the_reply_of_the_hop_before(swarms, kept_receipts):
    """With push the second server decodes what the first pushed; the client recomputes that
    input digest from the first server's reply: the two servers' receipts chain up."""
    swarm = swarms([(A, None), (B, None)])
    model = swarm.connect(push=True, refresh_period=0, routing_seed=0)
    session = model.blocks.open_session(batch_size=1, max_length=16)
    x = hidden(3, seed=8)
    out = session.step(x, torch.arange(3)[None], None)
    ((receipts),) = kept_receipts
    assert swarm.server(A).server.counters.pushes_sent == 1
    assert receipts[0].inputs == tensor_digest([x, torch.arange(3)[None]])
    assert receipts[2].outputs == tensor_digest([out])
    assert receipts[0].inputs != receipts[2].inputs
    session.close()


def test_a_forward_asks_for_a_receipt_and_an_old_client_gets_empty_metadata(swarms, reference, monkeypatch):
    swarm = swarms([(A, None), (B, None)])
    model = swarm.connect(refresh_period=0)
    checked: list[Receipt] = []
    import shoal.client.remote.sequence as sequence_module

    check = sequence_module.check_forward_receipt

    def spy(*args, **kwargs):
        checked.append(check(*args, **kwargs))
        return checked[-1]

    monkeypatch.setattr(sequence_module, "check_forward_receipt", spy)
    x = hidden(4, seed=2)
    assert_close(model.blocks.forward(x, torch.arange(4)[None], None), blocks_output(reference, x))
    assert [(r.start, r.end, r.session, r.position, r.n) for r in checked] == [(0, 2, "", 0, 4), (2, 4, "", 0, 4)]

    async def bare_forward(asks: bool) -> Message:
        node = await swarm.network.start()
        try:
            tensors = [x, torch.arange(4)[None]]
            request = Message("forward", 1, ForwardRequest(receipt=asks), tensors)
            return await node.request(swarm.server(A).ticket, BLOCKS, request)
        finally:
            await node.close()

    old = model.blocks.runtime.run(bare_forward(False))
    assert bytes(old.meta) == msgspec.msgpack.encode(Empty())  # what an older client expects
    new = model.blocks.runtime.run(bare_forward(True))
    receipt = new.reply(ForwardReply).receipt
    assert signed_by(receipt, peer(swarm.server(A))) and receipt.outputs == tensor_digest([new.tensors[0]])


# ---- servers whose receipts do not vouch for their answers ---------------------------------------
def test_a_receipt_signed_by_another_key_fails_the_hop_and_bans_the_server(swarms, reference):
    swarm = swarms([(A, None), (B, None), (B, None)])
    forger, spare = swarm.servers[1], swarm.servers[2]
    forger.server.signer = ReceiptSigner(bytes(range(32)))  # a valid signature, by someone else
    model = swarm.connect(refresh_period=0, routing_seed=0)
    prefer(model, [swarm.servers[0], forger], [spare])
    session = model.blocks.open_session(batch_size=1, max_length=16)
    assert [s.peer_id for s in session.chain] == [peer(swarm.servers[0]), peer(forger)]
    x = hidden(7)
    assert_close(feed(session, x), blocks_output(reference, x))
    (record,) = session.recoveries
    assert record.failed == peer(forger) and record.position == 0
    assert [s.peer_id for s in session.chain] == [peer(swarm.servers[0]), peer(spare)]
    bans = model.blocks.directory.bans
    assert bans.banned(peer(forger)) and not bans.banned(peer(spare)) and not bans.banned(peer(swarm.servers[0]))
    assert bans._until[peer(forger)] - bans.clock() > LIAR_BAN_SECONDS - 60  # banned for an hour, not a backoff
    session.close()


def test_an_equivocating_server_in_a_push_chain_is_caught_and_generation_stays_honest(swarms, reference, monkeypatch):
    """The liar answers the client honestly and pushes the next server its output plus noise. The
    next server's receipt of its inputs disagrees with the reply: the liar is blamed (not the
    witness), banned, and replaced; ``generate`` returns exactly the honest tokens."""
    swarm = swarms([(A, lambda server: make_faulty(server, [Equivocate(0.3, seed=4)])), (A, None), (B, None)])
    liar, honest, second = swarm.servers
    caught: list[Equivocation] = []
    failed = ChainDriver._check

    def spy(self, *args, **kwargs):
        try:
            return failed(self, *args, **kwargs)
        except Equivocation as exc:
            caught.append(exc)
            raise

    monkeypatch.setattr(ChainDriver, "_check", spy)
    model = swarm.connect(push=True, refresh_period=0, routing_seed=0)
    prefer(model, [liar, second], [honest])
    got = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, reference.generate(PROMPT, max_new_tokens=8, do_sample=False))
    lies = liar.server.record.entries("equivocate")
    assert [(e.step, e.positions) for e in lies] == [(0, (0, 6))]  # its first push: caught at once
    (exc,) = caught
    assert (exc.peer, exc.hop, exc.witness) == (peer(liar), 0, peer(second))
    session = model.blocks._session
    (record,) = session.recoveries
    assert record.failed == peer(liar)
    assert [s.peer_id for s in session.chain] == [peer(honest), peer(second)]
    bans = model.blocks.directory.bans
    assert bans.banned(peer(liar)) and not bans.banned(peer(second)) and not bans.banned(peer(honest))
    assert liar.server.counters.pushes_sent == 1 and honest.server.counters.pushes_sent == 8


# ---- servers that do not announce receipts -------------------------------------------------------
@pytest.mark.parametrize("mixed", [False, True])
def test_servers_without_receipts_are_never_asked_for_one(swarms, reference, kept_receipts, mixed):
    """No server announces RECEIPTS: nothing is asked, the session works as before. Mixed (only B
    announces it): B is asked and checked, A never; the push segment ends between them (A could not
    tell B to sign)."""
    asked: Mapping[BlockRange, list[bool]] = {A: [], B: []}
    b_prepare = asked_receipts(asked[B]) if mixed else without_receipts(asked[B])
    swarm = swarms([(A, without_receipts(asked[A])), (B, b_prepare)])
    # verify="off": this is the push segment of a client that does not audit (an auditing one pushes
    # only over hops whose receipts pin their inputs: test_client_capabilities)
    model = swarm.connect(push=True, refresh_period=0, routing_seed=0, verify="off")
    session = model.blocks.open_session(batch_size=1, max_length=16)
    x = hidden(8)
    assert_close(feed(session, x), blocks_output(reference, x))
    assert asked[A] == [False] * 4
    assert asked[B] == [mixed] * 4
    assert [sorted(receipts) for receipts in kept_receipts] == [[2] if mixed else []] * 4
    assert swarm.server(A).server.counters.pushes_sent == (0 if mixed else 4)
    session.close()


# ---- the cache state and the compute a server signs (review 2, findings 1 and 7) -----------------
class _Misstating:
    """A node key whose receipts misstate a field, ``lie(count, receipt)`` (count: receipts signed so far)
    returning the changed fields; the server computes honestly, only what it signs is wrong."""

    def __init__(self, signer: ReceiptSigner, lie):
        self._signer, self._lie, self.signed = signer, lie, 0
        self.peer_id = signer.peer_id

    def sign(self, receipt: Receipt) -> Receipt:
        self.signed += 1
        return self._signer.sign(msgspec.structs.replace(receipt, **self._lie(self.signed, receipt)))


@pytest.mark.parametrize(
    "lie, what, caught_at",
    [
        (lambda count, receipt: {"state": bytes(16)}, ("state",), 0),  # the chain judges reject: caught at once
        (lambda count, receipt: {"compute": "f32/cuda" if count % 2 == 0 else "f32/cpu"}, ("compute",), 5),
    ],
    ids=["zero-state", "alternating-device"],
)
def test_a_server_misstating_its_cache_state_or_compute_is_caught_banned_and_replaced(
    swarms, reference, monkeypatch, lie, what, caught_at
):
    """A liar whose receipts would make any evidence against it look forged to judges (a cache state
    that is not the chain of its inputs; a compute that changes within a session): the client refuses
    its first such receipt, bans it and finishes on the replica, with the honest answer."""
    swarm = swarms([(A, None), (B, None), (B, None)])
    liar, spare = swarm.servers[1], swarm.servers[2]
    liar.server.signer = _Misstating(liar.server.signer, lie)
    caught: list[ReceiptMismatch] = []
    check = ChainDriver._check

    def spy(self, *args, **kwargs):
        try:
            return check(self, *args, **kwargs)
        except ReceiptMismatch as exc:
            caught.append(exc)
            raise

    monkeypatch.setattr(ChainDriver, "_check", spy)
    model = swarm.connect(push=True, refresh_period=0, routing_seed=0)
    prefer(model, [swarm.servers[0], liar], [spare])
    session = model.blocks.open_session(batch_size=1, max_length=16)
    x = hidden(8)
    assert_close(feed(session, x), blocks_output(reference, x))
    (exc,) = caught
    assert (exc.peer, exc.what) == (peer(liar), what)
    (record,) = session.recoveries
    assert (record.failed, record.position) == (peer(liar), caught_at)
    assert [s.peer_id for s in session.chain] == [peer(swarm.servers[0]), peer(spare)]
    bans = model.blocks.directory.bans
    assert bans.banned(peer(liar)) and not bans.banned(peer(spare)) and not bans.banned(peer(swarm.servers[0]))
    session.close()


@pytest.mark.parametrize("push", [True, False])
def test_the_clients_chain_of_each_hop_is_the_servers_through_rollbacks(swarms, reference, push):
    """Prefill, decode, a rollback into the prefill with other inputs, more decoding: every receipt's
    state checks (no hop fails), and each hop's chain in the driver is its server's, byte for byte."""
    swarm = swarms([(A, None), (B, None)])
    model = swarm.connect(push=push, refresh_period=0, routing_seed=0)
    session = model.blocks.open_session(batch_size=1, max_length=16)
    x, y = hidden(8), hidden(8, seed=11)
    feed(session, x)
    session.position = 3  # the client drops positions 3.. (a rejected draft, a retry)
    rolled = [session.step(y[:, 3:5], torch.arange(3, 5)[None], None)]
    rolled += [session.step(y[:, t : t + 1], torch.full((1, 1), t), None) for t in range(5, 8)]
    expected = blocks_output(reference, torch.cat([x[:, :3], y[:, 3:]], dim=1))
    assert_close(torch.cat(rolled, dim=1), expected[:, 3:])
    assert session.recoveries == []
    for hop in session._driver.hops:
        ours = session._driver._signed[hop].chain
        theirs = swarm.server(hop.span.blocks).server._sessions[hop.session].state
        assert len(ours) == len(theirs) == 8
        assert [ours.at(p) for p in range(9)] == [theirs.at(p) for p in range(9)]
    session.close()


def test_a_server_without_a_key_hashes_no_cache_state(swarms, reference, monkeypatch):
    """Only a server that signs receipts keeps the chain: one without a key (it does not announce
    RECEIPTS, so its client keeps none either) never hashes a step's inputs for it."""
    import shoal.verify.state as state_module

    calls: list[int] = []
    chain_states = state_module.chain_states

    def counted(previous, hidden, position_ids, mask_columns):
        calls.append(hidden.shape[1])
        return chain_states(previous, hidden, position_ids, mask_columns)

    monkeypatch.setattr(state_module, "chain_states", counted)

    def keyless(server: BlockServer) -> BlockServer:
        server.signer = None
        server.info = msgspec.structs.replace(server.info, capabilities=CAPABILITIES - {RECEIPTS})
        return server

    whole = BlockRange(0, 4)
    for prepare, hashed in ((keyless, []), (None, [5, 5] + [1] * 8)):  # a keyed server and its client
        calls.clear()
        swarm = swarms([(whole, prepare)])
        model = swarm.connect(refresh_period=0)
        session = model.blocks.open_session(batch_size=1, max_length=16)
        x = hidden(9)
        assert_close(feed(session, x), blocks_output(reference, x))
        assert sorted(calls, reverse=True) == hashed
        (server_session,) = swarm.server(whole).server._sessions.values()
        assert len(server_session.state) == (0 if prepare is keyless else 9)
        session.close()


def test_auditors_chains_follow_their_servers_through_a_rollback(swarms, reference):
    """Audit mode: an auditor is a hop of its own whose audit steps (replays of the recorded inputs)
    extend its chain, and a rollback cuts it. Every receipt checks (nothing disagrees, nobody is banned)
    and each auditor's chain in the driver is its server's."""
    swarm = swarms([(A, None), (A, None), (B, None), (B, None)])
    model = swarm.connect(verify="audit", audit_every=2, refresh_period=0, routing_seed=0)
    session = model.blocks.open_session(batch_size=1, max_length=16)
    x, y = hidden(9), hidden(9, seed=12)
    feed(session, x)
    session.position = 4
    for t in range(4, 9):
        session.step(y[:, t : t + 1], torch.full((1, 1), t), None)
    session.audit()
    verification = session.verification
    assert verification.audits >= 8 and verification.disagreements == 0 and not verification.banned
    bans = model.blocks.directory.bans
    assert session.recoveries == [] and not any(bans.banned(peer(server)) for server in swarm.servers)
    auditors = [track.auditor for track in session._audits.tracks]
    assert len(auditors) == 2 and all(auditor is not None for auditor in auditors)
    for auditor in auditors:
        ours = session._driver._signed[auditor].chain
        theirs = next(s for s in swarm.servers if s.node.id == auditor.span.peer_id).server._sessions[auditor.session]
        assert len(ours) == len(theirs.state) == 9
        assert [ours.at(p) for p in range(10)] == [theirs.state.at(p) for p in range(10)]
    session.close()
