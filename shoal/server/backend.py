"""Runs a span's blocks for the server: input checks, one compute thread, dtype conversions.

Compute runs on a single worker thread so the event loop keeps answering (info, new sessions,
other peers) while torch works, and so steps never interleave inside torch. The server also loads
its weights on that same thread (:func:`compute_thread`): libgomp keeps one thread pool per thread
that starts a parallel region, and a second pool (e.g. from loading on ``asyncio.to_thread``)
oversubscribes the CPUs and makes every later parallel region pay futex wake-ups (measured: about
2x slower decode steps on 2 cores).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from shoal.errors import BadRequest
from shoal.models import BlockSpan, SpanCache

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def compute_thread(num_threads: int | None = None) -> ThreadPoolExecutor:
    """The one thread that runs all of a server's torch work (loading, warm-up, steps)."""

    def init() -> None:
        if num_threads:
            torch.set_num_threads(num_threads)

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-compute", initializer=init)


class SpanBackend:
    def __init__(
        self, span: BlockSpan, hidden_size: int, device: str = "cpu", executor: ThreadPoolExecutor | None = None
    ):
        self.span = span
        self.hidden_size = hidden_size
        self.device = device
        self._executor = executor or compute_thread()

    def check_inputs(
        self,
        tensors: list[torch.Tensor],
        *,
        past_length: int = 0,
        batch_size: int | None = None,
        max_length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Validate ``[hidden, position_ids, attention_mask?]``; raise :class:`BadRequest` naming the problem."""
        if len(tensors) not in (2, 3):
            raise BadRequest(f"expected [hidden, position_ids, attention_mask?], got {len(tensors)} tensors")
        hidden, position_ids = tensors[0], tensors[1]
        mask = tensors[2] if len(tensors) == 3 else None
        if hidden.dtype not in FLOAT_DTYPES:
            raise BadRequest(f"hidden states must be float32, float16 or bfloat16, got {hidden.dtype}")
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise BadRequest(f"hidden states must be [batch, tokens, {self.hidden_size}], got {list(hidden.shape)}")
        batch, n = hidden.shape[:2]
        if batch == 0 or n == 0:
            raise BadRequest(f"empty hidden states {list(hidden.shape)}")
        if batch_size is not None and batch != batch_size:
            raise BadRequest(f"session was opened for batch {batch_size}, step has batch {batch}")
        if max_length is not None and past_length + n > max_length:
            raise BadRequest(f"step to position {past_length + n} is past the session's max_length {max_length}")
        if position_ids.dtype != torch.int64 or list(position_ids.shape) != [batch, n]:
            raise BadRequest(
                f"position_ids must be int64 [{batch}, {n}], got {position_ids.dtype} {list(position_ids.shape)}"
            )
        if mask is not None and (mask.dtype != torch.bool or list(mask.shape) != [batch, past_length + n]):
            raise BadRequest(
                f"attention_mask must be bool [{batch}, {past_length + n}], got {mask.dtype} {list(mask.shape)}"
            )
        return hidden, position_ids, mask

    def _compute(self, hidden, position_ids, mask, cache, past_length) -> torch.Tensor:
        with torch.inference_mode():
            out = self.span(
                hidden.to(self.device),
                position_ids.to(self.device),
                None if mask is None else mask.to(self.device),
                cache=cache,
                past_length=past_length,
            )
            return out.to("cpu", hidden.dtype)

    async def run(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: SpanCache | None = None,
        past_length: int = 0,
    ) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._executor, self._compute, hidden, position_ids, mask, cache, past_length
            )
        except ValueError as exc:  # the span's own consistency checks
            raise BadRequest(str(exc)) from None

    def warm_up(self, tokens: int = 8) -> None:
        """One prefill and one cached step before serving, so the first client does not pay for
        torch's lazy initialisation."""
        hidden = torch.zeros(1, tokens, self.hidden_size)
        cache = self.span.allocate_cache(1, tokens + 1)
        self._compute(hidden, torch.arange(tokens).unsqueeze(0), None, cache, 0)
        self._compute(hidden[:, :1], torch.tensor([[tokens]]), None, cache, tokens)

    async def allocate_cache(self, batch_size: int, max_length: int) -> SpanCache:
        """A session's cache, zero-filled on the compute thread. Filling a large tensor opens an
        OpenMP parallel region, and the first region a thread opens gives it a libgomp pool of its
        own: on the event loop thread that pool would outnumber the CPUs together with the
        compute thread's, and from then on every barrier sleeps (decode steps ~1.8x slower)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.span.allocate_cache, batch_size, max_length)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
