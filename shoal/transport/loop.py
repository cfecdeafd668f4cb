"""Event loops for shoal processes: uvloop when installed (it halves the per-wakeup cost that
every iroh call pays), else asyncio's default. ``SHOAL_UVLOOP=0`` turns it off."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _uvloop():
    if os.environ.get("SHOAL_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def new_event_loop() -> asyncio.AbstractEventLoop:
    uvloop = _uvloop()
    return uvloop.new_event_loop() if uvloop else asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the preferred loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
