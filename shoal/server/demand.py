"""Which model a server without one serves, and when it changes model: pure functions, no I/O.

A server started with ``--join`` and no model reads the joined swarms' records and serves the model
where the swarm is short. A model is weighed by its :class:`~shoal.server.placement.Balance` over
the free KV cache its servers announce (``cache_tokens_free``: what sessions leave of their
caches, so it falls as the model's load rises): ``uncovered`` blocks no server hosts, and the free
tokens at its weakest block (its *headroom*). A model nobody serves has every block uncovered.

* :func:`choose_model`: a new server takes the worst-served model it can load: the most uncovered
  blocks, then the least headroom (ties: the name, so equal views decide alike).
* :func:`plan_switch`: the periodic re-check (once per ``--rebalance-period``, so at most one move
  per period). The server leaves its model for another only when that clearly helps the two
  together (:func:`~shoal.server.placement.clearly_better` on their summed uncovered blocks, then
  their smaller headroom, by ``margin``: hysteresis) and never when it alone hosts some block of its
  model. The sessions it served move onto the others (their tokens leave those servers' headroom).
  Every move raises the smaller headroom of the two models it touches by ``margin`` and leaves the
  other models alone, so under steady demand the sorted headrooms only rise: servers settle, they
  do not oscillate. Servers re-check on their own clocks; two seeing the same shortage would both
  move, so a server leaves a switch to a server with a smaller peer id that has one at least as good
  (:class:`SwitchPlan` ``defer_to``; the caller stops deferring after a few checks, as within a model).

Moves within a model stay :mod:`shoal.server.placement`'s.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from shoal.ids import BlockRange, OnBlocks
from shoal.server.placement import DEFAULT_MARGIN, Balance, Placed, balance, block_throughputs, choose_span

__all__ = ["Choice", "Hosted", "SwitchPlan", "choose_model", "combined", "plan_switch", "shortages"]


@dataclass(frozen=True)
class Hosted(OnBlocks):
    """A server as demand placement reads its record (online or joining)."""

    peer: str
    model: str
    blocks: BlockRange
    free_tokens: int  # its record's cache_tokens_free


@dataclass(frozen=True)
class Choice(OnBlocks):
    """Serve ``model`` at ``blocks``; the model's balance before and right after."""

    model: str
    blocks: BlockRange
    before: Balance
    after: Balance


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
    choices = [_place(_free(hosted, name, models[name]), name, spans[name], capacity) for name in candidates]
    return min(choices, key=lambda c: (c.before.key(), tuple(-x for x in c.after.key()), c.model))


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
    uncovered = int((left <= 0).sum())
    used = max(capacity - me.free_tokens, 0)  # its sessions' tokens move onto the others
    left_after = Balance(uncovered, float((left - used).min()) if not uncovered else 0.0)
    before_mine = balance(now)
    best: tuple[tuple, Choice] | None = None
    for name in sorted(spans):
        if name == current or name not in models:
            continue
        choice = _place(_free(others, name, models[name]), name, spans[name], capacity)
        before, after = combined(before_mine, choice.before), combined(left_after, choice.after)
        if not _clearly_better(after, before, margin):
            continue
        if best is None or after.key() > best[0]:
            best = (after.key(), choice)
    return best[1] if best is not None else None


def _clearly_better(new: Balance, old: Balance, margin: float) -> bool:
    """As :func:`~shoal.server.placement.clearly_better`, with a headroom of 0 counting as the
    smallest (a model out of free cache gains from any tokens brought)."""
    if new.uncovered != old.uncovered:
        return new.uncovered < old.uncovered
    if new.uncovered:
        return False
    return new.bottleneck > max(old.bottleneck, 0.0) * margin and new.bottleneck > old.bottleneck + 1


def plan_switch(
    models: Mapping[str, int],
    hosted: Iterable[Hosted],
    me: str,
    spans: Mapping[str, int],
    capacity: int,
    margin: float = DEFAULT_MARGIN,
    defer: bool = True,
) -> SwitchPlan:
    """Whether the server ``me`` (one of ``hosted``) should change model now, and to which.
    ``spans``: the blocks it would host of each model it can load; ``capacity``: its KV tokens.
    With ``defer``, a server with a smaller peer id whose own switch (weighed with the same
    capacity) to the same model goes first."""
    hosted = list(hosted)
    mine = next((h for h in hosted if h.peer == me), None)
    if mine is None:
        return SwitchPlan()
    switch = _switch(models, hosted, mine, spans, capacity, margin)
    if switch is None:
        return SwitchPlan()
    if defer:
        for other in sorted(hosted, key=lambda h: h.peer):
            if other.peer >= me:
                break
            theirs = _switch(models, hosted, other, spans, capacity, margin)
            if theirs is not None and theirs.model == switch.model:
                return SwitchPlan(defer_to=other.peer)
    return SwitchPlan(switch)
