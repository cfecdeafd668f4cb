"""The server's compute thread (:class:`shoal.server.scheduler.ComputeScheduler`): one worker, queued
work taken by priority class (inference, then forwards, then training) and FIFO within a class,
Executor semantics (results, exceptions, cancellation, shutdown), and counters that say how often
priority let a task go before earlier-queued work.

Ordering is made deterministic by a gate: a first task holds the worker until every other task is
queued, so the order they run in is the scheduler's choice alone (no timing involved)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

from shoal.server.backend import compute_thread
from shoal.server.scheduler import ComputeScheduler, Priority

pytestmark = pytest.mark.timeout(20)
WAIT = 5.0  # seconds any wait in these tests may take at most

INF, F, T, G = Priority.INFERENCE, Priority.FORWARD, Priority.TRAINING, Priority.GIVING


class Gate:
    """A task that holds the worker until :meth:`open`."""

    def __init__(self, scheduler: ComputeScheduler):
        self.entered, self.release = threading.Event(), threading.Event()
        self.future = scheduler.submit(self._hold)
        assert self.entered.wait(WAIT), "the worker did not start the gate"

    def _hold(self) -> str:
        self.entered.set()
        assert self.release.wait(WAIT)
        return "gate"

    def open(self) -> None:
        self.release.set()
        assert self.future.result(WAIT) == "gate"


@pytest.fixture
def scheduler():
    scheduler = ComputeScheduler(num_threads=1)
    yield scheduler
    scheduler.shutdown(wait=True, cancel_futures=True)


def run_order(scheduler: ComputeScheduler, tasks: list[tuple[Priority, str]]) -> list[str]:
    """Queue ``tasks`` behind a gate, open it; the labels in the order the worker ran them."""
    ran: list[str] = []
    gate = Gate(scheduler)
    futures = [scheduler.submit_as(priority, ran.append, label) for priority, label in tasks]
    assert [scheduler.queued(p) for p in Priority] == [sum(p == q for q, _ in tasks) for p in Priority]
    gate.open()
    for future in futures:
        assert future.result(WAIT) is None
    return ran


def test_queued_work_runs_by_class_then_in_order_and_jumps_are_counted(scheduler):
    """Queued as training, forward, inference, training, inference, forward: the inference tasks
    run first, then the forwards, then the training chunks, each class in submission order. Both
    inference tasks jumped the forward and the training chunk queued before them; the first forward
    jumped the first training chunk, the second forward both."""
    tasks = [(T, "t1"), (F, "f1"), (INF, "i1"), (T, "t2"), (INF, "i2"), (F, "f2")]
    assert run_order(scheduler, tasks) == ["i1", "i2", "f1", "f2", "t1", "t2"]
    counts = scheduler.counts()
    assert counts.ran == {INF: 3, F: 2, T: 2, G: 0}  # the gate is an inference task
    assert counts.jumped == {(INF, F): 2, (INF, T): 2, (F, T): 2, (INF, G): 0, (F, G): 0, (T, G): 0}


def test_within_a_class_work_runs_first_in_first_out(scheduler):
    for priority in Priority:
        labels = [f"{priority.name}{i}" for i in range(6)]
        assert run_order(scheduler, [(priority, label) for label in labels]) == labels
    assert set(scheduler.counts().jumped.values()) == {0}  # nothing went before anything


def test_a_task_is_never_interrupted_a_later_higher_class_one_waits_for_it(scheduler):
    """Priority only picks the next task: a training chunk that is running finishes first."""
    ran: list[str] = []
    started, release = threading.Event(), threading.Event()

    def chunk() -> None:
        started.set()
        assert release.wait(WAIT)
        ran.append("chunk")

    training = scheduler.submit_as(T, chunk)
    assert started.wait(WAIT)
    step = scheduler.submit_as(INF, ran.append, "step")
    release.set()
    step.result(WAIT)
    training.result(WAIT)
    assert ran == ["chunk", "step"]
    assert scheduler.counts().jumped[INF, T] == 0  # the chunk was running, not waiting


def test_results_and_exceptions_reach_the_caller_and_the_worker_goes_on(scheduler):
    def fails() -> None:
        raise ValueError("deep prompts do not fit")

    failed = scheduler.submit_as(T, fails)
    with pytest.raises(ValueError, match="deep prompts do not fit"):
        failed.result(WAIT)
    assert scheduler.submit_as(F, lambda a, b=0: a * 10 + b, 4, b=2).result(WAIT) == 42
    assert scheduler.counts().ran == {INF: 0, F: 1, T: 1, G: 0}


def test_run_in_executor_uses_the_inference_class_on_one_named_thread_with_its_torch_threads():
    """What the server relies on: ``loop.run_in_executor`` works (default class: inference), every
    task runs on the same thread (its name says it is the compute thread), which has the torch
    intra-op threads it was given."""
    scheduler = compute_thread(num_threads=1)
    seen: list[tuple[str, int]] = []

    def where() -> tuple[str, int]:
        return threading.current_thread().name, torch.get_num_threads()

    async def go() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(3):
            seen.append(await loop.run_in_executor(scheduler, where))
        seen.append(await asyncio.wrap_future(scheduler.submit_as(T, where)))

    try:
        asyncio.run(asyncio.wait_for(go(), WAIT))
    finally:
        scheduler.shutdown(wait=True)
    assert seen == [("shoal-compute", 1)] * 4
    assert scheduler.counts().ran == {INF: 3, F: 0, T: 1, G: 0}


def test_shutdown_with_cancel_futures_cancels_what_waits_and_refuses_new_work():
    scheduler = ComputeScheduler()
    gate = Gate(scheduler)
    queued = [scheduler.submit_as(p, lambda: "ran") for p in (T, F, INF)]
    threading.Timer(0.05, gate.release.set).start()  # opens while shutdown waits for the worker
    scheduler.shutdown(wait=True, cancel_futures=True)
    assert gate.future.result(0) == "gate"  # the running task finished
    for future in queued:
        assert future.cancelled()
        with pytest.raises(CancelledError):
            future.result(0)
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        scheduler.submit(print)
    assert not scheduler._thread.is_alive()


def test_shutdown_without_cancel_still_runs_what_was_queued():
    scheduler = ComputeScheduler()
    gate = Gate(scheduler)
    queued = [scheduler.submit_as(p, lambda p=p: p.name) for p in (T, INF)]
    scheduler.shutdown(wait=False)
    gate.open()
    assert [f.result(WAIT) for f in queued] == ["TRAINING", "INFERENCE"]
    scheduler._thread.join(WAIT)
    assert not scheduler._thread.is_alive()


def test_shutdown_from_the_worker_itself_does_not_deadlock(scheduler):
    """A task may shut its own executor down (``wait`` cannot join the thread it runs on)."""
    assert scheduler.submit(lambda: scheduler.shutdown(wait=True)).result(WAIT) is None
    scheduler._thread.join(WAIT)
    assert not scheduler._thread.is_alive()


def test_a_cancelled_queued_task_is_skipped(scheduler):
    ran: list[str] = []
    gate = Gate(scheduler)
    skipped = scheduler.submit_as(T, ran.append, "cancelled")
    kept = scheduler.submit_as(T, ran.append, "kept")
    assert skipped.cancel()
    gate.open()
    kept.result(WAIT)
    assert ran == ["kept"]


def test_giving_weights_waits_for_every_other_class(scheduler):
    """The lowest class (GIVING: once the weights giver's reads, shoal.weights.give) runs only when no step,
    forward or backward chunk waits, whenever it was queued."""
    tasks = [(G, "g1"), (T, "t1"), (F, "f1"), (G, "g2"), (INF, "i1")]
    assert run_order(scheduler, tasks) == ["i1", "f1", "t1", "g1", "g2"]
    assert scheduler.counts().jumped[INF, G] == 1 and scheduler.counts().jumped[T, G] == 1


def test_busy_says_whether_a_more_urgent_task_runs_or_waits(scheduler):
    """What a giver polls before each chunk (shoal.weights.give): busy while a step runs or
    waits, not while the worker is idle or runs only work of the class asked about."""
    assert not scheduler.busy()
    gate = Gate(scheduler)  # an inference task, running
    assert scheduler.busy() and not scheduler.busy(below=INF)
    gate.open()
    assert until(lambda: not scheduler.busy())  # the worker marks itself idle just after the result is set
    held = threading.Event()
    giving = scheduler.submit_as(G, held.wait, WAIT)
    queued = scheduler.submit_as(T, lambda: None)  # waits behind the giving task
    assert scheduler.busy() and not scheduler.busy(below=T)
    held.set()
    giving.result(WAIT), queued.result(WAIT)
    assert until(lambda: not scheduler.busy())


def until(condition, seconds: float = WAIT) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
