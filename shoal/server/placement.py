"""Where a server started without ``--blocks`` sits in its swarm: pure functions, no I/O.

The swarm's throughput at block ``i`` is the sum of the announced throughputs (tokens/s per block)
of the servers covering ``i``; the swarm as a whole runs at the pace of its weakest block, and a block
nobody covers stops it. A :class:`Balance` sums that up as (uncovered blocks, bottleneck).

* :func:`choose_span`: a new server's ``n``-block window. Every window is scored by the per-block
  throughput that would result: fewer uncovered blocks, then a higher minimum, then fewer blocks at
  that minimum, then fewer separate runs of such blocks (so the weak part left over stays in one piece
  that later servers can tile exactly: a first server on an empty 12-block swarm takes 0:4 or 8:12,
  never 3:7), then the window the server already holds, then a random one (an injectable
  ``random.Random``).
* :func:`plan_move`: the periodic re-check. Without this server's own contribution, the best window
  is chosen again; the server moves only when that clearly improves the swarm (:func:`clearly_better`:
  fewer uncovered blocks, or the bottleneck up by ``margin``, 20% by default: hysteresis). While some
  block is uncovered and no single move fixes it, a server may also make a *neutral* move (nothing
  gets worse at once) when a simulation of the other servers' own re-checks after it predicts a clear
  improvement: from 0:4, 3:7, 7:11 (block 11 uncovered) the server at 3:7 moves to 4:8, after which
  7:11 -> 8:12 covers everything. Neutral moves are tried only for uncovered blocks, so a healthy swarm
  never churns on predictions.

What they weigh is :func:`counted`: the records of servers that will really serve, each at a capped
throughput (see there). Spans are half-open ``[start, end)``.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from shoal.ids import BlockRange, OnBlocks, PeerId
from shoal.swarm.records import ServerRecord, State

MIN_THROUGHPUT = 1e-6  # a server announcing 0 still covers its blocks
DEFAULT_MARGIN = 1.2
MAX_NEUTRAL_CANDIDATES = 16  # neutral windows simulated per check
MAX_SIMULATED_ROUNDS = 4
THROUGHPUT_CAP = 4.0  # a record counts at most this many times the median counted throughput


@dataclass(frozen=True)
class Placed(OnBlocks):
    """A server's span in the swarm (an online or joining record)."""

    peer: PeerId
    blocks: BlockRange
    throughput: float

    @property
    def length(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class Balance:
    uncovered: int  # blocks no server covers
    bottleneck: float  # the smallest per-block throughput (0 while some block is uncovered)

    def key(self) -> tuple[int, float]:
        """Larger is better."""
        return (-self.uncovered, self.bottleneck)


@dataclass(frozen=True)
class Move(OnBlocks):
    blocks: BlockRange
    before: Balance  # the swarm now
    after: Balance  # right after the move (neutral moves: no worse than ``before``)
    expected: Balance  # once the others have reacted too (direct moves: same as ``after``)

    @property
    def neutral(self) -> bool:
        return self.expected != self.after


def counted(
    records: Iterable[ServerRecord], now: float, admitted: Collection[str], convicted: Collection[str], me: str = ""
) -> list[Placed]:
    """The servers placement weighs among ``records`` (one model's, any state): those that will
    really serve. Left out: ``offline`` records (a server says so before it drains, and a moving
    one announces its new span ``joining`` and counts there), expired ones, those of peers not in
    ``admitted`` (this server has not reached them at the record's addresses: a SIGKILLed server's
    record lives on until it expires, ``--expiry`` 180 s by default) and those ``convicted`` by the
    swarm's verdicts (a liar's record stays online until it leaves, while clients route around it).
    ``me``, this server's own record, always counts.

    No record is vouched for: a joining server has seen nobody compute, so whatever it counts is a
    claim. Counting a server that will not serve leaves its span thinner than it looks, while
    leaving out one that would only puts a newcomer where it was needed a little less: when unsure,
    a record does not count. The two cheap claims are bounded: existence needs a live endpoint per
    key (admission), and throughput, a number, counts at most :data:`THROUGHPUT_CAP` times the
    median of the counted records' (a key announcing a billion tokens/s weighs as a few servers,
    not as all newcomers' worth). A Sybil that runs many answering keys on one span still steers
    newcomers away from it: without evidence of work no placement rule can tell those keys from
    servers; what they cannot do is serve wrong unseen (audits and verdicts catch that, and a
    conviction takes them out of this count)."""
    live = [
        r
        for r in records
        if r.peer == me
        or (r.state is not State.OFFLINE and r.expires > now and r.peer in admitted and r.peer not in convicted)
    ]
    if not live:
        return []
    cap = THROUGHPUT_CAP * statistics.median(max(r.throughput, MIN_THROUGHPUT) for r in live)
    return [Placed(PeerId(r.peer), r.blocks, min(r.throughput, cap)) for r in live]


def block_throughputs(servers: Iterable[Placed], num_blocks: int) -> np.ndarray:
    """Per-block throughput of ``servers`` (spans clipped to the model)."""
    out = np.zeros(num_blocks)
    for s in servers:
        start, end = max(0, s.start), min(num_blocks, s.end)
        if start < end:
            out[start:end] += max(s.throughput, MIN_THROUGHPUT)
    return out


def balance(throughputs: np.ndarray) -> Balance:
    return Balance(int((throughputs <= 0).sum()), float(throughputs.min()) if len(throughputs) else 0.0)


def clearly_better(new: Balance, old: Balance, margin: float = DEFAULT_MARGIN) -> bool:
    """Worth moving for: fewer uncovered blocks, or (all covered) a bottleneck ``margin`` times higher."""
    if new.uncovered != old.uncovered:
        return new.uncovered < old.uncovered
    return new.uncovered == 0 and new.bottleneck > old.bottleneck * margin


def _quantize(x: np.ndarray) -> np.ndarray:
    """Round to 9 significant digits, so sums taken in another order compare equal."""
    with np.errstate(divide="ignore"):
        digits = 8 - np.floor(np.log10(np.abs(np.where(x == 0, 1.0, x))))
    return np.array([round(float(v), int(d)) for v, d in zip(x, digits, strict=True)])


def _window_scores(base: np.ndarray, n: int, throughput: float) -> tuple[np.ndarray, list[tuple]]:
    """For every start of an ``n``-block window: the resulting per-block throughput (rows) and its
    score (larger is better; see the module docstring)."""
    num_blocks = len(base)
    starts = np.arange(num_blocks - n + 1)[:, None]
    blocks = np.arange(num_blocks)[None, :]
    results = base[None, :] + max(throughput, MIN_THROUGHPUT) * ((blocks >= starts) & (blocks < starts + n))
    uncovered = (results <= 0).sum(axis=1)
    minima = _quantize(results.min(axis=1))
    weak = results <= minima[:, None] * (1 + 1e-8)
    count = weak.sum(axis=1)
    runs = weak[:, 0].astype(int) + (weak[:, 1:] & ~weak[:, :-1]).sum(axis=1)
    scores = [(-int(u), float(m), -int(c), -int(r)) for u, m, c, r in zip(uncovered, minima, count, runs, strict=True)]
    return results, scores


def _best_start(
    base: np.ndarray, n: int, throughput: float, rng: random.Random, current: int | None = None
) -> tuple[int, np.ndarray]:
    results, scores = _window_scores(base, n, throughput)
    top = max(scores)
    best = [i for i, s in enumerate(scores) if s == top]
    start = current if current in best else rng.choice(best)
    return start, results[start]


def choose_span(
    servers: Sequence[Placed], num_blocks: int, n: int, throughput: float, rng: random.Random | None = None
) -> BlockRange:
    """The ``n``-block window a new server with ``throughput`` should take among ``servers``."""
    if not 0 < n <= num_blocks:
        raise ValueError(f"cannot place {n} blocks in a model of {num_blocks}")
    start, _ = _best_start(block_throughputs(servers, num_blocks), n, throughput, rng or random.Random())
    return BlockRange(start, start + n)


def _settle(
    servers: list[Placed], num_blocks: int, fixed: str, rng: random.Random, margin: float
) -> tuple[list[Placed], Balance]:
    """Let every server but ``fixed`` re-check (direct moves only, in random order) until none
    moves or the round limit: where the swarm would end up."""
    servers = list(servers)
    for _ in range(MAX_SIMULATED_ROUNDS):
        moved = False
        order = [i for i, s in enumerate(servers) if s.peer != fixed]
        rng.shuffle(order)
        for i in order:
            move = _direct_move(servers, num_blocks, i, rng, margin)
            if move is not None:
                servers[i] = replace(servers[i], blocks=move.blocks)
                moved = True
        if not moved:
            break
    return servers, balance(block_throughputs(servers, num_blocks))


def _direct_move(servers: list[Placed], num_blocks: int, i: int, rng: random.Random, margin: float) -> Move | None:
    me = servers[i]
    now = balance(block_throughputs(servers, num_blocks))
    base = block_throughputs(servers[:i] + servers[i + 1 :], num_blocks)
    start, result = _best_start(base, me.length, me.throughput, rng, current=me.start)
    after = balance(result)
    if start != me.start and clearly_better(after, now, margin):
        return Move(BlockRange(start, start + me.length), now, after, after)
    return None


def _neutral_move(servers: list[Placed], num_blocks: int, i: int, rng: random.Random, margin: float) -> Move | None:
    """A window for server ``i`` that makes nothing worse at once and, once the other servers have
    re-checked after it, clearly helps (see the module docstring)."""
    mine = servers[i]
    now = balance(block_throughputs(servers, num_blocks))
    others = servers[:i] + servers[i + 1 :]
    results, _ = _window_scores(block_throughputs(others, num_blocks), mine.length, mine.throughput)
    candidates = [s for s in range(len(results)) if s != mine.start and balance(results[s]).uncovered <= now.uncovered]
    rng.shuffle(candidates)
    best: Move | None = None
    for start in candidates[:MAX_NEUTRAL_CANDIDATES]:
        moved = [*others, replace(mine, blocks=BlockRange(start, start + mine.length))]
        _, expected = _settle(moved, num_blocks, mine.peer, rng, margin)
        if clearly_better(expected, now, margin) and (best is None or expected.key() > best.expected.key()):
            best = Move(BlockRange(start, start + mine.length), now, balance(results[start]), expected)
    return best


@dataclass(frozen=True)
class Plan:
    """What a re-check decided: ``move`` (None: stay), or wait for ``defer_to`` to move first."""

    move: Move | None = None
    defer_to: str | None = None


def plan_move(
    servers: Sequence[Placed],
    num_blocks: int,
    me: str,
    rng: random.Random | None = None,
    margin: float = DEFAULT_MARGIN,
    neutral: bool = True,
    defer: bool = True,
) -> Plan:
    """Whether the server ``me`` (one of ``servers``) should move now, and where.

    Servers re-check on their own clocks, and two that see the same gap would both jump into it. So
    with ``defer``, a server leaves a move to another server that has one at least as good (ties: the
    smaller peer id goes first), and makes a neutral move only when no server has a direct one and no
    server with a smaller peer id has a neutral one. The caller stops deferring after a few checks in
    a row (the other server may be one that never moves: started with ``--blocks``)."""
    rng = rng or random.Random()
    servers = list(servers)
    index = next((i for i, s in enumerate(servers) if s.peer == me), None)
    if index is None or servers[index].length > num_blocks:
        return Plan()
    mine = _direct_move(servers, num_blocks, index, rng, margin)
    direct = {}
    if defer:
        for j, other in enumerate(servers):
            if j != index and (move := _direct_move(servers, num_blocks, j, rng, margin)) is not None:
                direct[other.peer] = move
    if mine is not None:
        ahead = [p for p, m in direct.items() if (m.after.key(), me) > (mine.after.key(), p)]
        return Plan(defer_to=min(ahead)) if ahead else Plan(mine)
    if not neutral or balance(block_throughputs(servers, num_blocks)).uncovered == 0:
        return Plan()
    if direct:
        return Plan(defer_to=min(direct))
    if defer:
        for j in sorted(range(len(servers)), key=lambda j: servers[j].peer):
            if servers[j].peer >= me:
                break
            if _neutral_move(servers, num_blocks, j, rng, margin) is not None:
                return Plan(defer_to=servers[j].peer)
    return Plan(_neutral_move(servers, num_blocks, index, rng, margin))
