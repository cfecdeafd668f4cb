"""Demand-driven placement across models (shoal.server.demand): which model a server without one
takes, when it changes model, and a simulation of 20 re-check periods as demand shifts."""

from __future__ import annotations

import random

from shoal.ids import BlockRange
from shoal.server.demand import Hosted, Switcher, SwitchPlan, choose_model, plan_switch, queue, shortages
from shoal.server.placement import Balance

WHOLE = BlockRange(0, 4)


def host(peer: str, model: str, blocks: BlockRange = WHOLE, free: int = 1000) -> Hosted:
    return Hosted(peer, model, blocks, free)


def test_a_new_server_takes_the_model_nobody_serves():
    hosted = [host("p1", "a"), host("p2", "a", BlockRange(0, 2))]
    choice = choose_model({"a": 4, "b": 6}, hosted, {"a": 4, "b": 3}, 1000)
    assert choice is not None and choice.model == "b"
    assert choice.before == Balance(6, 0.0) and choice.after.uncovered == 3
    assert choice.blocks in (BlockRange(0, 3), BlockRange(3, 6))


def test_a_new_server_takes_only_a_model_it_can_load():
    hosted = [host("p1", "a")]
    assert choose_model({"a": 4, "b": 6}, hosted, {"a": 4}, 1000).model == "a"
    assert choose_model({"a": 4, "b": 6}, hosted, {}, 1000) is None


def test_a_hole_comes_before_load_and_then_the_least_free_cache():
    models = {"a": 4, "b": 4}
    holed = [host("p1", "a", free=0), host("p2", "b", BlockRange(0, 3))]
    assert choose_model(models, holed, {"a": 4, "b": 4}, 1000).model == "b"
    busy = [host("p1", "a", free=100), host("p2", "b", free=900)]
    choice = choose_model(models, busy, {"a": 4, "b": 4}, 1000)
    assert choice.model == "a" and choice.before == Balance(0, 100.0) and choice.after == Balance(0, 1100.0)
    assert shortages(models, busy) == {"a": Balance(0, 100.0), "b": Balance(0, 900.0)}


def test_the_only_server_of_a_block_never_leaves_it():
    hosted = [host("p1", "a", BlockRange(0, 2)), host("p2", "a", BlockRange(2, 4))]
    plan = plan_switch({"a": 4, "b": 4}, hosted, "p1", {"a": 2, "b": 4}, 1000)
    assert plan.switch is None and plan.defer_to is None


def test_a_redundant_server_moves_to_the_uncovered_model_and_the_larger_id_waits():
    hosted = [host("p1", "a"), host("p2", "a"), host("p3", "a")]
    models, spans = {"a": 4, "b": 4}, {"a": 4, "b": 4}
    first = plan_switch(models, hosted, "p1", spans, 1000)
    assert first.switch is not None and first.switch.model == "b" and first.switch.blocks == WHOLE
    assert plan_switch(models, hosted, "p2", spans, 1000).defer_to == "p1"
    alone = plan_switch(models, hosted, "p2", spans, 1000, ignore={"p1"})
    assert alone.switch is not None and alone.switch.model == "b"
    assert plan_switch(models, hosted, "p3", spans, 1000) == SwitchPlan(defer_to="p1")


def test_no_switch_for_a_small_gain():
    """Hysteresis: 3 servers on a at 500 free, 3 on b at 450: moving would lower the smaller headroom."""
    hosted = [host(f"a{i}", "a", free=500) for i in range(3)] + [host(f"b{i}", "b", free=450) for i in range(3)]
    for h in hosted:
        assert plan_switch({"a": 4, "b": 4}, hosted, h.peer, {"a": 4, "b": 4}, 1000).switch is None


# ---- the simulation --------------------------------------------------------------------------------

CAPACITY = 1000  # KV tokens per server
#: tokens of open sessions per model, per period: demand shifts every 5 periods
DEMAND = [(2700, 300)] * 5 + [(300, 2700)] * 5 + [(2700, 300)] * 5 + [(1500, 1500)] * 5


def records(where: dict[str, str], demand: tuple[int, int]) -> list[Hosted]:
    """Each server's record: a model's sessions spread evenly over its servers."""
    counts = {m: sum(1 for w in where.values() if w == m) for m in "ab"}
    load = dict(zip("ab", demand, strict=True))
    return [host(p, m, free=max(0, round(CAPACITY - load[m] / counts[m]))) for p, m in sorted(where.items())]


def simulate(seed: int) -> list[list[tuple[str, str, str]]]:
    """20 periods; in each, every server re-checks once (in a random order) on the records as they
    were at the period's start (gossip lags: the case where servers would herd). Returns each
    period's moves (peer, from, to)."""
    rng = random.Random(seed)
    where = {f"p{i}": "ab"[i % 2] for i in range(6)}
    switchers = {peer: Switcher(peer) for peer in where}
    history = []
    for demand in DEMAND:
        seen = records(where, demand)
        moves = []
        for peer in rng.sample(sorted(where), len(where)):
            switch = switchers[peer].check({"a": 4, "b": 4}, seen, {"a": 4, "b": 4}, CAPACITY)
            if switch is not None:
                moves.append((peer, where[peer], switch.model))
                where[peer] = switch.model
        assert all(m in where.values() for m in "ab"), f"a model lost its last server: {where}"
        history.append(moves)
    return history


def test_demand_shifts_move_servers_once_per_shift_without_oscillating():
    for seed in range(5):
        history = simulate(seed)
        for moves in history:
            assert len({peer for peer, _, _ in moves}) == len(moves)  # one move per server per period at most
        for start in range(0, 20, 5):
            window = [m for moves in history[start : start + 5] for m in moves]
            assert not history[start + 3] and not history[start + 4], f"still moving at {start + 3}: {history}"
            directions = {(src, dst) for _, src, dst in window}
            assert len(directions) <= 1, f"servers went both ways under steady demand: {window}"
        # a's demand first: one server b -> a (4:2); b's: two a -> b (2:4); a's again: two back (4:2);
        # balanced: one a -> b (3:3). Each time the smallest peer id that can moves, the others wait.
        assert [len(m) for m in history] == [1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0]
        assert {dst for moves in history[5:7] for _, _, dst in moves} == {"b"}


def simulate_halves(seed: int) -> list[list[tuple[str, str, str]]]:
    """As :func:`simulate`, with servers of two blocks each (of 4) and p0 started with a model (it
    never re-checks, and has the smallest peer id: the others wait for it once, then not again).
    Every block of both models stays covered after every single move."""
    rng = random.Random(seed)
    low, high = BlockRange(0, 2), BlockRange(2, 4)
    where = {"p0": ("a", low), "p1": ("a", high), "p2": ("b", low), "p3": ("b", high), "p4": ("a", low),
             "p5": ("a", high), "p6": ("b", low), "p7": ("b", high), "p8": ("a", high)}  # fmt: skip
    switchers = {peer: Switcher(peer) for peer in where if peer != "p0"}
    history = []
    for demand in DEMAND:
        load = dict(zip("ab", demand, strict=True))

        def covering(model: str, block: int) -> int:
            return sum(1 for m, span in where.values() if m == model and span.start <= block < span.end)

        seen = [
            host(p, m, span, max(0, round(CAPACITY - load[m] / min(covering(m, i) for i in span.blocks()))))
            for p, (m, span) in sorted(where.items())
        ]
        moves = []
        for peer in rng.sample(sorted(switchers), len(switchers)):
            switch = switchers[peer].check({"a": 4, "b": 4}, seen, {"a": 2, "b": 2}, CAPACITY)
            if switch is not None:
                moves.append((peer, where[peer][0], switch.model))
                where[peer] = (switch.model, switch.blocks)
                assert all(covering(m, i) for m in "ab" for i in range(4)), f"a block left uncovered: {where}"
        history.append(moves)
    return history


def test_servers_of_part_of_a_model_never_uncover_a_block_and_settle():
    for seed in range(5):
        history = simulate_halves(seed)
        for moves in history:
            assert len({peer for peer, _, _ in moves}) == len(moves)
        for start in range(0, 20, 5):
            window = [m for moves in history[start : start + 5] for m in moves]
            counts = [len(moves) for moves in history[start : start + 5]]
            counts = counts[next((i for i, c in enumerate(counts) if c), 5) :]  # from the first move (after a wait)
            assert counts == sorted(counts, reverse=True), f"moving again after settling: {history}"
            assert len({(src, dst) for _, src, dst in window}) <= 1, f"both ways under steady demand: {window}"
        # a server lifts half of the short model's blocks, the next the other half: one move a period
        # (each waits once for a smaller peer id), 2 to 4 a shift
        assert [len(m) for m in history] == [1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0]
        assert all("p0" not in {peer for peer, _, _ in moves} for moves in history)


def test_queued_work_tips_the_choice_after_coverage():
    """Equal headroom: the model whose servers have more steps waiting per server is shorter; a
    larger headroom does not outweigh a queue; an uncovered block still comes first."""
    models, spans = {"a": 4, "b": 4}, {"a": 4, "b": 4}
    even = [host("p1", "a"), host("p2", "b")]
    assert choose_model(models, even, spans, 1000).model == "a"  # the name breaks the tie
    queued = [host("p1", "a"), Hosted("p2", "b", WHOLE, 1000, queued=6)]
    choice = choose_model(models, queued, spans, 1000)
    assert choice.model == "b" and choice.queue == 6.0
    roomy = [host("p1", "a", free=100), Hosted("p2", "b", WHOLE, 900, queued=6), host("p3", "b", free=900)]
    assert queue(roomy, "b", 4) == 3.0  # 6 steps over the 2 servers of its blocks
    assert choose_model(models, roomy, spans, 1000).model == "b"
    holed = [host("p1", "a", BlockRange(0, 3)), Hosted("p2", "b", WHOLE, 1000, queued=50)]
    assert choose_model(models, holed, spans, 1000).model == "a"
