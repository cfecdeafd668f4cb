"""The fetch's queue of wanted chunks (:class:`shoal.weights.fetch.ChunkQueue`): each giver is given
only chunks of items it holds, a taken chunk is nobody else's, one given back goes to every live giver
that may hold it (not to one that said it lacks it), and idle workers are woken by a change, not a
timer. Pure: no network."""

from __future__ import annotations

import asyncio

import pytest

from shoal.weights.fetch import ChunkQueue

pytestmark = pytest.mark.timeout(30)
KEYS = [(item, chunk) for item in range(3) for chunk in range(2)]


def drain(queue: ChunkQueue, peer: str) -> list[tuple[int, int]]:
    taken = []
    while (key := queue.take(peer)) is not None:
        taken.append(key)
    return taken


def test_each_giver_gets_only_what_it_holds_and_nothing_twice():
    queue = ChunkQueue(KEYS, {"whole": {0, 1, 2}, "span": {2}})
    assert queue.take("span") == (2, 0)
    assert drain(queue, "whole") == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 1)]  # not (2, 0): taken
    assert drain(queue, "span") == [] and queue.in_flight == 6 and not queue.pending


def test_a_chunk_given_back_goes_to_the_givers_that_may_hold_it():
    queue = ChunkQueue(KEYS, {"whole": {0, 1, 2}, "span": {2}})
    key = queue.take("span")
    queue.give_back(key, lacked_by="span")  # it said not_found after all
    queue.done()
    assert drain(queue, "span") == [(2, 1)]  # never the one it lacks
    assert drain(queue, "whole")[-1] == (2, 0) and queue.in_flight == 6
    queue = ChunkQueue(KEYS, {"whole": {0, 1, 2}, "span": {2}})
    key = queue.take("whole")
    queue.live.discard("whole")  # banned: its chunk goes first to whoever is left and may hold it
    queue.give_back(key, first=True)
    assert key not in queue.queues["span"] and key in queue.pending  # (0, 0): nobody left holds item 0


def test_an_idle_worker_wakes_when_a_chunk_in_flight_is_done():
    async def run() -> list[str]:
        queue = ChunkQueue(KEYS[:1], {"a": {0}, "b": {0}})
        events = []
        key = queue.take("a")

        async def idle() -> None:
            assert queue.take("b") is None and queue.in_flight == 1
            await queue.changed()
            events.append(f"woken, {queue.take('b')}")

        waiter = asyncio.create_task(idle())
        await asyncio.sleep(0.05)
        assert events == []  # no timer: it waits for a change
        queue.give_back(key)
        queue.done()
        await asyncio.wait_for(waiter, 5)
        return events

    assert asyncio.run(run()) == ["woken, (0, 0)"]
