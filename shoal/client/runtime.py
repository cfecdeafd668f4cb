"""One background event loop per process for the synchronous client API (transformers' generate
is synchronous; the transport is asyncio), and the clean end of everything that runs on it.

iroh's Python binding drives Rust futures from coroutines. A coroutine still suspended in one when
the interpreter tears down is closed by the garbage collector after the binding's runtime is gone,
which crashes the process (status 139, or 132). So nothing may be left suspended: every client
resource (a model's node, its background refresh, its witness) is :meth:`LoopThread.track`-ed, and
:meth:`LoopThread.shutdown` (at interpreter exit, before the binding goes) closes what is still open,
then cancels and awaits every task left on the loop, and only then stops it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shoal.transport.loop import new_event_loop

T = TypeVar("T")
log = logging.getLogger(__name__)

#: Seconds :meth:`LoopThread.shutdown` gives open resources to close, and then the loop's tasks to end.
SHUTDOWN_TIMEOUT = 10.0

Close = Callable[[], Awaitable[None]]


class LoopThread:
    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="shoal-client-loop", daemon=True)
        self._thread.start()
        self._open: dict[int, Close] = {}  # resources not closed yet, by token
        self._next = 0
        self._lock = threading.Lock()
        self.stopped = False  # by shutdown(): nothing runs here any more

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it from this (non-loop) thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop")
        if self.stopped:
            if asyncio.iscoroutine(coro):
                coro.close()  # never to run: no "never awaited" warning
            raise RuntimeError("the client's event loop has stopped (the interpreter is exiting)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    # ---- resources and the end ---------------------------------------------------------------
    def track(self, close: Close) -> int:
        """Remember ``close`` (an idempotent coroutine function) until :meth:`untrack`; a token."""
        with self._lock:
            self._next += 1
            self._open[self._next] = close
            return self._next

    def untrack(self, token: int) -> Close | None:
        """Forget a resource (its owner closes it now); its ``close``, None if it was closed already."""
        with self._lock:
            return self._open.pop(token, None)

    def close_soon(self, token: int) -> None:
        """Close a tracked resource without waiting (from a finaliser, on any thread)."""
        with self._lock:
            close = self._open.pop(token, None)
        if close is None or self.stopped or self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile: shutdown closes it
            asyncio.run_coroutine_threadsafe(_quietly(close), self.loop)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Close every tracked resource, end every task on the loop, then stop it (idempotent)."""
        with self._lock:
            closes, self._open = list(self._open.values()), {}
        if self.stopped or not self.loop.is_running() or threading.current_thread() is self._thread:
            return
        with contextlib.suppress(Exception):
            self.run(self._drain(closes, timeout), timeout=2 * timeout + 5)
        self.stopped = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    async def _drain(self, closes: list[Close], timeout: float) -> None:
        if closes:
            await asyncio.wait([asyncio.ensure_future(_quietly(close)) for close in closes], timeout=timeout)
        me = asyncio.current_task()
        for _ in range(3):  # a cancelled task may start another one as it ends
            tasks = [task for task in asyncio.all_tasks() if task is not me and not task.done()]
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=timeout)
        await self.loop.shutdown_asyncgens()


async def _quietly(close: Close) -> None:
    try:
        await close()
    except Exception as exc:  # a peer already gone, say: the end goes on
        log.debug("closing a client resource failed: %s", exc)


_shared: LoopThread | None = None
_lock = threading.Lock()


def shared_loop() -> LoopThread:
    global _shared
    with _lock:
        if _shared is None:
            _shared = LoopThread()
            atexit.register(_shared.shutdown)
        return _shared
