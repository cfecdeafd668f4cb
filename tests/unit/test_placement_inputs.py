"""What a server's table feeds placement (shoal/server/presence.py ``placeable``): no I/O, a real
:class:`RecordTable` with signed records, signed verdicts and a liveness view.

The soak's case, from the table up: 0:2 has three honest servers, 2:4 two, and 2:4 also holds a liar
two honest judges convicted, a server that did not answer its probe (SIGKILLed, record unexpired),
one not probed yet and one that left (``offline``). Placement counts the five honest servers only,
so a new server takes 2:4; with every record counted as before it took 0:2.
"""

from __future__ import annotations

import random
import time

import pytest

from shoal.ids import BlockRange
from shoal.server.placement import Placed, choose_span
from shoal.server.presence import placeable
from shoal.swarm.liveness import Liveness
from shoal.swarm.records import ServerRecord, State, sign
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import verdict_for
from shoal.verify.receipts import ReceiptSigner
from shoal.wire.schema import Receipt
from tests.helpers.registry import server_record

pytestmark = pytest.mark.timeout(30)

SWARM, MODEL = "placement-inputs", "tiny"
NOW = float(int(time.time()))
LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
FPS = tuple(bytes([i]) * 32 for i in range(4))
SPANS = {"h0": LOW, "h1": LOW, "h2": LOW, "h3": HIGH, "h4": HIGH, "liar": HIGH, "dead": HIGH, "new": HIGH, "gone": HIGH}
KEYS = {name: random.Random(name).randbytes(32) for name in SPANS}
PEERS = {name: ReceiptSigner(key).peer_id for name, key in KEYS.items()}
NAMES = {peer: name for name, peer in PEERS.items()}


def record(name: str) -> ServerRecord:
    span = SPANS[name]
    state = State.OFFLINE if name == "gone" else State.ONLINE
    return server_record(SWARM, PEERS[name], MODEL, (span.start, span.end), FPS[span.start : span.end], NOW, 100.0,
                         state=state, throughput=100.0)  # fmt: skip


def conviction(judge: str) -> bytes:
    """``judge``'s signed verdict against the liar over 2:4 (the liar's own receipt of a step)."""
    unsigned = Receipt(
        weights=b"w" * 16, start=2, end=4, session="s" * 8, position=8, n=1, step=3, inputs=b"i" * 16,
        outputs=b"o" * 16, codec="raw", adapter=b"", prompts=False, state=b"c" * 16, compute="f32/cpu", signature=b"",
    )  # fmt: skip
    receipt = ReceiptSigner(KEYS["liar"]).sign(unsigned)
    verdict = verdict_for(
        swarm=SWARM, judge=PEERS[judge], accused=PEERS["liar"], model=MODEL, blocks=HIGH, evidence=bytes(32),
        receipt=receipt, now=NOW,
    )  # fmt: skip
    return sign(verdict, KEYS[judge]).data


def soak_table() -> RecordTable:
    """The table of the joining server ``me``: it reached every server but the dead one (its probe
    failed) and the new one (not probed yet)."""
    table = RecordTable(SWARM, clock=lambda: NOW + 1)
    table.liveness = Liveness(self_id="me")
    for name in KEYS:
        assert table.merge(sign(record(name), KEYS[name])), table.rejected
        if name != "new":
            table.liveness.probed(record(name), name != "dead", time.monotonic())
    for judge in ("h3", "h4"):
        assert table.merge(conviction(judge)), table.rejected
    return table


def test_a_joining_server_counts_only_the_honest_servers_of_its_table_and_takes_the_thin_span():
    placed = placeable(soak_table(), MODEL, "me", NOW + 1)
    assert sorted(NAMES[p.peer] for p in placed) == ["h0", "h1", "h2", "h3", "h4"]
    assert {choose_span(placed, 4, 2, 100.0, random.Random(seed)) for seed in range(20)} == {HIGH}


def test_counting_every_record_not_offline_took_the_thick_span():
    """The choice before: the liar, the dead server and the unprobed one counted on 2:4."""
    table = soak_table()
    table.liveness = None
    before = [Placed(r.peer, r.blocks, r.throughput) for r in table.servers(MODEL)]
    assert len(before) == 8
    assert {choose_span(before, 4, 2, 100.0, random.Random(seed)) for seed in range(20)} == {LOW}


def test_a_liar_judged_by_one_server_alone_still_counts():
    """Placement takes the swarm's word, as routing does: one judge never convicts (a lone key must
    not make honest servers vanish from everyone's count)."""
    table = RecordTable(SWARM, clock=lambda: NOW + 1)
    for name in ("h3", "h4", "liar"):
        assert table.merge(sign(record(name), KEYS[name]))
    assert table.merge(conviction("h3"))
    assert sorted(NAMES[p.peer] for p in placeable(table, MODEL, "me", NOW + 1)) == ["h3", "h4", "liar"]
