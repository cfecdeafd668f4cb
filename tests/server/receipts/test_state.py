"""The cache state and the compute a server signs in its receipts (the setting: ``test_receipts.py``):
a server misstating either is caught, banned and replaced; the client's chain of each hop follows
the server's through rollbacks, as auditors' do; a server without a key hashes no cache state."""

from __future__ import annotations

import msgspec
import pytest
import torch

from shoal.client.remote.driver import ChainDriver
from shoal.ids import BlockRange
from shoal.server.handler import BlockServer
from shoal.verify.receipts import Receipt, ReceiptMismatch, ReceiptSigner
from shoal.wire.schema import CAPABILITIES, RECEIPTS
from tests.helpers.inprocess import blocks_output, no_server_errors  # noqa: F401 (a fixture)
from tests.server.receipts.bench import A, B, assert_close, feed, hidden, peer, prefer

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]


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
