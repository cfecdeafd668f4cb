"""Signed step receipts end to end, on an in-process swarm of real block servers: servers sign what
they computed when asked, clients check every receipt, and a receipt that does not vouch for the
answer (another key, an equivocating server in a push chain) fails its hop like a crash and bans
the server blamed. A server that does not announce receipts is never asked for one."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import pytest
import torch

from shoal.client.remote.driver import ChainDriver
from shoal.ids import BlockRange
from shoal.protocols import BLOCKS
from shoal.verify.receipts import LIAR_BAN_SECONDS, Equivocation, Receipt, ReceiptSigner, signed_by, tensor_digest
from shoal.wire import Message
from shoal.wire.schema import Empty, ForwardReply, ForwardRequest, StepReply
from testkit.faults import Equivocate
from testkit.faulty import make_faulty
from tests.helpers.inprocess import blocks_output, no_server_errors  # noqa: F401 (a fixture)
from tests.server.receipts.bench import (
    MAX_RECEIPT_BYTES,
    PROMPT,
    A,
    B,
    asked_receipts,
    assert_close,
    feed,
    hidden,
    peer,
    prefer,
    without_receipts,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]


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
