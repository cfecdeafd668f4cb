"""What a judge keeps re-signing (:class:`shoal.swarm.verdicts.VerdictKeeper`): every verdict for
:data:`~shoal.swarm.verdicts.VERDICT_MAX_AGE`, whether or not its accused is in the swarm now (a liar
that goes quiet must come back convicted), and never more than ``max_kept`` of them (oldest dropped)."""

from __future__ import annotations

import pytest

from shoal.swarm.records import SignedRecord
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import MAX_KEPT_VERDICTS, VERDICT_LIFETIME, VERDICT_MAX_AGE, VerdictKeeper, convicted
from tests.unit.test_verdicts import (
    ACCUSED,
    ACCUSED_KEY,
    JUDGE,
    JUDGE_KEY,
    NOW,
    OTHER,
    OTHER_KEY,
    SWARM,
    add_server,
    keys,
    verdict,
)

pytestmark = pytest.mark.timeout(30)

RECORD_LIFETIME = 100.0  # add_server's server records


def test_a_liar_quiet_for_longer_than_a_record_lives_is_still_convicted_when_it_comes_back():
    clock = [NOW]
    table = RecordTable(SWARM, clock=lambda: clock[0])  # no model record: servers are taken as listed
    judges = {JUDGE: JUDGE_KEY, OTHER: OTHER_KEY}
    keepers = [VerdictKeeper(key, table.merge, clock=lambda: clock[0]) for key in judges.values()]
    for key in (ACCUSED_KEY, *judges.values()):
        add_server(table, key, (2, 4), at=NOW)
    originals = [keeper.add(verdict(judge, now=NOW)) for keeper, judge in zip(keepers, judges, strict=True)]
    assert set(convicted(table, "tiny")) == {ACCUSED}
    # the liar goes quiet for two verdict lifetimes; the judges stay online and keep re-signing
    step = RECORD_LIFETIME / 2
    while clock[0] < NOW + 2 * VERDICT_LIFETIME:
        clock[0] += step
        for key in judges.values():
            add_server(table, key, (2, 4), at=clock[0])
        for keeper in keepers:
            table.merge_many(keeper.due())  # what the presence publishes
        table.expire(clock[0])
    assert ACCUSED not in {r.peer for r in table.servers(include_offline=True)}  # gone from the table
    assert all(signed.record.expires < clock[0] for signed in originals)  # unsigned again, they had lapsed
    assert all(len(keeper) == 1 for keeper in keepers)
    add_server(table, ACCUSED_KEY, (2, 4), at=clock[0])  # it comes back
    (tally,) = convicted(table, "tiny").values()
    assert (tally.accused, tally.judges, tally.electorate) == (ACCUSED, tuple(sorted(judges)), 2)


def test_verdicts_lapse_a_day_after_the_evidence_however_often_re_signed():
    clock = [NOW]
    keeper = VerdictKeeper(JUDGE_KEY, lambda signed: None, clock=lambda: clock[0])
    keeper.add(verdict())
    resigned = 0
    while clock[0] + VERDICT_LIFETIME / 2 <= NOW + VERDICT_MAX_AGE:
        clock[0] += VERDICT_LIFETIME / 2
        resigned += len(keeper.due())
    assert resigned == int(VERDICT_MAX_AGE // (VERDICT_LIFETIME / 2)) and len(keeper) == 1
    clock[0] = NOW + VERDICT_MAX_AGE + 1
    assert keeper.due() == [] and len(keeper) == 0
    keeper.add(verdict(now=clock[0]))  # judged again: a new day
    clock[0] += VERDICT_LIFETIME / 2
    assert len(keeper.due()) == 1


def test_the_keeper_holds_at_most_max_kept_verdicts_and_drops_the_oldest_first():
    assert MAX_KEPT_VERDICTS == 1024
    published: list[SignedRecord] = []
    keeper = VerdictKeeper(JUDGE_KEY, published.append, clock=lambda: NOW, max_kept=3)
    accused = keys(5, seed=7)
    for i, (key, peer) in enumerate(accused[:3]):
        keeper.add(verdict(accused=peer, key=key, now=NOW + i))
    keeper.add(verdict(accused=accused[0][1], key=accused[0][0], now=NOW + 3))  # judged again: now the newest
    keeper.add(verdict(accused=accused[3][1], key=accused[3][0], now=NOW + 4))  # drops accused[1], the oldest
    assert len(published) == 5 and len(keeper) == 3
    kept = {signed.record.accused for signed in keeper.due(NOW + 4 + VERDICT_LIFETIME / 2)}
    assert kept == {accused[0][1], accused[2][1], accused[3][1]}
