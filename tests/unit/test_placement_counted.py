"""What placement counts (shoal/server/placement.py ``counted``): servers that will really serve.

The soak (bench/soak.py) found replacement servers placed on 0:2 while 2:4 had fewer servers that
served: the records a joining server weighed held servers that would not serve there. From one table
of records, every such record is left out and the new server goes to the thin span:

* a SIGKILLed server's record (online, unexpired, its server not reached: it never answers);
* a liar the swarm's verdicts convict (online until it leaves);
* a draining server (it published ``offline``) and an expired record;
* a record this server has not reached yet (a claim anyone can make without running anything).

Throughput is a claim too: one record counts at most THROUGHPUT_CAP times the median.
"""

from __future__ import annotations

import random

import pytest

from shoal.ids import BlockRange
from shoal.server.placement import THROUGHPUT_CAP, Placed, choose_span, counted, plan_move
from shoal.swarm.records import ServerRecord, State

pytestmark = pytest.mark.timeout(30)

NOW = 1_000_000.0
NUM_BLOCKS = 4
LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)


def record(
    peer: str, blocks: BlockRange, state: State = State.ONLINE, expires: float = NOW + 60, throughput: float = 100.0
) -> ServerRecord:
    return ServerRecord(
        swarm="s", peer=peer, addrs=("127.0.0.1:9",), relay=None, model="m", blocks=blocks,
        fingerprints=(b"\0" * 32,) * len(blocks), state=state, throughput=throughput, cache_tokens_free=0,
        rtts=(), version="test", timestamp=NOW - 1, expires=expires,
    )  # fmt: skip


#: the soak's swarm when a replacement joins: three honest servers on 0:2, two on 2:4, and on 2:4
#: also a dead one, a convicted liar, a draining one, an expired one and one never reached
HONEST = [record("h0", LOW), record("h1", LOW), record("h2", LOW), record("h3", HIGH), record("h4", HIGH)]
DEAD, LIAR, NEW = record("dead", HIGH), record("liar", HIGH), record("unreached", HIGH)
DRAINING, EXPIRED = record("draining", HIGH, State.OFFLINE), record("expired", HIGH, expires=NOW - 0.5)
TABLE = [*HONEST, DEAD, LIAR, NEW, DRAINING, EXPIRED]
REACHED = {"h0", "h1", "h2", "h3", "h4", "liar", "draining", "expired"}  # the dead and the new one: not
CONVICTED = {"liar"}


def naive(records: list[ServerRecord]) -> list[Placed]:
    """What placement counted before: every unexpired record not offline and not found unreachable."""
    return [Placed(r.peer, r.blocks, r.throughput) for r in records if r.state is not State.OFFLINE and r.expires > NOW]


def test_the_soaks_table_sent_a_replacement_to_the_thick_span_when_every_record_counted():
    """The wrong choice, reproduced: 2:4 looks like 5 servers (2 serving), 0:2 like 3."""
    assert {choose_span(naive(TABLE), NUM_BLOCKS, 2, 100.0, random.Random(seed)) for seed in range(20)} == {LOW}


def test_only_servers_that_will_serve_count_and_a_replacement_goes_to_the_thin_span():
    placed = counted(TABLE, NOW, REACHED, CONVICTED)
    assert sorted(p.peer for p in placed) == ["h0", "h1", "h2", "h3", "h4"]
    assert {choose_span(placed, NUM_BLOCKS, 2, 100.0, random.Random(seed)) for seed in range(20)} == {HIGH}


@pytest.mark.parametrize("left_out", [DEAD, LIAR, NEW, DRAINING, EXPIRED], ids=lambda r: r.peer)
def test_each_kind_of_record_that_will_not_serve_is_left_out(left_out: ServerRecord):
    """Each alone, beside one honest server: only the honest one counts."""
    placed = counted([record("h", LOW), left_out], NOW, REACHED | {"h"}, CONVICTED)
    assert [p.peer for p in placed] == ["h"]


def test_a_joining_record_counts_once_reached_so_servers_starting_together_spread():
    joining = record("j", HIGH, State.JOINING)
    placed = counted([*HONEST[:3], joining], NOW, {"h0", "h1", "h2", "j"}, set())
    assert sorted(p.peer for p in placed) == ["h0", "h1", "h2", "j"]
    assert choose_span(placed, NUM_BLOCKS, 2, 100.0, random.Random(0)) == HIGH


def test_a_servers_own_record_counts_so_it_can_plan_its_moves():
    """``me`` counts unreached (a peer never probes itself) and whatever it was accused of; its
    re-check then moves it from the crowded 0:2 to 2:4, where the dead server does not count."""
    me = record("me", LOW)
    placed = counted([*HONEST[:3], me, DEAD, record("h3", HIGH)], NOW, {"h0", "h1", "h2", "h3"}, {"me"}, me="me")
    assert sorted(p.peer for p in placed) == ["h0", "h1", "h2", "h3", "me"]
    plan = plan_move(placed, NUM_BLOCKS, "me", random.Random(0), defer=False)
    assert plan.move is not None and plan.move.blocks == HIGH


def test_a_record_claiming_a_huge_throughput_weighs_as_a_few_servers():
    """One key announcing a billion tokens/s on 2:4 counts THROUGHPUT_CAP times the median (100):
    two newcomers' worth on 0:2 then outweigh it, and the third newcomer goes to 2:4."""
    boaster = record("boaster", HIGH, throughput=1e9)
    table = [record("a", LOW), record("b", LOW), boaster]
    placed = counted(table, NOW, {"a", "b", "boaster"}, set())
    assert {p.peer: p.throughput for p in placed} == {"a": 100.0, "b": 100.0, "boaster": THROUGHPUT_CAP * 100.0}
    for i in range(int(THROUGHPUT_CAP) - 2):  # 0:2 fills up to the boaster's capped weight
        new = record(f"n{i}", choose_span(placed, NUM_BLOCKS, 2, 100.0, random.Random(i)))
        assert new.blocks == LOW
        table.append(new)
        placed = counted(table, NOW, {r.peer for r in table}, set())
    assert {choose_span(placed, NUM_BLOCKS, 2, 100.0, random.Random(s)) for s in range(20)} == {LOW, HIGH}
    table.append(record("last", LOW))
    placed = counted(table, NOW, {r.peer for r in table}, set())
    assert {choose_span(placed, NUM_BLOCKS, 2, 100.0, random.Random(s)) for s in range(20)} == {HIGH}


def test_nothing_counted_is_an_empty_swarm():
    assert counted([DEAD, DRAINING], NOW, set(), set()) == []
