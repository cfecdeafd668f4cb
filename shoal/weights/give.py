"""The giving side of the weights protocol (:data:`shoal.protocols.WEIGHTS`): a server that holds its
model's files answers ``manifest`` and ``chunk`` requests from them.

Giving must not cost the server's own sessions their decode latency, so every chunk is read as the
lowest class of work on the server's compute thread (``read``: e.g. the scheduler's
:attr:`~shoal.server.scheduler.Priority.GIVING` class, taken only when no step, forward or backward
waits), and all requests together are paced to ``rate`` bytes per second.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from shoal.checkpoints.manifest import Manifest, Stored, locate
from shoal.transport import MessageStream
from shoal.wire import InvalidMessage, Message, error_message

#: Queues a read of the chunk's bytes (a plain callable) as low-priority work; its future holds them.
Read = Callable[[Callable[[], bytes]], Future]
DEFAULT_RATE = 256 << 20  # bytes/s a server gives all its peers together


class Pace:
    """At most ``rate`` bytes per second on average, for every caller together (a reservation queue:
    each take waits for the ones before it)."""

    def __init__(self, rate: float):
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self._free_at = time.monotonic()

    async def take(self, size: int) -> None:
        now = time.monotonic()
        start = max(self._free_at, now)
        self._free_at = start + size / self.rate
        if start > now:
            await asyncio.sleep(start - now)


def _pread(stored: Stored, offset: int, size: int) -> bytearray:
    """``size`` bytes of ``stored``'s item from ``offset``, read straight into a buffer the reply sends."""
    data = bytearray(size)
    fd = os.open(stored.path, os.O_RDONLY)
    try:
        got = os.preadv(fd, [data], stored.offset + offset)
    finally:
        os.close(fd)
    if got != size:
        raise OSError(f"{stored.path}: short read")
    return data


class Giver:
    """Answers the weights protocol from the checkpoint at ``model_dir``, whose manifest is
    ``manifest`` (``data`` as it travels, ``digest`` its BLAKE3)."""

    def __init__(
        self, model_dir: str | Path, manifest: Manifest, data: bytes, digest: bytes, read: Read,
        rate: float = DEFAULT_RATE, idle_timeout: float = 30.0,
    ):  # fmt: skip
        self.manifest, self.data, self.digest = manifest, data, digest
        self.stored = locate(model_dir, manifest)
        self.read, self.pace, self.idle_timeout = read, Pace(rate), idle_timeout
        self.given = 0  # chunks sent
        self.given_bytes = 0

    def chunk(self, item: int, index: int) -> tuple[Stored, int, int] | None:
        """Where chunk ``index`` of item ``item`` lies here (its item's place, offset, size), or None."""
        if item >= len(self.stored) or (stored := self.stored[item]) is None:
            return None
        entry = self.manifest.items[item]
        if index >= len(entry.chunks):
            return None
        return stored, index * self.manifest.chunk_size, self.manifest.chunk_bytes(entry, index)

    async def handle(self, stream: MessageStream, peer_id: str) -> None:
        while True:
            try:
                request = await stream.recv(self.idle_timeout)
            except InvalidMessage as exc:  # well framed, bad metadata: answer, keep the stream
                await stream.send(error_message(exc.request_id, exc.code, exc.remote_message))
                continue
            await stream.send(await self._answer(request))

    async def _answer(self, request: Message) -> Message:
        meta = request.meta
        if request.kind == "manifest":
            if meta.model != self.manifest.model:
                return error_message(request.id, "not_found", f"this server gives {self.manifest.model}")
            return Message("result", request.id, tensors=[torch.frombuffer(bytearray(self.data), dtype=torch.uint8)])
        if request.kind != "chunk":
            return error_message(request.id, "bad_request", f"{request.kind!r} is not a weights request")
        if meta.manifest != self.digest.hex():
            return error_message(request.id, "not_found", "this server gives another manifest")
        where = self.chunk(meta.item, meta.chunk)
        if where is None:
            return error_message(request.id, "not_found", f"item {meta.item} chunk {meta.chunk} is not held here")
        data = await self.give(meta.item, meta.chunk)
        buffer = data if isinstance(data, bytearray) else bytearray(data)
        return Message("result", request.id, tensors=[torch.frombuffer(buffer, dtype=torch.uint8)])

    async def give(self, item: int, index: int) -> bytes | bytearray:
        """The bytes of chunk ``index`` of item ``item`` (held here: see :meth:`chunk`), at this giver's pace."""
        where = self.chunk(item, index)
        if where is None:
            raise KeyError((item, index))
        stored, offset, size = where
        await self.pace.take(size)
        data = await asyncio.wrap_future(self.read(lambda: _pread(stored, offset, size)))
        self.given += 1
        self.given_bytes += size
        return data


__all__ = ["DEFAULT_RATE", "Giver", "Pace", "Read"]
