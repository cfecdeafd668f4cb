"""The giving side of the weights protocol (:data:`shoal.protocols.WEIGHTS`): a server that holds its
model's files answers ``manifest`` and ``chunk`` requests from them.

Giving must not cost the server's own sessions their decode latency, yet must not wait for decoding
either: chunks are read on a thread of their own (:class:`ChunkReader`, at a lower OS priority;
``pread`` releases the GIL), never on the compute thread, into a few reused buffers (no fresh pages
to fault in per chunk) that the reply's send copies straight into the transport. Decoding still comes
first: before each chunk the giver waits, up to :data:`MAX_YIELD_S`, while ``busy()`` says the
compute thread runs or queues a step (e.g. :meth:`ComputeScheduler.busy
<shoal.server.scheduler.ComputeScheduler.busy>`), and all requests together are paced to ``rate``
bytes per second.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from shoal.checkpoints.manifest import Manifest, Stored, locate
from shoal.transport import MessageStream
from shoal.wire import InvalidMessage, Message, error_message

DEFAULT_RATE = 256 << 20  # bytes/s a server gives all its peers together
YIELD_S = 0.002  # how often a chunk waiting for the compute thread to be idle looks again
MAX_YIELD_S = 0.5  # a chunk waits at most this long for a gap (a server busy all the time still gives, slowly)
POOL_BUFFERS = 16  # chunk buffers kept for reuse (about the requests in flight from every peer)
READ_NICE = 10  # added to the reading thread's OS niceness (Linux: per thread), so it yields the CPU to decoding


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


def _lower_priority() -> None:
    """Run this thread at a lower OS priority (Linux only: there ``setpriority`` on a thread id
    affects that thread alone); best effort."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + READ_NICE)
        except OSError:
            pass


class ChunkReader:
    """Reads chunks of ``chunk_size`` bytes at most on one thread of its own, into reused buffers:
    :meth:`read` returns a view that stays valid until it is handed back with :meth:`release`."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shoal-give", initializer=_lower_priority)
        self._free: list[bytearray] = []  # touched on the event loop only

    @staticmethod
    def _read(stored: Stored, offset: int, size: int, buffer: bytearray) -> memoryview:
        view = memoryview(buffer)[:size]
        fd = os.open(stored.path, os.O_RDONLY)  # per read: nothing to close when the giver goes
        try:
            got = os.preadv(fd, [view], stored.offset + offset)
        finally:
            os.close(fd)
        if got != size:
            raise OSError(f"{stored.path}: short read")
        return view

    async def read(self, stored: Stored, offset: int, size: int) -> memoryview:
        """``size`` bytes of ``stored``'s item from ``offset``."""
        buffer = self._free.pop() if self._free and size <= self.chunk_size else bytearray(max(size, self.chunk_size))
        try:
            return await asyncio.wrap_future(self._thread.submit(self._read, stored, offset, size, buffer))
        except BaseException:
            self._free.append(buffer)
            raise

    def release(self, view: memoryview) -> None:
        """``view`` (from :meth:`read`) and what was made of it are no longer used (the reply was
        sent: the transport copied it): its buffer serves a later read."""
        buffer = view.obj
        if isinstance(buffer, bytearray) and len(buffer) == self.chunk_size and len(self._free) < POOL_BUFFERS:
            self._free.append(buffer)


class Giver:
    """Answers the weights protocol from the checkpoint at ``model_dir``, whose manifest is
    ``manifest`` (``data`` as it travels, ``digest`` its BLAKE3): the manifest, which of its items
    are held here (all of them, or a fetched span's), and their chunks."""

    def __init__(
        self, model_dir: str | Path, manifest: Manifest, data: bytes, digest: bytes,
        rate: float = DEFAULT_RATE, idle_timeout: float = 30.0, busy: Callable[[], bool] | None = None,
    ):  # fmt: skip
        self.manifest, self.data, self.digest = manifest, data, digest
        self.stored = locate(model_dir, manifest)
        self.reader = ChunkReader(manifest.chunk_size)
        self.pace, self.idle_timeout, self.busy = Pace(rate), idle_timeout, busy
        self.yielded_s = 0.0  # time chunks waited for the compute thread to be idle
        self.given = 0  # chunks sent
        self.lacked = 0  # chunks asked for that are not held here
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
            reply, given = await self._answer(request)
            try:
                await stream.send(reply)
            finally:
                del reply
                if given is not None:
                    self.reader.release(given)

    async def _answer(self, request: Message) -> tuple[Message, memoryview | None]:
        """The reply, and the reader's buffer it sends, if any (to hand back once sent)."""
        meta = request.meta
        if request.kind == "manifest":
            if meta.model != self.manifest.model:
                return error_message(request.id, "not_found", f"this server gives {self.manifest.model}"), None
            tensor = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            return Message("result", request.id, tensors=[tensor]), None
        if request.kind not in ("chunk", "held"):
            return error_message(request.id, "bad_request", f"{request.kind!r} is not a weights request"), None
        if meta.manifest != self.digest.hex():
            return error_message(request.id, "not_found", "this server gives another manifest"), None
        if request.kind == "held":
            held = torch.tensor([stored is not None for stored in self.stored], dtype=torch.uint8)
            return Message("result", request.id, tensors=[held]), None
        where = self.chunk(meta.item, meta.chunk)
        if where is None:
            self.lacked += 1
            return error_message(request.id, "not_found", f"item {meta.item} chunk {meta.chunk} is not held here"), None
        data = await self.give(meta.item, meta.chunk)
        lent = data if isinstance(data, memoryview) and not data.readonly else None  # a reader's buffer: no copy
        tensor = torch.frombuffer(data if lent is not None else bytearray(data), dtype=torch.uint8)
        return Message("result", request.id, tensors=[tensor]), lent

    async def give(self, item: int, index: int) -> memoryview | bytes:
        """The bytes of chunk ``index`` of item ``item`` (held here: see :meth:`chunk`), at this
        giver's pace, once the compute thread has a gap (see the module docstring)."""
        where = self.chunk(item, index)
        if where is None:
            raise KeyError((item, index))
        stored, offset, size = where
        await self.pace.take(size)
        if self.busy is not None and self.busy():
            waited = time.monotonic()
            deadline = waited + MAX_YIELD_S
            while self.busy() and time.monotonic() < deadline:
                await asyncio.sleep(YIELD_S)
            self.yielded_s += time.monotonic() - waited
        data = await self.reader.read(stored, offset, size)
        self.given += 1
        self.given_bytes += size
        return data


__all__ = ["DEFAULT_RATE", "ChunkReader", "Giver", "Pace"]
