"""A joining server reaches the records it weighs before placing (SwarmService.admit), in process.

A's table holds B's record (B answers the swarm protocol) and the record of a server that is gone
(its node closed; the record is unexpired, as a SIGKILLed server's stays until ``--expiry``). Before
the probes neither counts (not reached: a record is only a claim); one ``admit`` later, within the
probe timeout, B counts and the dead server does not, and A's placement goes where the dead server
was.
"""

from __future__ import annotations

import random
import time

import pytest

from shoal.ids import BlockRange
from shoal.server.placement import choose_span
from shoal.server.presence import placeable
from shoal.swarm.liveness import PROBE_TIMEOUT_S, Reach
from shoal.swarm.records import State, sign
from shoal.transport import Node
from shoal.transport.identity import generate_key
from tests.helpers.aio import run
from tests.helpers.registry import LOOPBACK, TestPeer, peer_id, server_record

pytestmark = pytest.mark.timeout(60)

SWARM, MODEL = "s" * 16, "tiny"
FPS = [bytes([i]) * 32 for i in range(4)]


def test_admit_probes_the_records_so_a_dead_servers_record_does_not_count():
    async def scenario() -> None:
        dead_key = generate_key()
        async with await Node.start(LOOPBACK, secret_key=dead_key) as gone:
            addrs = gone.ticket(SWARM).addrs  # it answered here once; closed below
        now = time.time()
        dead = server_record(SWARM, peer_id(dead_key), MODEL, (2, 4), FPS[2:], now, 60.0, addrs=addrs)
        async with TestPeer(SWARM) as a, TestPeer(SWARM) as b:
            assert a.table.merge(b.own_record(FPS[:2], MODEL, (0, 2), State.ONLINE, 60.0))
            assert a.table.merge(sign(dead, dead_key))
            assert placeable(a.table, MODEL, a.id, time.time()) == []  # nobody reached yet
            records = a.table.servers(MODEL, include_unreachable=True)
            started = time.monotonic()
            await a.service.admit(records)
            assert time.monotonic() - started < PROBE_TIMEOUT_S + 1.0
            reach = {r.peer: a.table.reach(r) for r in records}
            assert reach == {b.id: Reach.REACHABLE, dead.peer: Reach.UNREACHABLE}
            placed = placeable(a.table, MODEL, a.id, time.time())
            assert [p.peer for p in placed] == [b.id]
            assert choose_span(placed, 4, 2, 1.0, random.Random(0)) == BlockRange(2, 4)

    run(scenario(), 30.0)
