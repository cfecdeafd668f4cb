"""Span choice and rebalancing (shoal/server/placement.py): pure functions, seeded, no I/O.

* a new server fills the weakest part of coverage; ties go to fewer weak blocks, then to windows
  that leave the weak part in one piece (so later servers tile it exactly), then the seeded rng;
* re-checks move only for a clear gain (hysteresis), stay put on ties, and leave a move to the
  server that should make it (no two servers jumping into the same gap);
* dynamics: from every start of 3 servers x 4 blocks on 12 blocks with a block uncovered, servers
  re-checking in random order reach 0:4, 4:8, 8:12; 4 servers placed one after another cover every
  block; after one of 4 leaves, the other 3 cover every block again.
"""

from __future__ import annotations

import itertools
import random

import pytest

from shoal.ids import BlockRange
from shoal.server.config import ServerConfig
from shoal.server.placement import (
    Balance,
    Placed,
    Plan,
    balance,
    block_throughputs,
    choose_span,
    clearly_better,
    plan_move,
)

pytestmark = pytest.mark.timeout(60)


def servers(*spans: tuple[int, int], throughput: float = 10.0) -> list[Placed]:
    return [Placed(f"p{i}", BlockRange(start, end), throughput) for i, (start, end) in enumerate(spans)]


def spans_of(placed: list[Placed]) -> list[tuple[int, int]]:
    return sorted((s.start, s.end) for s in placed)


def test_block_throughputs_sum_covering_servers_and_clip_to_the_model():
    placed = [
        Placed("a", BlockRange(0, 4), 10.0),
        Placed("b", BlockRange(2, 6), 5.0),
        Placed("c", BlockRange(5, 9), 1.0),
        Placed("d", BlockRange(1, 2), 0.0),
    ]
    t = block_throughputs(placed, 8)
    assert t[:6].tolist() == [10.0, 10.0 + 1e-6, 15.0, 15.0, 5.0, 6.0]
    assert t[6:].tolist() == [1.0, 1.0]
    assert balance(t) == Balance(0, 1.0)
    assert balance(block_throughputs(placed[:2], 8)) == Balance(2, 0.0)


def test_clearly_better_means_fewer_holes_or_a_much_higher_bottleneck():
    assert clearly_better(Balance(1, 0.0), Balance(2, 0.0))
    assert not clearly_better(Balance(2, 0.0), Balance(1, 0.0))
    assert not clearly_better(Balance(1, 0.0), Balance(1, 0.0))
    assert clearly_better(Balance(0, 12.1), Balance(0, 10.0))
    assert not clearly_better(Balance(0, 11.9), Balance(0, 10.0))
    assert clearly_better(Balance(0, 0.5), Balance(1, 0.0))


def test_a_new_server_fills_the_weakest_part():
    # blocks 0:6 run at 10, 6:12 at 30: a 6-block server of 10 tokens/s belongs on 0:6
    assert choose_span(
        [*servers((0, 6)), Placed("x", BlockRange(6, 12), 30.0)], 12, 6, 10.0, random.Random(0)
    ) == BlockRange(0, 6)
    # a hole at 5:7 between two spans: a 2-block server closes it
    assert choose_span(servers((0, 5), (7, 12)), 12, 2, 1.0, random.Random(0)) == BlockRange(5, 7)
    # a hole wider than the server: it covers as much of it as it can, from one end
    for seed in range(10):
        assert choose_span(servers((0, 3), (9, 12)), 12, 4, 1.0, random.Random(seed)) in [
            BlockRange(3, 7),
            BlockRange(5, 9),
        ]


def test_ties_go_to_fewer_weak_blocks_then_to_an_unbroken_weak_part():
    # blocks run at [20, 20, 10 x 10]: every window leaves the minimum at 10; those inside 2:12 leave
    # 6 blocks at it (0:4 leaves 8), and of those, 2:6 and 8:12 leave them in one piece (4:8 in two)
    placed = servers((0, 12), (0, 2))
    picks = {choose_span(placed, 12, 4, 10.0, random.Random(seed)) for seed in range(40)}
    assert picks == {BlockRange(2, 6), BlockRange(8, 12)}
    # an empty swarm: the first server takes an end, never the middle
    firsts = {choose_span([], 12, 4, 10.0, random.Random(seed)) for seed in range(40)}
    assert firsts == {BlockRange(0, 4), BlockRange(8, 12)}
    # then the next one sits next to it or at the other end, leaving one 4-block gap
    for seed in range(20):
        second = choose_span(servers((0, 4)), 12, 4, 10.0, random.Random(seed))
        assert second in [BlockRange(4, 8), BlockRange(8, 12)]


def test_choice_is_reproducible_with_a_seeded_rng():
    picks = [[choose_span([], 30, 7, 1.0, random.Random(seed)) for _ in range(1)] for seed in range(5)]
    again = [[choose_span([], 30, 7, 1.0, random.Random(seed)) for _ in range(1)] for seed in range(5)]
    assert picks == again
    with pytest.raises(ValueError, match="cannot place 13 blocks"):
        choose_span([], 12, 13, 1.0)


def test_moves_need_a_clear_gain():
    # 0:6 at 10, 6:12 at 30 (p0 covers 0:12, p1 and p2 add 6:12): p1 (or p2) on 0:6 makes it 20 and 20
    placed = servers((0, 12), (6, 12), (6, 12))
    plan = plan_move(placed, 12, "p1", random.Random(0))
    assert plan.move is not None and plan.move.blocks == BlockRange(0, 6)
    assert plan.move.before == Balance(0, 10.0) and plan.move.after == Balance(0, 20.0)
    assert plan_move(placed, 12, "p2", random.Random(0)) == Plan(defer_to="p1")  # p1 could make the same move
    # 0:6 at 10, 6:12 at 12: x moving to 0:6 would make the bottleneck 11 (+10%, under the 20% margin)
    close = [
        Placed("z", BlockRange(0, 12), 10.0),
        Placed("x", BlockRange(6, 12), 1.0),
        Placed("y", BlockRange(6, 12), 1.0),
    ]
    assert plan_move(close, 12, "x", random.Random(0)) == Plan()
    move = plan_move(close, 12, "x", random.Random(0), margin=1.05).move
    assert (move.blocks, move.after) == (BlockRange(0, 6), Balance(0, 11.0))
    # on its best place already: stay; a server not in the table: no plan
    assert plan_move(servers((0, 6), (6, 12)), 12, "p0", random.Random(0)).move is None
    assert plan_move(servers((0, 6)), 12, "nobody", random.Random(0)).move is None


def test_a_hole_is_closed_by_one_server_not_by_every_server_that_could():
    # blocks 8:12 lost their server; p0 and p1 both sit on 0:4 and either could move there
    placed = servers((0, 4), (0, 4), (4, 8))
    plans = {p.peer: plan_move(placed, 12, p.peer, random.Random(1)) for p in placed}
    assert (plans["p0"].move.start, plans["p0"].move.end) == (8, 12)  # the smaller peer id goes first
    assert plans["p1"].move is None and plans["p1"].defer_to == "p0"
    assert plans["p2"].move is None and plans["p2"].defer_to == "p0"  # no neutral moves while p0 has a direct one
    # a server that stops deferring (the other one never moved) moves itself
    alone = plan_move(placed, 12, "p1", random.Random(1), defer=False).move
    assert (alone.start, alone.end) == (8, 12)


def test_a_stuck_hole_is_fixed_by_a_neutral_move_that_others_complete():
    # 0:4, 3:7, 7:11: block 11 is uncovered and no single move covers it without opening another
    # hole; 3:7 -> 4:8 changes nothing at once, and then 7:11 -> 8:12 covers everything
    placed = servers((0, 4), (3, 7), (7, 11))
    assert all(plan_move(placed, 12, p.peer, random.Random(0), neutral=False).move is None for p in placed)
    plan = plan_move(placed, 12, "p1", random.Random(0))
    assert plan.move is not None and plan.move.neutral
    assert (plan.move.start, plan.move.end) == (4, 8)
    assert plan.move.after == Balance(1, 0.0) and plan.move.expected == Balance(0, 10.0)
    # the server with the smallest peer id that can make a neutral move makes it; the others wait
    assert plan_move(placed, 12, "p2", random.Random(0)).defer_to == "p1"
    # a healthy swarm never makes neutral moves
    assert plan_move(servers((0, 4), (4, 8), (8, 12), (2, 6)), 12, "p3", random.Random(0)).move is None


def _converge(placed: list[Placed], num_blocks: int, rng: random.Random, max_checks: int) -> tuple[list[Placed], int]:
    """Servers re-check one at a time in random order until every block is covered."""
    placed = list(placed)
    for check in range(max_checks):
        if balance(block_throughputs(placed, num_blocks)).uncovered == 0:
            return placed, check
        i = rng.randrange(len(placed))
        move = plan_move(placed, num_blocks, placed[i].peer, rng).move
        if move is not None:
            placed[i] = Placed(placed[i].peer, move.blocks, placed[i].throughput)
    raise AssertionError(f"not covered after {max_checks} checks: {spans_of(placed)}")


def test_three_servers_converge_to_a_tiling_from_every_start_with_a_hole():
    checked = 0
    for starts in itertools.product(range(9), repeat=3):
        placed = servers(*((s, s + 4) for s in starts))
        if balance(block_throughputs(placed, 12)).uncovered == 0:
            continue
        final, _ = _converge(placed, 12, random.Random(hash(starts)), max_checks=60)
        assert spans_of(final) == [(0, 4), (4, 8), (8, 12)], starts
        checked += 1
    assert checked == 9**3 - 6  # the 3! orders of 0:4, 4:8, 8:12 start covered


def test_four_servers_placed_in_turn_cover_everything_and_survivors_recover():
    for seed in range(30):
        rng = random.Random(seed)
        placed: list[Placed] = []
        for i in range(4):
            placed.append(Placed(f"p{i}", choose_span(placed, 12, 4, 10.0, rng), 10.0))
        assert balance(block_throughputs(placed, 12)).uncovered == 0
        assert plan_move(placed, 12, rng.choice(placed).peer, rng).move is None  # covered: nobody moves
        for victim in placed:
            survivors = [s for s in placed if s is not victim]
            final, _ = _converge(survivors, 12, rng, max_checks=60)
            assert spans_of(final) == [(0, 4), (4, 8), (8, 12)]


def test_heterogeneous_swarms_end_covered_and_quiet():
    """Random swarms (40 blocks, 12 servers of 4-10 blocks and 5-50 tokens/s) from random spans:
    every block ends up covered, the swarm goes quiet (a whole round of re-checks, deferring or not,
    moves nobody) after a few moves per server at most, and the bottleneck never got worse."""
    for seed in range(6):
        rng = random.Random(seed)
        sizes = [rng.randint(4, 10) for _ in range(12)]
        placed = [
            Placed(f"p{i:02d}", BlockRange(start := rng.randrange(41 - n), start + n), rng.uniform(5, 50))
            for i, n in enumerate(sizes)
        ]
        placed, _ = _converge(placed, 40, rng, max_checks=200)
        moves, bottleneck = 0, balance(block_throughputs(placed, 40)).bottleneck
        for _ in range(30):  # rounds: every server re-checks once, in random order
            moved = False
            for i in rng.sample(range(len(placed)), len(placed)):
                move = plan_move(placed, 40, placed[i].peer, rng).move
                if move is not None:
                    placed[i] = Placed(placed[i].peer, move.blocks, placed[i].throughput)
                    moves, moved = moves + 1, True
                    now = balance(block_throughputs(placed, 40))
                    assert now.uncovered == 0 and now.bottleneck > bottleneck * 1.2
                    bottleneck = now.bottleneck
            if not moved:
                break
        assert moves <= 12
        assert all(plan_move(placed, 40, p.peer, rng, defer=d).move is None for p in placed for d in (True, False))


def test_config_needs_blocks_outside_a_swarm():
    with pytest.raises(ValueError, match="--blocks START:END is required outside a swarm"):
        ServerConfig(model="m")
    with pytest.raises(ValueError, match="exclude each other"):
        ServerConfig(model="m", blocks=(0, 2), num_blocks=2, new_swarm=True)
    with pytest.raises(ValueError, match="at least 1"):
        ServerConfig(model="m", num_blocks=0, new_swarm=True)
    assert ServerConfig(model="m", num_blocks=3, new_swarm=True).placed_automatically
    assert not ServerConfig(model="m", blocks=(0, 2)).placed_automatically
