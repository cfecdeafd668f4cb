"""The client loop's end (shoal.client.runtime): what is still open is closed, no task is left
suspended, and nothing runs on the loop afterwards (a stopped loop would hang a caller)."""

from __future__ import annotations

import asyncio

import pytest

from shoal.client.runtime import LoopThread


def test_shutdown_closes_what_is_open_and_ends_every_task():
    runtime = LoopThread()
    closed: list[str] = []

    async def close(name: str) -> None:
        closed.append(name)

    runtime.track(lambda: close("a"))
    runtime.untrack(runtime.track(lambda: close("b")))  # closed by its owner already
    sleeper = runtime.run(_start_sleeper())
    runtime.shutdown()
    assert closed == ["a"]
    assert sleeper.cancelled()
    assert runtime.stopped and not runtime.loop.is_running()
    with pytest.raises(RuntimeError, match="stopped"):
        runtime.run(asyncio.sleep(0))
    runtime.shutdown()  # idempotent


def test_close_soon_closes_without_waiting_and_only_once():
    runtime = LoopThread()
    closed: list[int] = []

    async def close() -> None:
        closed.append(1)

    token = runtime.track(close)
    runtime.close_soon(token)
    runtime.close_soon(token)
    runtime.run(asyncio.sleep(0.05))
    assert closed == [1]
    runtime.shutdown()
    assert closed == [1]


def test_a_resource_that_fails_to_close_does_not_stop_the_others():
    runtime = LoopThread()
    closed: list[str] = []

    async def broken() -> None:
        raise ConnectionError("peer gone")

    async def fine() -> None:
        closed.append("fine")

    runtime.track(broken)
    runtime.track(fine)
    runtime.shutdown()
    assert closed == ["fine"]


async def _start_sleeper() -> asyncio.Task:
    return asyncio.get_running_loop().create_task(asyncio.sleep(3600))
