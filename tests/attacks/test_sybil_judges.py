"""Convictions that cost real work (issue 34): for a client, a verdict counts only when its judge
was seen by that client's own audits computing those blocks correctly (shoal.swarm.verdicts).

10 keys beside 3 honest replicas (the accused and two judges of blocks 2:4): even keys that answer
every probe (admitted) convict nobody for a client that never saw them compute; their verdicts are
advisory, so the client routes around the accused only where other servers serve its blocks. A real
liar convicted by the two honest judges is dropped by a client that has audited them, and routed
around by one that has not.
"""

from __future__ import annotations

import asyncio

import pytest

from shoal.client.remote.listing import swarm_spans
from shoal.client.verification.audit import Verification
from shoal.ids import BlockRange
from shoal.swarm.liveness import Liveness
from shoal.swarm.records import sign
from shoal.swarm.verdicts import convicted, suspected, tally
from shoal.transport import Ticket
from shoal.verify.receipts import ReceiptSigner
from tests.attacks.test_admission import record_only_keys
from tests.unit.test_verdicts import (
    ACCUSED,
    JUDGE,
    JUDGE_KEY,
    LOW,
    MODEL,
    OTHER,
    OTHER_KEY,
    SWARM,
    TableNode,
    add_server,
    convicting_table,
    fresh,
    replicas,
    signed_verdict,
    table_at,
    verdict,
)

pytestmark = pytest.mark.timeout(30)

HIGH = BlockRange(2, 4)


def sybil_table(admitted: bool):
    """The accused and two honest replicas of 2:4, a server of 0:2, and 10 keys on 2:4 that each
    sign a verdict against the accused; ``admitted``: the keys answer this peer's probes too."""
    table = table_at()
    replicas(table)
    sybils = record_only_keys(10, seed=11)
    for key, _ in sybils:
        add_server(table, key, (2, 4))
        table.merge(signed_verdict(key))
    table.liveness = Liveness(self_id="deciding-peer")
    for peer in (ACCUSED, JUDGE, OTHER, LOW):
        table.liveness.probed(table.get(f"s:{peer}").record, ok=True, now=0.0)
    for _, peer in sybils:
        table.liveness.probed(table.get(f"s:{peer}").record, ok=admitted, now=0.0)
    return table, [peer for _, peer in sybils]


def test_ten_keys_that_serve_nothing_convict_nobody_even_when_they_answer_probes():
    verification = Verification(mode="audit")
    for peer in (ACCUSED, JUDGE, OTHER):  # this client's audits saw the three replicas agree on 2:4
        verification.vouch(peer, HIGH)
    for admitted in (False, True):
        table, sybils = sybil_table(admitted)
        assert convicted(table, MODEL, vouched=verification.vouched) == {}
        (result,) = tally(table, MODEL, vouched=verification.vouched)
        assert result.judges == () and set(result.advisory) == (set(sybils) if admitted else set())
        if admitted:  # records alone and a port: what the admission rule let through, the new one does not
            assert ACCUSED in convicted(table, MODEL)  # a server's view (no audits of its own)
            assert ACCUSED in suspected(table, MODEL, verification.vouched)  # advisory: routed around if possible
        else:
            assert suspected(table, MODEL, verification.vouched) == {}


def test_vouching_needs_every_block_and_a_convicted_peer_vouches_for_nothing():
    verification = Verification(mode="audit")
    verification.vouch(JUDGE, BlockRange(2, 3))
    table = convicting_table()
    assert convicted(table, MODEL, vouched=verification.vouched) == {}  # 2:3 of 2:4 seen: not enough
    verification.vouch(JUDGE, BlockRange(3, 4))
    verification.vouch(OTHER, HIGH)
    assert ACCUSED in convicted(table, MODEL, vouched=verification.vouched)
    verification.convicted(OTHER, HIGH, 5)
    verification.vouch(OTHER, HIGH)
    assert OTHER not in verification.vouched
    assert convicted(table, MODEL, vouched=verification.vouched) == {}


def test_a_real_liar_is_dropped_by_clients_that_saw_its_judges_and_routed_around_by_the_others():
    records = [s.data for s in convicting_table(fresh()).records()]
    ticket = Ticket(LOW, ("mem:1",), None, SWARM)

    def listed(vouched) -> list[str]:
        return sorted(
            s.peer_id for s in asyncio.run(swarm_spans(TableNode(records), [ticket], MODEL, 1.0, True, vouched))
        )

    seen = {JUDGE: [HIGH], OTHER: [HIGH]}
    assert listed(seen) == sorted([JUDGE, OTHER, LOW])  # convicted: dropped
    assert listed({}) == sorted([JUDGE, OTHER, LOW])  # advisory: others serve 2:4, so routed around


def test_an_accused_nothing_else_serves_stays_for_a_client_that_saw_no_judge():
    """Advisory verdicts never cost a client its route: where only the accused serves some block, it
    is kept (the client's audits check it). Two keys serving 2:4 accuse the only server of 2:6."""
    table = table_at(fresh() + 1, signed=fresh())
    add_server(table, LOW_KEY := JUDGE_KEY, (0, 2), at=fresh())
    accused_key = OTHER_KEY
    add_server(table, accused_key, (2, 6), at=fresh())
    accused = ReceiptSigner(accused_key).peer_id
    judges = record_only_keys(2, seed=3)
    for key, _ in judges:
        add_server(table, key, (2, 4), at=fresh())

    for key, peer in judges:
        table.merge(sign(verdict(judge=peer, accused=accused, key=accused_key, now=fresh()), key))
    records = [s.data for s in table.records()]
    ticket = Ticket(ReceiptSigner(LOW_KEY).peer_id, ("mem:1",), None, SWARM)
    spans = asyncio.run(swarm_spans(TableNode(records), [ticket], MODEL, 1.0, True, {}))
    assert accused in {s.peer_id for s in spans}  # blocks 4:6 have nobody else
    assert accused not in {s.peer_id for s in asyncio.run(swarm_spans(TableNode(records), [ticket], MODEL, 1.0))}
