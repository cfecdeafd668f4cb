"""What a judge keeps re-signing (:class:`shoal.swarm.verdicts.VerdictKeeper`) is bounded: verdicts
against a peer that no longer has a server record in the swarm's table, or older than
:data:`~shoal.swarm.verdicts.VERDICT_MAX_AGE`, are dropped and never gossiped again."""

from __future__ import annotations

import pytest

from shoal.swarm.records import SignedRecord
from shoal.swarm.verdicts import VERDICT_LIFETIME, VERDICT_MAX_AGE, VerdictKeeper
from tests.unit.test_verdicts import ACCUSED_KEY, JUDGE_KEY, NOW, OTHER, OTHER_KEY, add_server, table_at, verdict

pytestmark = pytest.mark.timeout(30)


def test_verdicts_against_a_peer_gone_from_the_table_are_dropped():
    clock = [NOW]
    table = table_at()
    add_server(table, ACCUSED_KEY, (2, 4))  # the accused: listed (its record lives 100 s)
    published: list[SignedRecord] = []
    keeper = VerdictKeeper(JUDGE_KEY, published.append, clock=lambda: clock[0], table=table)
    keeper.add(verdict())
    keeper.add(verdict(accused=OTHER, key=OTHER_KEY))  # a key the swarm never listed
    assert len(published) == 2
    clock[0] = NOW + VERDICT_LIFETIME / 2
    (fresh,) = keeper.due()  # the unlisted one is dropped, the listed one re-signed
    assert fresh.record.accused == verdict().accused and len(keeper) == 1
    table.expire(NOW + 101)  # the accused's record lapsed: it left the swarm
    clock[0] = NOW + VERDICT_LIFETIME
    assert keeper.due() == [] and len(keeper) == 0


def test_verdicts_lapse_a_day_after_the_evidence_however_often_re_signed():
    clock = [NOW]
    keeper = VerdictKeeper(JUDGE_KEY, lambda signed: None, clock=lambda: clock[0])  # no table: age only
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
