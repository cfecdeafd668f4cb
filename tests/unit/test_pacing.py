"""When sessions are due back (:class:`shoal.server.pacing.Arrivals`): from how long each was away
last time; a session never seen coming back is expected like the others (their median); one that
stays away too long is forgotten. How deep their chains are (a cycle over the time here), which
batch each last ran in, what batches of other sizes should cost, and how many groups the sessions
run in (:func:`~shoal.server.pacing.choose_groups`)."""

from __future__ import annotations

import pytest

from shoal.server.pacing import FORGET_AFTER, Arrivals, BatchCosts, choose_groups


def test_a_session_is_due_as_long_after_its_last_step_as_it_was_away_before():
    arrivals = Arrivals()
    arrivals.finished("a", 0.0)
    arrivals.arrived("a", 0.1)  # away 0.1 s
    arrivals.finished("a", 0.2)
    assert arrivals.due(now=0.25, within=0.02) == 0  # expected at 0.3
    assert arrivals.due(now=0.29, within=0.02) == 1
    assert arrivals.due(now=0.31, within=0.02) == 1  # a little late: about to come
    assert arrivals.due(now=0.4, within=0.02) == 0  # much later: not waited for
    arrivals.arrived("a", 0.3)
    assert arrivals.due(now=0.3, within=1.0) == 0  # here: not due


def test_a_session_never_seen_back_is_expected_like_the_others():
    arrivals = Arrivals()
    for key, away in (("a", 0.1), ("b", 0.2), ("c", 0.3)):
        arrivals.finished(key, 0.0)
        arrivals.arrived(key, away)
    for key in "abc":
        arrivals.finished(key, 1.0)
    arrivals.finished("new", 1.0)  # its first step: no time away of its own yet, the median's 0.2
    assert arrivals.due(now=1.2, within=0.01) == 2  # b, and the new one
    assert arrivals.due(now=1.1, within=0.01) == 1  # a


def test_a_session_away_too_long_is_forgotten():
    arrivals = Arrivals()
    arrivals.finished("a", 0.0)
    arrivals.arrived("a", 1.0)
    arrivals.finished("a", 2.0)
    assert arrivals.due(now=3.0, within=0.1) == 1
    assert arrivals.due(now=2.0 + FORGET_AFTER + 1, within=FORGET_AFTER * 2) == 0
    arrivals.arrived("a", 10.0)  # back after all: a fresh start, no away time from so long ago
    arrivals.finished("a", 10.5)
    assert arrivals.due(now=11.5, within=0.1) == 0


def test_steps_coming_in_a_burst_while_others_are_away():
    """A step less than ``gap`` ago while another session is away: a burst (the other may be in it);
    a lone session's own step is no burst, nor one long ago."""
    arrivals = Arrivals()
    arrivals.arrived("lone", 0.0)
    assert not arrivals.bursting(now=0.001, gap=0.005)  # nobody else: never waits
    arrivals.finished("lone", 0.1)
    arrivals.finished("b", 0.1)
    arrivals.arrived("lone", 0.2)
    assert arrivals.bursting(now=0.202, gap=0.005)  # b is away and may be right behind
    assert not arrivals.bursting(now=0.21, gap=0.005)  # the burst is over


def test_a_session_whose_cache_closed_is_forgotten_at_once():
    closed: set[str] = set()
    arrivals = Arrivals(gone=lambda key: key in closed)
    for key in "ab":
        arrivals.finished(key, 0.0)
        arrivals.arrived(key, 0.1)
        arrivals.finished(key, 0.2)
    assert arrivals.due(now=0.3, within=0.01) == 2
    closed.add("b")
    assert arrivals.due(now=0.3, within=0.01) == 1
    arrivals.arrived("a", 0.3)
    assert not arrivals.bursting(now=0.301, gap=0.005)  # b is gone: nobody else is away


# ---- groups: how deep the sessions' chains are, and how many batches a round they run in ------------


def cycle(arrivals: Arrivals, key: str, came: float, here: float, width: int = 1, batch: int = 0) -> None:
    """One step of ``key``: queued at ``came``, done ``here`` seconds later."""
    arrivals.arrived(key, came, rows=1, width=width)
    arrivals.finished(key, came + here, batch)


def test_depth_is_a_cycle_of_like_steps_over_the_time_here():
    """Step end to step end (0.25 s) over the time here (queued to done, 0.1 s): a chain 2.5 of
    this server's steps deep. A prefill and the decode step after it (another width: the client
    may have paused between them) tell nothing until the next like step."""
    arrivals = Arrivals()
    cycle(arrivals, "a", 0.0, 0.3, width=16)  # the prefill
    cycle(arrivals, "a", 5.0, 0.1)  # the first decode step, seconds later: not a sample
    assert arrivals.depth(now=5.1) is None
    cycle(arrivals, "a", 5.25, 0.1)  # ends 0.25 s after the last
    assert arrivals.depth(now=5.35) == pytest.approx(2.5)


def test_depth_is_the_median_over_sessions():
    arrivals = Arrivals()
    for key, here in (("a", 0.1), ("b", 0.05), ("c", 0.2)):  # each ends 0.2 s after its last
        cycle(arrivals, key, 0.0, 0.1)
        cycle(arrivals, key, 0.3 - here, here)
    assert arrivals.depth(now=0.3) == pytest.approx(2.0)  # 2, 4 and 1: the median


def test_sessions_are_counted_by_rows_and_by_the_batch_they_last_ran_in():
    arrivals = Arrivals()
    for key, rows in (("a", 3), ("b", 1)):  # away 0.1 s, then in batch 7: due back at 0.3
        arrivals.finished(key, 0.0, batch=6)
        arrivals.arrived(key, 0.1, rows=rows)
        arrivals.finished(key, 0.2, batch=7)
    arrivals.arrived("c", 0.2, rows=2)  # here, never ran
    assert arrivals.rows(now=0.25) == 6
    assert arrivals.cohort_of("a") == arrivals.cohort_of("b") == 7 and arrivals.cohort_of("c") is None
    assert arrivals.cohorts(now=0.25) == 1  # c, new, makes no fragment
    arrivals.finished("c", 0.3, batch=8)  # due back like the others: at 0.4
    assert arrivals.cohorts(now=0.3) == 2
    assert arrivals.due(now=0.3, within=0.02, cohort=7) == 2
    assert arrivals.due(now=0.3, within=0.02, cohort=8) == 0
    assert arrivals.due(now=0.4, within=0.02, cohort=8) == 1


def test_a_burst_counts_only_the_cohort_asked_about():
    arrivals = Arrivals()
    arrivals.finished("a", 0.0, batch=1)
    arrivals.finished("b", 0.0, batch=2)
    arrivals.arrived("a", 0.1)
    assert arrivals.bursting(now=0.101, gap=0.005, cohort=2)  # b, of cohort 2, is away
    assert not arrivals.bursting(now=0.101, gap=0.005, cohort=1)  # a is back: nobody of 1 is away


def test_costs_are_predicted_between_the_measured_sizes_and_optimistically_outside():
    costs = BatchCosts()
    assert costs.predict(4) is None
    costs.record(16, 0.071)
    assert costs.predict(8) == pytest.approx(0.0355)  # never measured: as cheap as it could be, so it is tried
    costs.record(1, 0.035)
    assert costs.predict(8) == pytest.approx(0.035 + 0.036 * 7 / 15)
    assert costs.predict(32) == pytest.approx(0.071)  # no dearer than the largest measured


def measured(seconds: dict[int, float]):
    """What batches of n rows cost, linear between the given sizes (as BatchCosts.predict)."""
    costs = BatchCosts()
    for rows, cost in seconds.items():
        costs.record(rows, cost)
    return costs.predict


# the 270M llama's half (8 blocks) on this project's machine, one thread, oneDNN's packed weights
CPU = measured({1: 0.035, 8: 0.055, 16: 0.071})
FLAT = measured({1: 0.035, 16: 0.037})  # a GPU: 16 rows cost what one does


def test_two_like_servers_run_their_sessions_in_two_groups():
    """16 sessions, away about as long as here (the other server of a 2-server chain): two
    batches of 8 take 2.2 x 55 ms a round, one of 16 2.2 x 71 ms."""
    assert choose_groups(depth=2.2, rows=16, cost=CPU) == 2
    assert choose_groups(depth=3.1, rows=16, cost=CPU) == 3  # a third server (or a slow client)


def test_one_group_where_splitting_does_not_pay():
    assert choose_groups(depth=1.2, rows=16, cost=CPU) == 1  # a lone server: back as soon as the client answers
    assert choose_groups(depth=2.2, rows=16, cost=FLAT) == 1  # two batches of 8 cost what one of 16 does
    assert choose_groups(depth=2.2, rows=1, cost=CPU) == 1
    assert choose_groups(depth=5.0, rows=2, cost=CPU, current=5) == 2  # never more groups than rows


def test_a_grouping_stays_unless_another_is_clearly_quicker():
    """Depth measured in one grouping only estimates another's: a change must gain 10%."""
    assert choose_groups(depth=1.7, rows=16, cost=CPU, current=1) == 1  # 2 groups: 2 x 55 ms vs 1.7 x 71: 9% quicker
    assert choose_groups(depth=1.7, rows=16, cost=CPU, current=2) == 2
    assert choose_groups(depth=1.2, rows=16, cost=CPU, current=2) == 1  # 1.2 x 71 ms vs 2 x 55: 22% quicker
