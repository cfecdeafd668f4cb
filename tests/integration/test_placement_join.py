"""What a joining server does before placing, in process: it pulls the table from its bootstrap
peers again (SwarmService.pull) and reaches the records it weighs (SwarmService.admit).

* pull: the soak placed a replacement over an empty table (its join's sync had failed on a loaded
  machine, and it placed as on a new swarm). A pull returns whether a bootstrap peer answered and
  brings what changed since; with no peer answering it says so within the call timeout.
* admit: A's table holds B's record (B answers the swarm protocol) and the record of a server that is gone
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
from shoal.swarm.service import SwarmService
from shoal.swarm.table import RecordTable
from shoal.transport import Node, TransportConfig
from shoal.transport.config import Deadlines
from shoal.transport.identity import generate_key
from tests.helpers.aio import run
from tests.helpers.registry import GOSSIP, LOOPBACK, TestPeer, peer_id, server_record

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


def test_pull_brings_the_bootstrap_peers_table_and_says_when_none_answered():
    async def scenario() -> None:
        quick = TransportConfig(bind_addr="127.0.0.1:0", deadlines=Deadlines(connect=1.0))
        async with await Node.start(quick) as gone:
            dead_ticket = gone.ticket(SWARM)
        async with TestPeer(SWARM) as b, await Node.start(quick) as node:
            assert b.table.merge(b.own_record(FPS[:2], MODEL, (0, 2), State.ONLINE, 60.0))
            a = SwarmService(node, RecordTable(SWARM), GOSSIP, [dead_ticket, b.node.ticket(SWARM)])
            assert await a.join()  # one of the two answered
            assert [r.peer for r in a.table.servers(MODEL)] == [b.id]
            key = generate_key()  # a server that joined B's swarm since
            later = server_record(SWARM, peer_id(key), MODEL, (2, 4), FPS[2:], time.time(), 60.0)
            assert b.table.merge(sign(later, key))
            assert await a.pull()
            assert sorted(r.peer for r in a.table.servers(MODEL)) == sorted([b.id, later.peer])
            alone = SwarmService(node, RecordTable(SWARM), GOSSIP, [dead_ticket])
            started = time.monotonic()
            assert not await alone.pull(tries=2)
            assert time.monotonic() - started < 2 * (alone.call_timeout + 1.0)
            assert alone.table.servers(MODEL) == []

    run(scenario(), 40.0)
