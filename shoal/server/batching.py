"""Continuous batching of session steps: the steps waiting for a span run as one batched forward.

A one-token decode step is bound by reading the span's weights, so the steps of many sessions cost
little more together than one alone. A session step (:meth:`Batcher.step`) therefore does not go
to the compute thread by itself: it waits in the :class:`StepQueue`, and one task of the inference
class drains that queue. Whenever it runs it takes as many waiting steps as fit (rows <=
``max_batch``, new positions <= ``prefill_chunk + max_batch``: one chunk of a prefill and a decode
step of every other row), runs them as ONE ``span.forward_steps``, settles each step's future with
its own output, and queues itself again if steps are left. There is no window: an idle server's lone
step runs at once, and steps that arrive while a batch runs make the next one.

Groups: a chain is a pipeline. One batch of all its sessions keeps one server busy at a time
while the others wait for it, so the sessions run in as many groups as their chains keep busy
(:func:`~shoal.server.pacing.choose_groups`, from how deep the chains are in this server's steps
and what batches cost here): in a chain of two like servers, two groups of half the rows, one
running here while the other runs on the other server. A batch then takes at most its group's share
of the rows (``ceil(rows / groups)``), the steps of the sessions it started with last time first
(their *cohort*: the batch a session's last step ran in here). A lone server's sessions stay one
group. The server a session's client sends its steps to groups them; a server the previous one
pushes them to (``pushed``) runs them as they come, a batch of the previous server's a batch here
(waiting only for its stragglers, :data:`STRAGGLER_WAIT`), so a chain keeps one grouping: two
servers deciding apart can settle in two that make each other's measure wrong (seen, with the
second server's batches dearer than the first's: one batch of 16 on the first and three groups
on the second, 30% slower). Counters ``batch_groups`` (now) and ``regroupings``.

Merging: the steps of one client's sessions come back as a burst spread over milliseconds, and a
batch started on its first would split them into fragments that stay apart (each a forward of its
own every round). So when the thread frees up with steps waiting, and sessions of the first step's
cohort are due back (:class:`~shoal.server.pacing.Arrivals`: as long after their last step as
they were away before), or steps keep coming in a burst (each within ``BURST_GAP`` lone steps of
the last: what due times cannot tell, such as a client's first decode steps after its prefills),
it waits for them up to ``merge_wait`` (1.5) lone steps' time, until the batch has its rows. Other
cohorts are not waited for (the next group is due about a batch later), unless the sessions ran in
more batches than they have groups: then any session due is, and the fragments merge. A lone
session is never due, nor in a burst, while its own step waits, so an idle server's step still
runs at once; and there is no wait while peers compete (below): nobody waits for another peer's
sessions.

Fairness: the queue (:class:`~shoal.server.step_queue.StepQueue`) is filled round-robin by peer,
one step of each peer per round, so a peer with 24 waiting sessions gets no more of a scarce batch
than a peer with one. A step left waiting when a batch was taken counts as deferred (per peer too).
And while more than one peer has queued steps within the last second, a batch is kept short: it
grows only while its expected cost stays within ``contended_cost`` (1.25 by default) times a lone
step's, from the costs measured as batches run (:class:`~shoal.server.pacing.BatchCosts`). On a GPU
a batch of 32 costs little more than one step, so the limit rarely bites; on a CPU 16 rows cost
~1.5x one (fp32 with oneDNN's packed weights, :mod:`shoal.models.packed`; ~3x without), and a lone
session of one peer beside 24 sessions of another would otherwise wait behind, and then ride in,
batches longer than its own step. One peer alone gets full batches (the most throughput).

Chunked prefill: a step of more than ``prefill_chunk`` new positions (rows x tokens) is cut into
chunks of at most that many, each queued when the one before it finished, so other sessions'
decode steps run between (and beside) them; chunk ``[a, b)`` of a step at ``past`` runs at
``past + a`` with the mask's ``[:, :past + b]``, and the answer is the chunks' outputs, joined.

Each step's pages are taken (``cache.prepare(past, past + n)``, which also rolls a step back to its
``past``) just before its batch runs: a step that finds none fails alone with "busy" (its cache takes
no page: all or nothing), and the batch runs without it. A session with deep prompts runs
alone (``forward_steps`` batches only prompt-free steps of one adapter). ``max_batch`` 1 is one
step per forward, as before batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from shoal.errors import BadRequest, BusyError, Unavailable
from shoal.ids import rows_chunk_bounds
from shoal.models.kv import CachedStep, PagesExhausted
from shoal.server.pacing import Arrivals, BatchCosts, choose_groups
from shoal.server.step_queue import PendingStep, StepQueue
from shoal.wire.tensors import cat_serial

log = logging.getLogger(__name__)
#: a burst's steps come within this many lone steps' time of each other (a client handles its
#: sessions' replies one after another: about a millisecond each)
BURST_GAP = 0.1
#: steps the previous server pushed in one batch come within this many lone steps' time of each
#: other (a few milliseconds), whichever batches here they ran in; its next batch comes a batch
#: later: not waited for
STRAGGLER_WAIT = 0.5
#: what the batcher queues its drain task with (a concurrent future back); RuntimeError once shut down
Submit = Callable[[Callable[[], None]], Future]
AdapterContext = Callable[[str | None], contextlib.AbstractContextManager]
CONTENTION_SECONDS = 1.0  # peers that queued a step this recently compete for the compute thread
BUSY = "server is busy: its KV cache has no free page for this step; retry, or use another server"


class Batcher:
    """Session steps of one span, batched on the compute thread (see the module docstring)."""

    def __init__(
        self,
        span: Any,
        device: str,
        submit: Submit,
        adapter_context: AdapterContext,
        max_batch: int = 32,
        prefill_chunk: int = 128,
        contended_cost: float = 1.25,
        merge_wait: float = 1.5,
    ):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch and prefill_chunk must be at least 1, got {max_batch}, {prefill_chunk}")
        self.span, self.device = span, device
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.max_positions = prefill_chunk + max_batch  # a prefill chunk beside a decode step of every row
        self._submit, self._adapter_context = submit, adapter_context
        self._lock = threading.Lock()
        self._queue = StepQueue()
        self._scheduled = False  # a drain task is queued or running
        self.contended_cost, self.costs = contended_cost, BatchCosts()
        self.merge_wait, self.arrivals = merge_wait, Arrivals(gone=lambda cache: getattr(cache, "closed", False))
        self._arrived = threading.Condition(self._lock)  # a step was queued (a merge wait may end)
        self.merge_waits = 0  # batches started after waiting for sessions due back
        self.groups = 1  # the sessions run in this many batches a round (pacing.choose_groups)
        self.regroupings = 0  # times that changed
        self._depth: float | None = None  # the chains' depth (pacing.Arrivals.depth), smoothed
        self._last_seen: dict[str | None, float] = {}  # peer -> when its last step was queued
        self.batches = 0  # forwards run (a lone step is a batch of one)
        self.batched_steps = 0  # steps (and chunks) they carried
        self.batch_rows_max = 0
        self.batch_steps_max = 0
        self.prefill_chunks = 0

    @property
    def queued(self) -> int:
        """Steps waiting for a batch now (the server's record announces it: demand placement)."""
        with self._lock:
            return len(self._queue)

    @property
    def steps_deferred(self) -> int:
        return self._queue.deferred

    @property
    def deferred_by_peer(self) -> dict[str | None, int]:
        with self._lock:
            return dict(self._queue.deferred_by_peer)

    def counters(self) -> dict[str, int]:
        """As :class:`~shoal.wire.schema.ServerCounters` fields."""
        return {
            "batches": self.batches,
            "batched_steps": self.batched_steps,
            "batch_rows_max": self.batch_rows_max,
            "steps_deferred": self.steps_deferred,
            "prefill_chunks": self.prefill_chunks,
            "merge_waits": self.merge_waits,
            "batch_groups": self.groups,
            "regroupings": self.regroupings,
        }

    async def step(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Any,
        past_length: int,
        *,
        prompts: torch.Tensor | None = None,
        adapter: str | None = None,
        peer: str | None = None,
        pushed: bool = False,
    ) -> torch.Tensor:
        """One session step's output (``hidden``'s dtype, on the CPU), through the batches; a long
        one chunk by chunk (each chunk queued once the one before it is done). ``pushed``: the
        previous server of the session's chain handed it on (this server follows its grouping)."""
        chunks = rows_chunk_bounds(hidden.shape[0], hidden.shape[1], self.prefill_chunk)
        outputs = []
        for a, b in chunks:
            pending = PendingStep(
                hidden[:, a:b] if len(chunks) > 1 else hidden,
                position_ids[:, a:b] if len(chunks) > 1 else position_ids,
                None if mask is None else mask[:, : past_length + b],
                cache, past_length + a, prompts, adapter, peer, chunk=len(chunks) > 1, pushed=pushed,
            )  # fmt: skip
            outputs.append(await _settled(self._enqueue(pending)))
        return outputs[0] if len(outputs) == 1 else cat_serial(outputs, dim=1)  # no OpenMP on the event loop

    # ---- the drain task ---------------------------------------------------------------------------
    def _enqueue(self, pending: PendingStep) -> Future:
        with self._lock:
            self._queue.add(pending)
            now = self._last_seen[pending.peer] = time.monotonic()
            if not pending.chunk:
                self.arrivals.arrived(pending.cache, now, pending.rows, pending.hidden.shape[1], led=not pending.pushed)
            self._arrived.notify()
            if self._scheduled:
                return pending.future
            self._scheduled = True
        self._schedule()
        return pending.future

    def _schedule(self) -> None:
        """Queue the drain task (the caller set ``_scheduled``); fail what waits if the thread is gone."""
        try:
            task = self._submit(self._drain)
        except RuntimeError:  # shut down
            self._fail_waiting()
            return
        task.add_done_callback(lambda done: self._fail_waiting() if done.cancelled() else None)

    def _fail_waiting(self) -> None:
        with self._lock:
            waiting, self._scheduled = self._queue.drain(), False
        for pending in waiting:
            if pending.future.set_running_or_notify_cancel():
                pending.future.set_exception(Unavailable("server is shutting down: use another server"))

    def _drain(self) -> None:
        """Runs on the compute thread: one batch, then itself again if steps are left. A failure
        of the batcher itself (not of a step: those settle their own futures) fails the batch and
        every waiting step with it, and the batcher serves on: no step is left hanging."""
        batch: list[PendingStep] = []
        try:
            with self._lock:
                batch = self._next_batch()
            if batch:
                self._run(batch)
        except BaseException as exc:
            log.exception("continuous batching failed: failing its waiting steps")
            with self._lock:
                failed = batch + self._queue.drain()
            for pending in failed:
                if not pending.future.done() and (
                    pending.future.running() or pending.future.set_running_or_notify_cancel()
                ):
                    pending.future.set_exception(exc)
        finally:
            with self._lock:
                self._scheduled = again = len(self._queue) > 0
            if again:
                self._schedule()

    def _next_batch(self) -> list[PendingStep]:
        """Under the lock: the steps of the next batch (module docstring), set running."""
        rows, positions = self._group_rows(), self.max_positions
        if self._contended():  # keep batches short while peers compete (module docstring)
            rows = positions = min(rows, self.costs.limit(self.contended_cost, self.max_batch))
            return self._queue.take(rows, positions)
        head = self._queue.head()
        cohort = None if head is None else self.arrivals.cohort_of(head.cache)
        if head is not None and head.pushed:  # the previous server grouped these: only its stragglers
            rows = self.max_batch
            self._wait_for_due(rows, None, min(self.merge_wait, STRAGGLER_WAIT))
        else:
            fragments = self.arrivals.cohorts(time.monotonic()) > self.groups  # waiting for all merges them
            self._wait_for_due(rows, None if fragments else cohort, self.merge_wait)
        return self._queue.take(rows, positions, None if cohort is None else self._in_cohort(cohort))

    def _group_rows(self) -> int:
        """Under the lock: the rows a batch may take, the rows of the sessions this server leads
        split evenly over as many groups as their chains keep busy
        (:func:`~shoal.server.pacing.choose_groups`, a decode step's rows being its new positions),
        at most ``max_batch``."""
        now = time.monotonic()
        depth, rows = self.arrivals.depth(now), self.arrivals.rows(now)
        if depth is not None:  # smoothed, and kept: new sessions' chains are like the last ones' till measured
            self._depth = depth if self._depth is None else 0.7 * self._depth + 0.3 * depth
        if rows < 2 or self.max_batch == 1 or self._depth is None or self.costs.alone() is None:
            return self.max_batch  # nothing to split (the grouping stays for the sessions to come)
        groups = choose_groups(self._depth, rows, self.costs.predict, self.groups)
        self.regroupings += groups != self.groups
        self.groups = groups
        return self.max_batch if groups == 1 else max(1, min(self.max_batch, -(-rows // groups)))

    def _in_cohort(self, cohort: int) -> Callable[[PendingStep], bool]:
        return lambda step: self.arrivals.cohort_of(step.cache) == cohort

    def _wait_for_due(self, rows: int, cohort: int | None, lone_steps: float) -> None:
        """Under the lock: while the batch has fewer than ``rows`` rows and sessions (of ``cohort``,
        those that ran with the first step last time; None: any) are due back within ``lone_steps``
        lone steps' time, or steps keep coming in a burst (each within :data:`BURST_GAP` lone steps
        of the last), wait for them: they join this batch instead of starting one of their own. An
        idle server's lone session is neither due nor in a burst while its own step waits."""
        alone = self.costs.alone()
        if self.max_batch == 1 or not lone_steps or alone is None:
            return
        window, gap = lone_steps * alone, BURST_GAP * alone
        now = time.monotonic()
        deadline, waited = now + window, False
        while now < deadline and self._queue.rows_waiting() < rows:
            if self.arrivals.due(now, window, cohort):
                until = deadline
            elif self.arrivals.bursting(now, gap, cohort):
                until = min(deadline, self.arrivals.last_arrival + gap)
            else:
                break
            self._arrived.wait(max(0.0, until - now))
            now, waited = time.monotonic(), True
        self.merge_waits += waited

    def _contended(self) -> bool:
        """Whether steps of more than one peer came in the last :data:`CONTENTION_SECONDS` (under
        the lock). Not only those waiting now: a peer with one session has none queued while its
        step travels the rest of the chain, and a long batch started meanwhile would hold up its next."""
        now = time.monotonic()
        for peer, seen in list(self._last_seen.items()):
            if now - seen > CONTENTION_SECONDS:
                del self._last_seen[peer]
        return len(self._last_seen) > 1

    def _run(self, batch: list[PendingStep]) -> None:
        """Take each step's pages (one without fails alone: busy), run the rest as one forward, then
        settle every step's future, after :attr:`arrivals` heard the batch is done (a session can
        be back with its next step the moment its future settles)."""
        ready: list[PendingStep] = []
        settled: list[tuple[PendingStep, torch.Tensor | BaseException]] = []
        for pending in batch:
            try:
                pending.cache.prepare(pending.past_length, pending.end)
            except PagesExhausted:
                settled.append((pending, BusyError(BUSY)))
            except ValueError as exc:  # a closed cache
                settled.append((pending, BadRequest(str(exc))))
            except BaseException as exc:
                settled.append((pending, exc))
            else:
                ready.append(pending)
        if ready:
            self.batches += 1
            self.batched_steps += len(ready)
            self.batch_rows_max = max(self.batch_rows_max, sum(p.rows for p in ready))
            self.batch_steps_max = max(self.batch_steps_max, len(ready))
            self.prefill_chunks += sum(p.chunk for p in ready)
            started = time.perf_counter()
            settled += self._forward(ready, split_on_error=True)
            if ready[0].prompts is None:
                self.costs.record(sum(p.positions for p in ready), time.perf_counter() - started)
        now = time.monotonic()
        with self._lock:
            for pending in batch:
                if not pending.chunk:
                    self.arrivals.finished(pending.cache, now, self.batches)
        for pending, outcome in settled:
            if isinstance(outcome, BaseException):
                pending.future.set_exception(outcome)
            else:
                pending.future.set_result(outcome)

    def _forward(
        self, ready: list[PendingStep], split_on_error: bool
    ) -> list[tuple[PendingStep, torch.Tensor | BaseException]]:
        """Each step's output, or the error it fails with."""
        try:
            with self._adapter_context(ready[0].adapter), torch.inference_mode():
                outputs = self._outputs(ready)
        except (ValueError, PagesExhausted) as exc:  # the span's checks, or pages: find the step(s) concerned
            if split_on_error and len(ready) > 1:  # each alone rewrites only its own positions
                return [outcome for pending in ready for outcome in self._forward([pending], split_on_error=False)]
            error = BusyError(BUSY) if isinstance(exc, PagesExhausted) else BadRequest(str(exc))
            return [(pending, error) for pending in ready]
        except BaseException as exc:
            return [(pending, exc) for pending in ready]
        return list(zip(ready, outputs, strict=True))

    def _outputs(self, ready: list[PendingStep]) -> list[torch.Tensor]:
        """Each step's output, cast back to its input's dtype on the CPU."""
        device = self.device
        if ready[0].prompts is not None:  # alone (StepQueue.take)
            p = ready[0]
            outs = [self.span(p.hidden.to(device), p.position_ids.to(device), _on(p.mask, device), cache=p.cache,
                              past_length=p.past_length, prompts=p.prompts.to(device))]  # fmt: skip
        else:
            steps = [CachedStep(p.hidden.to(device), p.position_ids.to(device), _on(p.mask, device), p.cache,
                                p.past_length) for p in ready]  # fmt: skip
            outs = self.span.forward_steps(steps)
        return [out.to("cpu", p.hidden.dtype) for out, p in zip(outs, ready, strict=True)]


async def _settled(future: Future) -> torch.Tensor:
    """The step's output. Cancelled (its session torn down) while its batch runs, it still waits
    for the batch: the compute thread is writing the session's pages, which must not go back to the
    pool (and to another session) until it is done. A step still queued is simply dropped."""
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if not future.cancel():  # taken into a batch (or just done): wait it out, then end
            waiter = asyncio.wrap_future(future)
            while not waiter.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([waiter])
            if not waiter.cancelled():
                waiter.exception()  # retrieved: nobody wants this step's result any more
        raise


def _on(tensor: torch.Tensor | None, device: str) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


__all__ = ["Batcher"]
