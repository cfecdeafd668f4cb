"""The steps waiting for a span's next batch (:mod:`shoal.server.batching`), and which of them a batch takes.

Fairness: the queue is filled round-robin by peer, one step of each peer per round, and the peers
served go to the back (rounds start with the peer served least recently: one whose single session
was away on the rest of the chain comes first when it is back), so a peer with 24 waiting sessions
gets no more of a scarce batch than a peer with one. A step left waiting when a batch was taken
counts as deferred (per peer too). Only steps that can share one forward join a batch: of the first
step's adapter and dtype, on its page pool, without deep prompts (a step with them runs alone).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_REMEMBERED_PEERS = 4096  # when they last were served (then only those waiting are kept)


@dataclass(eq=False)
class PendingStep:
    """One session's step (or one chunk of a step cut in pieces) waiting for a batch."""

    hidden: torch.Tensor  # [rows, n, H], as received: its dtype is the answer's
    position_ids: torch.Tensor
    mask: torch.Tensor | None  # covers [0, past_length + n)
    cache: Any  # the session's PagedCache
    past_length: int
    prompts: torch.Tensor | None = None  # deep prompts: the step runs alone
    adapter: str | None = None
    peer: str | None = None
    chunk: bool = False  # one chunk of a step cut in pieces (counted as a prefill chunk)
    pushed: bool = False  # handed on by the previous server of the session's chain (not from its client)
    future: Future = field(default_factory=Future)

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def positions(self) -> int:
        return self.hidden.shape[0] * self.hidden.shape[1]

    @property
    def end(self) -> int:
        return self.past_length + self.hidden.shape[1]


class StepQueue:
    """Waiting steps by peer, taken round-robin into batches. Not thread-safe: the batcher's lock guards it."""

    def __init__(self) -> None:
        self._by_peer: OrderedDict[str | None, deque[PendingStep]] = OrderedDict()
        self.deferred = 0
        self.deferred_by_peer: Counter[str | None] = Counter()
        self._served_at: dict[str | None, int] = {}  # peer -> the batch that last served it
        self._batches = 0

    def __len__(self) -> int:
        return sum(len(steps) for steps in self._by_peer.values())

    def add(self, step: PendingStep) -> None:
        self._by_peer.setdefault(step.peer, deque()).append(step)

    def rows_waiting(self) -> int:
        return sum(step.rows for queue in self._by_peer.values() for step in queue)

    def head(self) -> PendingStep | None:
        """The step :meth:`take` would start its batch with."""
        self._drop_cancelled()
        peers = self._in_turn()
        return self._by_peer[peers[0]][0] if peers else None

    def _in_turn(self) -> list[str | None]:
        """The peers with steps waiting, the one served least recently first."""
        return sorted(self._by_peer, key=lambda p: self._served_at.get(p, -1))

    def peers_waiting(self) -> int:
        return sum(1 for queue in self._by_peer.values() if queue)

    def drain(self) -> list[PendingStep]:
        """Everything waiting, removed (to fail it when the server goes)."""
        steps = [step for queue in self._by_peer.values() for step in queue]
        self._by_peer.clear()
        return steps

    def take(
        self, max_rows: int, max_positions: int, prefer: Callable[[PendingStep], bool] | None = None
    ) -> list[PendingStep]:
        """The next batch, set running: the oldest step of the peer whose turn it is (always, even
        alone past the limits), then rounds over the peers in turn, each round one step of each
        peer (its oldest that fits, of those ``prefer`` admits if any), while rows and positions
        allow. Only steps of the first's adapter join, none with deep prompts, none of a cache
        already in the batch. The peers served go to the back in the order served; every step
        left waiting counts one deferral."""
        self._drop_cancelled()
        batch: list[PendingStep] = []
        served: list[str | None] = []
        rows = positions = 0
        progress = True
        while progress and self._by_peer:
            progress = False
            for peer in self._in_turn():
                queue = self._by_peer[peer]
                room = (max_rows - rows, max_positions - positions)
                pick = 0 if not batch else self._fitting(queue, batch, *room, prefer)
                if pick is None:
                    continue
                step = queue[pick]
                del queue[pick]
                batch.append(step)
                rows, positions = rows + step.rows, positions + step.positions
                if peer not in served:
                    served.append(peer)
                progress = True
                if batch[0].prompts is not None or rows >= max_rows:
                    progress = False
                    break
        self._batches += 1
        for peer in served:  # served peers to the back (a peer whose queue empties keeps its turn), emptied ones out
            self._served_at[peer] = self._batches
            if self._by_peer[peer]:
                self._by_peer.move_to_end(peer)
            else:
                del self._by_peer[peer]
        if len(self._served_at) > MAX_REMEMBERED_PEERS:
            self._served_at = {p: n for p, n in self._served_at.items() if p in self._by_peer}
        for peer, queue in self._by_peer.items():
            self.deferred += len(queue)
            self.deferred_by_peer[peer] += len(queue)
        return [step for step in batch if step.future.set_running_or_notify_cancel()]

    @staticmethod
    def _fitting(
        queue: deque[PendingStep],
        batch: list[PendingStep],
        rows: int,
        positions: int,
        prefer: Callable[[PendingStep], bool] | None,
    ) -> int | None:
        """Index of ``queue``'s oldest step that may join ``batch`` within ``rows`` and ``positions``
        (its cache on the first's page pool: one forward reads one pool), of those ``prefer``
        admits if there is one."""
        fits = StepQueue._fits(queue, batch, rows, positions)
        return next((index for index in fits if prefer is None or prefer(queue[index])), fits[0] if fits else None)

    @staticmethod
    def _fits(queue: deque[PendingStep], batch: list[PendingStep], rows: int, positions: int) -> list[int]:
        first, caches = batch[0], {id(step.cache) for step in batch}
        pool = getattr(first.cache, "pool", None)
        fits = []
        for index, step in enumerate(queue):
            if step.prompts is not None or step.adapter != first.adapter or id(step.cache) in caches:
                continue
            if step.hidden.dtype != first.hidden.dtype:  # one input buffer: another dtype would round it
                continue
            if getattr(step.cache, "pool", None) is not pool:
                continue
            if step.rows <= rows and step.positions <= positions:
                fits.append(index)
        return fits

    def _drop_cancelled(self) -> None:
        """Steps whose session went (their future was cancelled) leave the queue uncounted."""
        for peer in list(self._by_peer):
            kept = deque(step for step in self._by_peer[peer] if not step.future.cancelled())
            if kept:
                self._by_peer[peer] = kept
            else:
                del self._by_peer[peer]


__all__ = ["MAX_REMEMBERED_PEERS", "PendingStep", "StepQueue"]
