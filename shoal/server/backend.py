"""Runs a span's blocks for the server: input checks, one compute thread, dtype conversions, backward.

Compute runs on a single worker thread so the event loop keeps answering (info, new sessions,
other peers) while torch works, and so steps never interleave inside torch. The server also loads
its weights on that same thread (:func:`compute_thread`): libgomp keeps one thread pool per thread
that starts a parallel region, and a second pool (e.g. from loading on ``asyncio.to_thread``)
oversubscribes the CPUs and makes every later parallel region pay futex wake-ups (measured: about
2x slower decode steps on 2 cores).

That thread is a priority executor (:mod:`shoal.server.scheduler`): session steps first, then
stateless forwards, then training, each class shared round-robin by peer. Session steps go through
the span's batcher (:mod:`shoal.server.batching`): the steps waiting together run as one batched
forward, long prefills in chunks. A backward recomputes the span's forward with autograd (the
parameters stay frozen) and returns the gradient of its inputs, block by block and a few rows at a
time (each a task of its own, through :meth:`BlockSpan.sub_span <shoal.models.BlockSpan.sub_span>`),
so session steps run between the pieces of a long backward instead of waiting for all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import torch

from shoal.errors import BadRequest, Unavailable
from shoal.ids import rows_chunk_bounds
from shoal.models import BlockSpan, SpanCache
from shoal.models.kv import DEFAULT_PAGE_SIZE, CachedStep, PagedCache
from shoal.server.batching import Batcher
from shoal.server.inputs import SpanInputs
from shoal.server.scheduler import ComputeScheduler, Priority, SchedulerCounts


def compute_thread(num_threads: int | None = None) -> ComputeScheduler:
    """The one thread that runs all of a server's torch work (loading, warm-up, steps, training)."""
    return ComputeScheduler(num_threads, name="shoal-compute")


#: positions (rows x tokens) one training task computes through one block at most: measured on SmolLM2
#: here (one thread), a block's forward and backward of 96 positions take 12 and 21 ms, about one
#: decode step through a 15-block span (26 ms), so a decode step waits for about that much training
TRAINING_CHUNK_POSITIONS = 128
#: positions (rows x tokens) one task of a judge's recompute runs through one block at most (a
#: prefill chunk through a KV cache: its attention is chunk x P, never P x P)
RECOMPUTE_CHUNK_POSITIONS = 256


def row_groups(batch: int, tokens: int, budget: int = TRAINING_CHUNK_POSITIONS) -> list[slice]:
    """The batch's rows in groups of at most ``budget`` positions (at least one row each: a row's
    tokens attend to each other, so a row is never split)."""
    return [slice(a, b) for a, b in rows_chunk_bounds(tokens, batch, budget)]  # the batch's rows, as a step's tokens


def _on(tensor: torch.Tensor | None, device: str) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


class SpanBackend(SpanInputs):
    """``adapters``: the span's LoRA adapters (:class:`shoal.models.lora.SpanAdapters`), None without.
    ``max_batch``, ``prefill_chunk``: the batcher's limits (:class:`~shoal.server.batching.Batcher`)."""

    def __init__(
        self,
        span: BlockSpan,
        hidden_size: int,
        device: str = "cpu",
        executor: Executor | None = None,
        adapters: Any = None,
        *,
        max_batch: int = 32,
        prefill_chunk: int = 128,
        contended_cost: float = 1.25,
        merge_wait: float = 1.5,
    ):
        self.span = span
        self.hidden_size = hidden_size
        self.device = device
        self.adapters = adapters
        self.adapter_names = frozenset(a.name for a in adapters.infos()) if adapters is not None else frozenset()
        self._executor = executor or compute_thread()
        self._counted_from = self.compute_counts()  # the executor may be shared with an earlier span
        self.batcher = Batcher(span, device, lambda drain: self._queue(Priority.INFERENCE, drain), self._adapter,
                               max_batch, prefill_chunk, contended_cost, merge_wait)  # fmt: skip

    @property
    def num_blocks(self) -> int:
        return self.span.end - self.span.start

    # ---- checks (on the event loop, before anything is queued): SpanInputs's, and the adapter's ----
    def check_adapter(self, name: str | None) -> None:
        """Refuse an adapter this server does not have, naming it and the ones it has."""
        if name is None or name in self.adapter_names:
            return
        from shoal.models.lora import UnknownAdapter

        raise UnknownAdapter(name, sorted(self.adapter_names))

    # ---- compute ---------------------------------------------------------------------------------
    def _adapter(self, name: str | None):
        return contextlib.nullcontext() if self.adapters is None else self.adapters.active(name)

    def _queue(self, priority: Priority, fn: Callable[..., Any], *args: Any, peer: str | None = None):
        """``fn(*args)`` queued in ``priority`` for ``peer``: a concurrent future (RuntimeError once shut down)."""
        submit_as = getattr(self._executor, "submit_as", None)  # any executor serves; only ours has classes
        return submit_as(priority, fn, *args, peer=peer) if submit_as is not None else self._executor.submit(fn, *args)

    def _submit(
        self, priority: Priority, fn: Callable[..., Any], *args: Any, peer: str | None = None
    ) -> asyncio.Future:
        try:
            future = self._queue(priority, fn, *args, peer=peer)
        except RuntimeError:  # shut down (e.g. between the chunks of a backward): the server is going
            raise Unavailable("server is shutting down: use another server") from None
        return asyncio.wrap_future(future)

    def _compute(self, hidden, position_ids, mask, prompts=None, adapter=None) -> torch.Tensor:
        """A stateless forward (session steps go through :attr:`batcher`)."""
        with self._adapter(adapter), torch.inference_mode():
            out = self.span(hidden.to(self.device), position_ids.to(self.device), _on(mask, self.device),
                            prompts=_on(prompts, self.device))  # fmt: skip
            return out.to("cpu", hidden.dtype)

    async def run(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: SpanCache | None = None,
        past_length: int = 0,
        *,
        prompts: torch.Tensor | None = None,
        adapter: str | None = None,
        peer: str | None = None,
        pushed: bool = False,
    ) -> torch.Tensor:
        """A session step (with ``cache``: batched, inference class) or a stateless forward (forward
        class); ``peer`` asked for it (each class, and each batch, is shared fairly by peer);
        ``pushed``: the previous server of the session's chain handed the step on."""
        try:
            if cache is not None:
                return await self.batcher.step(hidden, position_ids, mask, cache, past_length, prompts=prompts,
                                               adapter=adapter, peer=peer, pushed=pushed)  # fmt: skip
            if prompts is None and hidden.shape[0] * hidden.shape[1] > RECOMPUTE_CHUNK_POSITIONS:
                return await self._in_chunks(Priority.FORWARD, hidden, position_ids, mask, 0, self.num_blocks, adapter,
                                             peer)  # fmt: skip
            return await self._submit(Priority.FORWARD, self._compute, hidden, position_ids, mask, prompts, adapter,
                                      peer=peer)  # fmt: skip
        except ValueError as exc:  # the span's own consistency checks
            raise BadRequest(str(exc)) from None

    async def run_blocks(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        start: int,
        end: int,
        *,
        adapter: str | None = None,
        peer: str | None = None,
    ) -> torch.Tensor:
        """Blocks ``[start, end)`` (model indices, within the span) of a stateless forward, forward
        class, in chunks: a client auditing a hop through pieces of other servers' spans asks for it."""
        first, last = self._sub_span(start, end)
        try:
            return await self._in_chunks(Priority.FORWARD, hidden, position_ids, mask, first, last, adapter, peer)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    async def recompute(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        start: int,
        end: int,
        *,
        adapter: str | None = None,
    ) -> torch.Tensor:
        """Blocks ``[start, end)`` (within the span) of a stateless pass over ``[0, P)``, at the lowest
        priority, in ``hidden``'s dtype, in chunks (:meth:`_in_chunks`). Judging another server's
        evidence (:mod:`shoal.server.judge`) must never hold up this server's own sessions for long."""
        first, last = self._sub_span(start, end)
        return await self._in_chunks(Priority.TRAINING, hidden, position_ids, mask, first, last, adapter)

    def _sub_span(self, start: int, end: int) -> tuple[int, int]:
        """Blocks ``[start, end)`` (model indices) as ``[first, last)`` within the span; BadRequest
        when they are not within it."""
        if not self.span.start <= start < end <= self.span.end:
            raise BadRequest(f"blocks {start}:{end} are not within this span {self.span.start}:{self.span.end}")
        return start - self.span.start, end - self.span.start

    async def _in_chunks(
        self,
        priority: Priority,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        first: int,
        last: int,
        adapter: str | None,
        peer: str | None = None,
    ) -> torch.Tensor:
        """The span's blocks ``[first, last)`` (indices within the span) of a stateless pass over
        ``[0, P)``: each block runs as a prefill in chunks of positions
        (:data:`RECOMPUTE_CHUNK_POSITIONS` rows x tokens) through a KV cache of its own, each chunk a
        task at ``priority``, so a task's work and attention memory stay ~ linear in P (a pass in one
        piece holds P x P attention scores). Between blocks the hidden states stay on the device in
        the span's dtype (as a step's do); they are cast once at the end."""
        blocks = [self.span.sub_span(i, i + 1) for i in range(first, last)]
        batch, total = hidden.shape[:2]
        chunks = rows_chunk_bounds(batch, total, RECOMPUTE_CHUNK_POSITIONS)
        device = self.device

        def through(block: BlockSpan, held: dict, x: torch.Tensor, a: int, b: int, last: bool) -> torch.Tensor | None:
            """Positions ``[a, b)`` of ``x`` (the block's whole input) through ``block``; the block's
            whole output (in the last block's case, cast back) once its last chunk ran."""
            with self._adapter(adapter), torch.inference_mode():
                if "cache" not in held:
                    held["cache"], held["out"] = block.allocate_cache(batch, total), []
                seen = None if mask is None else mask[:, :b].to(device)  # the mask covers the cache too
                part = block(x[:, a:b].to(device), position_ids[:, a:b].to(device), seen, cache=held["cache"],
                             past_length=a)  # fmt: skip
                held["out"].append(part)
                if b < total:
                    return None
                out = held["out"][0] if len(held["out"]) == 1 else torch.cat(held["out"], dim=1)
                held.clear()  # the cache goes with the block
                return out.to("cpu", hidden.dtype) if last else out

        out = hidden
        try:
            for index, block in enumerate(blocks):
                held: dict = {}  # the block's cache and output chunks, between its tasks
                last = index == len(blocks) - 1
                for a, b in chunks:
                    done = await self._submit(priority, through, block, held, out, a, b, last, peer=peer)
                out = done
        except ValueError as exc:  # the span's own consistency checks
            raise BadRequest(str(exc)) from None
        return out

    async def in_background(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the compute thread at the lowest priority: tensor work off the event loop
        (see :meth:`allocate_cache` for why not on it) that must not delay sessions (judging evidence)."""
        return await self._submit(Priority.TRAINING, fn, *args)

    async def backward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        grad_output: torch.Tensor,
        *,
        prompts: torch.Tensor | None = None,
        adapter: str | None = None,
    ) -> list[torch.Tensor]:
        """``[grad_hidden, grad_prompts?]`` of the stateless pass ``span(hidden, ...)`` whose output's
        gradient is ``grad_output``, in the dtypes of ``hidden`` and ``prompts``; training class.

        A no-grad pass keeps each block's input (under ``no_grad``, not ``inference_mode``: they are
        reused with autograd), then each block, the last first, is recomputed with autograd and
        differentiated. Every block of either pass is one task per group of rows of at most
        :data:`TRAINING_CHUNK_POSITIONS` positions (a row is never split): a session step waits for
        about one decode step's worth of a backward at most. Memory: every block's input for one
        group of rows plus one block's activations."""
        self._check_frozen()
        try:
            return await self._backward_blocks(hidden, position_ids, mask, grad_output, prompts, adapter)
        except ValueError as exc:  # the span's own consistency checks
            raise BadRequest(str(exc)) from None

    def _check_frozen(self) -> None:
        """The span's weights are never trained: a parameter that wants a gradient is a bug here."""
        trainable = [name for name, p in self.span.named_parameters() if p.requires_grad]
        if trainable:
            raise RuntimeError(f"span parameters must stay frozen, but {trainable[:4]} require grad")

    async def _backward_blocks(self, hidden, position_ids, mask, grad_output, prompts, adapter) -> list[torch.Tensor]:
        """The two passes, one task per block and group of rows (:func:`row_groups`). All tensor work
        runs in those tasks, none on the event loop (see :meth:`allocate_cache` for why); moving to
        the device is a no-op after the first."""
        device, blocks = self.device, [self.span.sub_span(i, i + 1) for i in range(self.num_blocks)]
        shared_prompts = prompts is not None and prompts.shape[1] == 1  # one prompt for every row

        def run(i: int, rows: slice, x: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
            return blocks[i](x.to(device), position_ids[rows].to(device), _on(mask[rows] if mask is not None else None,
                             device), prompts=prompt)  # fmt: skip

        def prompt_of(i: int, rows: slice) -> torch.Tensor | None:
            if prompts is None:
                return None
            return prompts[i : i + 1].to(device) if shared_prompts else prompts[i : i + 1, rows].to(device)

        def forward_block(i: int, rows: slice, x: torch.Tensor) -> torch.Tensor:
            with self._adapter(adapter), torch.no_grad():
                return run(i, rows, x, prompt_of(i, rows))

        def backward_block(i: int, rows: slice, x: torch.Tensor, grad: torch.Tensor):
            """``(grad of block i's input, grad of its prompt or None)`` for ``rows``, given the
            gradient of the block's output there."""
            prompt = prompt_of(i, rows)
            with self._adapter(adapter), torch.enable_grad():
                leaves = [x.to(device).detach().requires_grad_()]
                if prompt is not None:
                    leaves.append(prompt.detach().requires_grad_())
                out = run(i, rows, leaves[0], leaves[1] if prompt is not None else None)
                grads = torch.autograd.grad(out, leaves, grad.to(out.device, out.dtype), allow_unused=True)
            grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True)]
            return grads[0], grads[1] if prompt is not None else None

        def joined(grads: list[torch.Tensor], prompt_parts: list[list[torch.Tensor | None]]) -> list[torch.Tensor]:
            """The answer (on the CPU, in the inputs' dtypes): the input's gradient and, per block, its
            prompt's (summed over row groups where every row shares the prompt)."""
            answer = [torch.cat(grads).to("cpu", hidden.dtype)]
            if prompts is not None:
                per_block = [sum(parts[1:], parts[0]) if shared_prompts else torch.cat(parts, dim=1)
                             for parts in prompt_parts]  # fmt: skip
                answer.append(torch.cat(per_block).to("cpu", prompts.dtype))
            return answer

        groups = row_groups(hidden.shape[0], hidden.shape[1])
        results = []
        for rows in groups:  # each group of rows through both passes: only its inputs are held
            inputs = [hidden[rows]]  # block i's input; the last block's output is not needed
            for i in range(self.num_blocks - 1):
                inputs.append(await self._submit(Priority.TRAINING, forward_block, i, rows, inputs[i]))
            grad, prompt_grads = grad_output[rows], []
            for i in reversed(range(self.num_blocks)):
                grad, prompt_grad = await self._submit(Priority.TRAINING, backward_block, i, rows, inputs[i], grad)
                prompt_grads.insert(0, prompt_grad)
                inputs[i] = None  # freed as the backward goes
            results.append((grad, prompt_grads))
        prompt_parts = [[r[1][i] for r in results] for i in range(self.num_blocks)]
        return await self._submit(Priority.TRAINING, joined, [r[0] for r in results], prompt_parts)

    def warm_up(self, tokens: int = 8) -> None:
        """Two prefills, then a batch of their decode steps, before serving (on the compute thread),
        so the first client does not pay for torch's lazy initialisation."""
        hidden, device = torch.zeros(1, tokens + 1, self.hidden_size, device=self.device), self.device
        pool = self.span.allocate_pool(2 * -(-(tokens + 1) // DEFAULT_PAGE_SIZE), DEFAULT_PAGE_SIZE)
        caches = [PagedCache(pool, 1, tokens + 1) for _ in range(2)]  # one pool: one batch reads one pool
        with torch.inference_mode():
            for past, n, batch in ((0, tokens, caches[:1]), (0, tokens, caches[1:]), (tokens, 1, caches)):
                positions = torch.arange(past, past + n, device=device).unsqueeze(0)
                self.span.forward_steps([CachedStep(hidden[:, :n], positions, None, c, past) for c in batch])

    async def allocate_cache(self, batch_size: int, max_length: int) -> SpanCache:
        """A session's cache, zero-filled on the compute thread. Filling a large tensor opens an
        OpenMP parallel region, and the first region a thread opens gives it a libgomp pool of its
        own: on the event loop thread that pool would outnumber the CPUs together with the
        compute thread's, and from then on every barrier sleeps (decode steps ~1.8x slower)."""
        return await self._submit(Priority.INFERENCE, self.span.allocate_cache, batch_size, max_length)

    async def cache_work(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the compute thread with the session steps (a migration reads or writes a
        session's pages: between steps, never during one)."""
        return await self._submit(Priority.INFERENCE, fn, *args)

    async def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` moved to the span's device once (a session's deep prompts), on the compute thread."""
        return await self._submit(Priority.INFERENCE, tensor.to, self.device)

    def compute_counts(self) -> SchedulerCounts | None:
        """The compute thread's counts since this span was loaded (None for an executor without them)."""
        counts = getattr(self._executor, "counts", None)
        if counts is None:
            return None
        now = counts()
        earlier = getattr(self, "_counted_from", None)
        return now if earlier is None else now.minus(earlier)

    def compute_counters(self) -> dict[str, int]:
        """:meth:`compute_counts` and the batcher's counts as :class:`~shoal.wire.schema.ServerCounters` fields."""
        counts = self.compute_counts()
        if counts is None:
            return self.batcher.counters()
        ran, jumped = counts.ran, counts.jumped
        inference, forward, training = Priority.INFERENCE, Priority.FORWARD, Priority.TRAINING
        return {
            **self.batcher.counters(),
            "inference_tasks": ran[inference],
            "forward_tasks": ran[forward],
            "training_chunks": ran[training],
            "inference_ahead_of_forward": jumped[inference, forward],
            "inference_ahead_of_training": jumped[inference, training],
            "forward_ahead_of_training": jumped[forward, training],
        }

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
