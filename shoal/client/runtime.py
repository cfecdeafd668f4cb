"""One background event loop per process for the synchronous client API (transformers' generate
is synchronous; the transport is asyncio)."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Awaitable
from typing import TypeVar

from shoal.transport.loop import new_event_loop

T = TypeVar("T")


class LoopThread:
    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="shoal-client-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it from this (non-loop) thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


_shared: LoopThread | None = None
_lock = threading.Lock()


def shared_loop() -> LoopThread:
    global _shared
    with _lock:
        if _shared is None:
            _shared = LoopThread()
            atexit.register(_shared.stop)
        return _shared
