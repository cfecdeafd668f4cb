"""Which model a server without one serves, and when it changes model: pure functions, no I/O.

A server started with ``--join`` and no model reads the joined swarms' records and serves the model
where the swarm is short. A model is weighed by its :class:`~shoal.server.placement.Balance` over
the free KV cache its servers announce (``cache_tokens_free``: what sessions leave of their
caches, so it falls as the model's load rises): ``uncovered`` blocks no server hosts, and the free
tokens at its weakest block (its *headroom*). A model nobody serves has every block uncovered.
Its *queue*: the steps waiting at its busiest block, per server there (records' ``queued``, the
servers' batcher queues when they signed): work already asking for more servers than it has.

* :func:`choose_model`: a new server takes the worst-served model it can load: the most uncovered
  blocks, then the longest queue, then the least headroom (ties: the name, so equal views decide
  alike). The periodic re-check (below) weighs coverage and headroom only: queues come and go
  within a period, and a server does not move for a burst.
* :func:`plan_switch`: the periodic re-check (once per ``--rebalance-period``, so at most one move
  per period). The server leaves its model for another only when that clearly helps the two
  together (fewer uncovered blocks; else the smaller headroom of the two up by ``margin``:
  hysteresis, or not lower with fewer blocks within ``margin`` of it) and never when it alone hosts
  some block of its model. The sessions it served move onto the others (their tokens leave those servers' headroom).
  Every move raises the smaller headroom of the two models it touches by ``margin`` and leaves the
  other models alone, so under steady demand the sorted headrooms only rise: servers settle, they
  do not oscillate. Servers re-check on their own clocks; several seeing the same shortage would all
  move, so a server waits for a server with a smaller peer id that would switch to the same model
  (:class:`SwitchPlan` ``defer_to``; once: :class:`Switcher`), and leaves only when its model stays
  covered even if all those smaller ones left with it.

Moves within a model stay :mod:`shoal.server.placement`'s.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from shoal.ids import BlockRange, OnBlocks
from shoal.server.placement import DEFAULT_MARGIN, Balance, Placed, balance, block_throughputs, choose_span

__all__ = [
    "Choice",
    "Hosted",
    "SwitchPlan",
    "Switcher",
    "choose_model",
    "combined",
    "plan_switch",
    "queue",
    "shortages",
]


@dataclass(frozen=True)
class Hosted(OnBlocks):
    """A server as demand placement reads its record (online or joining)."""

    peer: str
    model: str
    blocks: BlockRange
    free_tokens: int  # its record's cache_tokens_free
    queued: int = 0  # its record's queued: steps waiting in its batcher


@dataclass(frozen=True)
class Choice(OnBlocks):
    """Serve ``model`` at ``blocks``; the model's balance before and right after."""

    model: str
    blocks: BlockRange
    before: Balance
    after: Balance
    queue: float = 0.0  # the model's queue before (see the module's docstring)


@dataclass(frozen=True)
class SwitchPlan:
    """What a re-check decided: ``switch`` (None: stay), or wait for ``defer_to`` to move first."""

    switch: Choice | None = None
    defer_to: str | None = None


def _placed(hosted: Iterable[Hosted], model: str) -> list[Placed]:
    return [Placed(h.peer, h.blocks, float(h.free_tokens)) for h in hosted if h.model == model]


def _free(hosted: Iterable[Hosted], model: str, num_blocks: int) -> np.ndarray:
    """Per block of ``model``: free tokens summed over its servers (a server announcing 0 still covers)."""
    return block_throughputs(_placed(hosted, model), num_blocks)


def queue(hosted: Iterable[Hosted], model: str, num_blocks: int) -> float:
    """The steps waiting at ``model``'s busiest block, per server hosting that block (0 uncovered)."""
    waiting, servers = np.zeros(num_blocks), np.zeros(num_blocks)
    for h in hosted:
        if h.model == model:
            start, end = max(0, h.start), min(num_blocks, h.end)
            waiting[start:end] += h.queued
            servers[start:end] += 1
    return float(np.max(waiting / np.maximum(servers, 1), initial=0.0))


def shortages(models: Mapping[str, int], hosted: Iterable[Hosted]) -> dict[str, Balance]:
    """Every model of ``models`` (name -> blocks), balanced over the free tokens of ``hosted``."""
    hosted = list(hosted)
    return {name: balance(_free(hosted, name, n)) for name, n in models.items()}


def combined(*balances: Balance) -> Balance:
    """Models taken together: their uncovered blocks summed, the smallest headroom (0 while a block
    of any is uncovered)."""
    uncovered = sum(b.uncovered for b in balances)
    return Balance(uncovered, min(b.bottleneck for b in balances) if not uncovered else 0.0)


def _place(free: np.ndarray, name: str, n: int, capacity: int) -> Choice:
    """The window of ``n`` blocks a server with ``capacity`` free tokens would take in model ``name``."""
    placed = [Placed(f"b{i}", BlockRange(i, i + 1), float(v)) for i, v in enumerate(free) if v > 0]
    span = choose_span(placed, len(free), min(n, len(free)), float(capacity), random.Random(0))
    after = free.copy()
    after[span.start : span.end] += max(capacity, 1e-6)
    return Choice(name, span, balance(free), balance(after))


def choose_model(
    models: Mapping[str, int], hosted: Iterable[Hosted], spans: Mapping[str, int], capacity: int
) -> Choice | None:
    """The model (and window) a new server takes: of those it can load (``spans``: name -> the blocks
    it would host of it), the one worst served now. ``capacity``: the KV tokens it brings. None when
    it can load none of ``models``."""
    hosted = list(hosted)
    candidates = [name for name in sorted(models) if name in spans]
    if not candidates:
        return None
    choices = [
        replace(_place(_free(hosted, name, models[name]), name, spans[name], capacity),
                queue=queue(hosted, name, models[name]))
        for name in candidates
    ]  # fmt: skip
    return min(
        choices,
        key=lambda c: (-c.before.uncovered, -c.queue, c.before.bottleneck, tuple(-x for x in c.after.key()), c.model),
    )


@dataclass(frozen=True)
class _Pair:
    """Two models' blocks side by side: covered or not, and each block's free tokens."""

    covered: np.ndarray  # bool
    free: np.ndarray

    def key(self, level: float) -> tuple[int, float, int]:
        """Larger is better: fewer uncovered blocks, a higher headroom, fewer blocks at or below ``level``."""
        uncovered = int((~self.covered).sum())
        if uncovered:
            return (-uncovered, 0.0, 0)
        return (0, float(self.free.min()), -int((self.free <= level).sum()))


def _better(new: _Pair, old: _Pair, margin: float) -> bool:
    """Worth switching for: fewer uncovered blocks; or (all covered) the smaller headroom up by
    ``margin`` (and at least a token), or not lower with fewer blocks within ``margin`` of it (a
    server of part of a model lifts part of its weakest blocks; the next one lifts the rest). Each
    switch raises (headroom, -blocks within margin of it): under steady demand no cycle."""
    (u_new, low_new, _), (u_old, low_old, _) = new.key(0.0), old.key(0.0)
    if u_new != u_old:
        return u_new > u_old
    if u_old:
        return False
    if low_new > max(low_old, 0.0) * margin and low_new > low_old + 1:
        return True
    level = max(low_old, 0.0) * margin + 1
    return low_new >= low_old and new.key(level)[2] > old.key(level)[2]


def _switch(
    models: Mapping[str, int], hosted: list[Hosted], me: Hosted, spans: Mapping[str, int], capacity: int, margin: float
) -> Choice | None:
    """The best switch of ``me`` to another model that clearly helps, or None."""
    current = me.model
    if current not in models:
        return None
    others = [h for h in hosted if h.peer != me.peer]
    now = _free(hosted, current, models[current])
    left = _free(others, current, models[current])
    if (left <= 0).sum() > (now <= 0).sum():
        return None  # it alone hosts some block: never leave a span uncovered
    used = max(capacity - me.free_tokens, 0)  # its sessions' tokens move onto the others
    best: tuple[tuple, Choice] | None = None
    for name in sorted(spans):
        if name == current or name not in models:
            continue
        there = _free(others, name, models[name])
        choice = _place(there, name, spans[name], capacity)
        mine = there.copy()
        mine[choice.start : choice.end] += max(capacity, 1e-6)
        before = _Pair(np.concatenate([now, there]) > 0, np.concatenate([now, there]))
        after = _Pair(np.concatenate([left, mine]) > 0, np.concatenate([left - used, mine]))
        if not _better(after, before, margin):
            continue
        key = after.key(max(before.key(0.0)[1], 0.0) * margin + 1)
        if best is None or key > best[0]:
            best = (key, choice)
    return best[1] if best is not None else None


def plan_switch(
    models: Mapping[str, int],
    hosted: Iterable[Hosted],
    me: str,
    spans: Mapping[str, int],
    capacity: int,
    margin: float = DEFAULT_MARGIN,
    ignore: Collection[str] = (),
) -> SwitchPlan:
    """Whether the server ``me`` (one of ``hosted``) should change model now, and to which.
    ``spans``: the blocks it would host of each model it can load; ``capacity``: its KV tokens.

    Servers with smaller peer ids go first, weighed with the same capacity: a server waits for one
    whose own switch goes to the same model (``defer_to``), and leaves only when its model stays
    covered even if every server of it with a smaller peer id and a switch of its own leaves at the
    same time (servers deciding on the same table never leave a block uncovered between them).
    ``ignore``: servers not to wait for, nor to expect to leave (they did not when they could)."""
    hosted = list(hosted)
    mine = next((h for h in hosted if h.peer == me), None)
    if mine is None:
        return SwitchPlan()
    switch = _switch(models, hosted, mine, spans, capacity, margin)
    if switch is None:
        return SwitchPlan()
    earlier = [h for h in hosted if h.peer < me and h.peer not in ignore]
    ahead = {h.peer: t for h in earlier if (t := _switch(models, hosted, h, spans, capacity, margin)) is not None}
    first = min((p for p, theirs in ahead.items() if theirs.model == switch.model), default=None)
    if first is not None:
        return SwitchPlan(defer_to=first)
    n = models[mine.model]
    now = _free(hosted, mine.model, n)
    left = _free([h for h in hosted if h.peer != me and h.peer not in ahead], mine.model, n)
    if (left <= 0).sum() > (now <= 0).sum():
        return SwitchPlan()
    return SwitchPlan(switch)


class Switcher:
    """One server's re-checks across models: :func:`plan_switch`, waiting for a smaller peer id at
    most once (a server waited for that has not switched by the next check is not waited for again:
    it may be one that never switches, started with a model)."""

    def __init__(self, me: str, margin: float = DEFAULT_MARGIN):
        self.me, self.margin = me, margin
        self.ignored: set[str] = set()
        self.waited: str | None = None

    def check(
        self, models: Mapping[str, int], hosted: Iterable[Hosted], spans: Mapping[str, int], capacity: int
    ) -> Choice | None:
        """The switch to make now, if any."""
        hosted = list(hosted)
        plan = plan_switch(models, hosted, self.me, spans, capacity, self.margin, self.ignored)
        if plan.defer_to is not None and plan.defer_to == self.waited:
            self.ignored.add(plan.defer_to)
            plan = plan_switch(models, hosted, self.me, spans, capacity, self.margin, self.ignored)
        self.waited = plan.defer_to
        return plan.switch
