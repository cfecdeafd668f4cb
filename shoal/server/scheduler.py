"""The server's one compute thread, as a priority executor: inference before forwards before training
before giving weights to peers.

Every torch call of a server runs on one thread (:func:`shoal.server.backend.compute_thread` says
why: libgomp keeps a thread pool per thread that opens a parallel region). With training on the same
thread, a long backward must not hold up the decode steps of open sessions, so work is queued by
:class:`Priority` class, FIFO within a class, and a backward is submitted as many small tasks (one
block each): a step that arrives meanwhile waits for at most the chunk that is running.

Within a class, work is shared round-robin by peer (``submit_as(..., peer=...)``; work without a
peer is one more "peer"): each peer's tasks run in submission order, and the peer whose task just
ran goes to the back, so one peer with many queued forwards (or backward chunks) cannot starve
another peer's single one. Session steps are shared the same way one level up, by the batcher
(:mod:`shoal.server.batching`) that fills each batched forward round-robin by peer.

A task is never interrupted: priority decides only which queued task runs next. The counters say how
often a task was taken before earlier-queued work of a lower class (it "jumped ahead" of it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch


class Priority(IntEnum):
    """Classes of compute work, the most urgent first (a lower value runs first)."""

    INFERENCE = 0  # session steps, a session's cache allocation, loading and warm-up
    FORWARD = 1  # stateless forwards
    TRAINING = 2  # the chunks of a backward
    GIVING = 3  # the lowest class (shoal.weights.give reads on its own thread, yielding while busy() says so)


@dataclass
class _Task:
    seq: int  # submission order: FIFO within a class, and "queued before" across classes
    future: Future
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict

    def run(self) -> None:
        """Run it (its future is set running already) and settle its future."""
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # as ThreadPoolExecutor: the caller of result() gets it
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


@dataclass(frozen=True)
class SchedulerCounts:
    """Tasks run per class, and jumps: ``jumped[(high, low)]`` counts tasks of class ``high`` taken
    while a ``low`` task queued before them still waited."""

    ran: dict[Priority, int]
    jumped: dict[tuple[Priority, Priority], int]

    def minus(self, earlier: SchedulerCounts) -> SchedulerCounts:
        """What happened since ``earlier`` (a server counts only its own span's time)."""
        return SchedulerCounts(
            {p: n - earlier.ran.get(p, 0) for p, n in self.ran.items()},
            {pair: n - earlier.jumped.get(pair, 0) for pair, n in self.jumped.items()},
        )


class _RoundRobin:
    """One class's queue: FIFO per peer, peers served in turn (the one just served goes last)."""

    def __init__(self) -> None:
        self._by_peer: OrderedDict[str | None, deque[_Task]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, peer: str | None, task: _Task) -> None:
        self._by_peer.setdefault(peer, deque()).append(task)
        self._size += 1

    def popleft(self) -> _Task:
        """The first task of the peer whose turn it is; that peer then waits for everyone else's turn."""
        peer, tasks = next(iter(self._by_peer.items()))
        task = tasks.popleft()
        self._size -= 1
        if tasks:
            self._by_peer.move_to_end(peer)
        else:
            del self._by_peer[peer]
        return task

    def oldest_seq(self) -> int | None:
        """The submission number of the longest-waiting task (each peer's first is its oldest)."""
        return min((tasks[0].seq for tasks in self._by_peer.values()), default=None)


class ComputeScheduler(Executor):
    """An executor with one worker thread whose queue is ordered by :class:`Priority`, then
    round-robin by peer, FIFO for each peer.

    ``submit`` keeps :class:`~concurrent.futures.Executor`'s meaning, at :attr:`Priority.INFERENCE`
    (so ``loop.run_in_executor`` works as with a thread pool); :meth:`submit_as` picks the class.
    The worker first sets torch's intra-op threads to ``num_threads`` (if given)."""

    def __init__(self, num_threads: int | None = None, name: str = "shoal-compute"):
        self._queues: dict[Priority, _RoundRobin] = {p: _RoundRobin() for p in Priority}
        self._wake = threading.Condition()
        self._seq = 0
        self._closed = False
        self._ran = dict.fromkeys(Priority, 0)
        self._jumped = {(high, low): 0 for high in Priority for low in Priority if low > high}
        self._num_threads = num_threads
        self._running: Priority | None = None  # the class of the task running now
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return self.submit_as(Priority.INFERENCE, fn, *args, **kwargs)

    def submit_as(
        self, priority: Priority, fn: Callable[..., Any], /, *args: Any, peer: str | None = None, **kwargs: Any
    ) -> Future:
        """Queue ``fn(*args, **kwargs)`` in class ``priority`` on behalf of ``peer`` (whose turn in
        the class's round-robin it takes); its future holds the result. ``peer`` is this method's
        own keyword: ``fn`` cannot be given one of that name."""
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._seq += 1
            self._queues[Priority(priority)].append(peer, _Task(self._seq, future, fn, args, kwargs))
            self._wake.notify()
        return future

    def queued(self, priority: Priority) -> int:
        """Tasks of class ``priority`` waiting now (not counting the one running)."""
        with self._wake:
            return len(self._queues[priority])

    def busy(self, below: Priority = Priority.GIVING) -> bool:
        """Whether a task of a class more urgent than ``below`` runs or waits now: work that must
        not slow such tasks (e.g. giving weights) polls this to wait for a gap. A lock-free read: a
        moment stale at worst."""
        running = self._running
        return (running is not None and running < below) or any(self._queues[p] for p in Priority if p < below)

    def counts(self) -> SchedulerCounts:
        with self._wake:
            return SchedulerCounts(dict(self._ran), dict(self._jumped))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks; with ``cancel_futures`` the queued ones are cancelled, otherwise they still
        run. ``wait`` joins the worker (not from the worker itself)."""
        with self._wake:
            self._closed = True
            if cancel_futures:
                for queue in self._queues.values():
                    while queue:
                        queue.popleft().future.cancel()
            self._wake.notify_all()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _next(self) -> _Task | None:
        """The task to run next, set running (None: shut down and nothing left)."""
        with self._wake:
            while True:
                task = self._pop()
                if task is not None:
                    return task
                if self._closed and not any(self._queues.values()):
                    return None
                if not any(self._queues.values()):
                    self._wake.wait()

    def _pop(self) -> _Task | None:
        """The next queued task of the most urgent class (its peer's turn), counting the jumps it
        makes; None if it was cancelled while it waited (not run, not counted) or nothing is queued."""
        for priority, queue in self._queues.items():
            if not queue:
                continue
            task = queue.popleft()
            if not task.future.set_running_or_notify_cancel():
                return None
            self._ran[priority] += 1
            self._running = priority
            for low in Priority:
                oldest = self._queues[low].oldest_seq() if low > priority else None
                if oldest is not None and oldest < task.seq:
                    self._jumped[priority, low] += 1
            return task
        return None

    def _work(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        while (task := self._next()) is not None:
            task.run()
            self._running = None
            del task  # drop the result before waiting for the next one


__all__ = ["ComputeScheduler", "Priority", "SchedulerCounts"]
