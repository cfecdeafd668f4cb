"""Pipelined prefill: a step of many new positions travels the chain in chunks.

A one-message step keeps each server busy in turn: while the first server computes a long prompt,
the others wait, and the first waits while they compute. Cut into chunks of ``prefill_chunk``
positions (:func:`chunk_bounds`), the step overlaps: chunk ``j + 1`` goes to the first server
without waiting for chunk ``j``'s replies, so the second server computes chunk ``j`` while the
first computes chunk ``j + 1``. Servers need nothing new for it: a server serves a session's steps
in the order they arrive, and pushes each step's output on (:mod:`shoal.server.push`). Within a push
segment the servers hand each chunk on; at a segment's end the client relays each chunk to the next
segment as soon as the previous hop answered it, while that hop already computes the next chunk.

Each chunk is a step of its own for everything that keeps state: its own step id, position and
receipt (checked per hop in chunk order, so each hop's state chain advances exactly as for
sequential steps), and its own entry in the session's history (the session records it): replay,
failover and audits see what they would see had the client sent the chunks one after another. Only
the waiting overlaps.

A failure stops the pipeline (:func:`run_pipelined`): a hop that fails or whose receipt does not
check, or a push that does not get through. The chunks every hop answered stand; the session
recovers the failed hop as for any step and finishes the step sequentially from there (the servers
that got later chunks roll them back: a step may start at any position a session holds).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from torch import Tensor

from shoal.client.remote.driver import ChainDriver, HopFailed, PushLost
from shoal.client.remote.history import step_inputs
from shoal.ids import chunk_bounds
from shoal.wire.schema import Receipt
from shoal.wire.tensors import serial_copy

#: positions per chunk of a pipelined step unless the client says otherwise (``prefill_chunk``)
DEFAULT_PREFILL_CHUNK = 128


def positions(tensor: Tensor, start: int, end: int) -> Tensor:
    """``tensor[:, start:end]``, contiguous. A copy only when the slice is not (batch > 1), made by
    numpy: this runs on the client's event loop, where a parallel torch copy would give the thread an
    OpenMP pool of its own (see :func:`shoal.wire.tensors.serial_copy`)."""
    part = tensor[:, start:end]
    return part if part.is_contiguous() else serial_copy(part)


@dataclass
class Chunk:
    """Positions ``[start, end)`` of a step, a step of its own at session position ``position``."""

    start: int
    end: int
    position: int
    position_ids: Tensor  # [B, n]
    mask: Tensor | None  # [B, position + n]: the step's mask up to the chunk's end
    inputs: dict[int, Tensor]  # block -> the chunk's hidden states entering it (block num_blocks: the output)
    receipts: dict[int, Receipt] = field(default_factory=dict)  # first block of a hop -> its checked receipt

    @property
    def n(self) -> int:
        return self.end - self.start

    @classmethod
    def cut(
        cls, hidden: Tensor, position_ids: Tensor, mask: Tensor | None, position: int, start: int, end: int
    ) -> Chunk:
        """Chunk ``[start, end)`` of a step at session position ``position``."""
        chunk_mask = None if mask is None else positions(mask, 0, position + end)
        return cls(start, end, position + start, positions(position_ids, start, end), chunk_mask,
                   {0: positions(hidden, start, end)})  # fmt: skip


async def run_pipelined(driver: ChainDriver, chunks: list[Chunk]) -> tuple[int, HopFailed | None]:
    """Run ``chunks`` (in order, the first at hop 0's block 0) through every hop of ``driver``'s chain,
    each chunk sent on as soon as its input is there. Fills each chunk's ``inputs`` (every hop's
    output, at its end block) and ``receipts``. Returns how many chunks (a prefix) every hop answered,
    and the failure that stopped the rest: the :class:`HopFailed` of the earliest hop that failed,
    None when all went through or only a push was lost (the rest then goes without pipelining)."""
    loop = asyncio.get_running_loop()
    hops = driver.hops
    answered = [[loop.create_future() for _ in chunks] for _ in hops]  # hop k's output of chunk j is there
    segments = driver.segments()
    step_ids = {first: [loop.create_future() for _ in chunks] for first, _ in segments}
    stopped = False

    async def feed(first: int) -> None:
        """Send every chunk to segment ``first``'s first hop once the hop before answered it."""
        for j, chunk in enumerate(chunks):
            if first > 0:
                await answered[first - 1][j]
            if stopped:
                return
            step_id = driver.next_id()
            await driver.send_step(first, step_id, chunk.inputs, chunk.position_ids, chunk.mask, chunk.position)
            step_ids[first][j].set_result(step_id)

    async def collect(k: int, first: int, last: int) -> None:
        """Hop ``k``'s replies, in chunk order (each checked as a step of its own)."""
        span = hops[k].span
        for j, chunk in enumerate(chunks):
            step_id = await step_ids[first][j]
            if k > first:  # pushed: what it got is the previous hop's reply
                await answered[k - 1][j]
            sent = step_inputs(chunk.inputs[span.start], chunk.position_ids, chunk.mask)
            output, reply, receipt = await driver.accept(k, step_id, chunk.n, chunk.position, sent, pushed=k > first)
            if receipt is not None:
                chunk.receipts[span.start] = receipt
            chunk.inputs[span.end] = output
            answered[k][j].set_result(None)
            if k < last and reply.pushed is False:
                raise PushLost()

    # sends are never cancelled (a send cut short breaks the stream): a sender stops at its next chunk
    senders = [loop.create_task(feed(first)) for first, _ in segments]
    receivers = [loop.create_task(collect(k, first, last)) for first, last in segments for k in range(first, last + 1)]
    try:
        pending: set[asyncio.Task] = {*senders, *receivers}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            if any(not task.cancelled() and task.exception() is not None for task in done):
                break
    finally:
        stopped = True
        for task in receivers:  # a receive cut short is harmless: the hop keeps its pending read
            task.cancel()
        for futures in (*answered, *step_ids.values()):
            for future in futures:
                future.cancel()  # wakes a sender waiting for an input (no-op on those done)
        results = await asyncio.gather(*senders, *receivers, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    unexpected = [e for e in errors if not isinstance(e, HopFailed | PushLost)]
    if unexpected:
        raise unexpected[0]
    failures = sorted((e for e in errors if isinstance(e, HopFailed)), key=lambda failure: failure.index)
    complete = min(sum(1 for f in futures if f.done() and not f.cancelled()) for futures in answered)
    return complete, failures[0] if failures else None


__all__ = ["DEFAULT_PREFILL_CHUNK", "Chunk", "chunk_bounds", "positions", "run_pipelined"]
