"""When sessions are due back (:class:`shoal.server.pacing.Arrivals`): from how long each was away
last time; a session never seen coming back is expected like the others (their median); one that
stays away too long is forgotten."""

from __future__ import annotations

from shoal.server.pacing import FORGET_AFTER, Arrivals


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
