"""A server given ``--join`` tickets first checks that a peer of them answers: a ticket of a server
that has stopped fails it in one line within the connect deadline, before any weight loads, unless
``--join-anyway`` says to start all the same. One live peer among the tickets is enough.

In process (:class:`~shoal.launch.InProcessSwarm` joins by the steps ``shoal serve`` takes); the
command's line and exit status are tested in ``tests/cli/test_errors.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shoal.errors import ShoalError, UsageError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.server.config import ServerConfig
from shoal.transport import Deadlines, Ticket, TransportConfig
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.timeout(60)

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
SWARM = "join-check"
QUICK = TransportConfig(bind_addr="127.0.0.1:0", deadlines=Deadlines(connect=0.3))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("join-check") / "tiny", "llama", seed=6)


def stopped_ticket(swarm: InProcessSwarm) -> Ticket:
    """A well-formed ticket of the swarm, of a node that has closed: nobody answers it."""

    async def start_and_stop() -> Ticket:
        node = await swarm.start_node(QUICK)
        ticket = node.ticket(SWARM)
        await node.close()
        return ticket

    return swarm.runtime.run(start_and_stop())


def test_a_server_whose_join_peer_is_gone_fails_in_one_line(model_dir: Path):
    with InProcessSwarm(model_dir, [], swarm=SWARM, transport=QUICK) as swarm:
        started = time.monotonic()
        with pytest.raises(ShoalError) as raised:
            swarm.add(LOW, join=(stopped_ticket(swarm),))
        assert time.monotonic() - started < 5.0
        assert swarm.servers == []
    assert str(raised.value) == (
        "cannot join the swarm: the --join peer did not answer within 0.3 s (is it running, and is the "
        "ticket current? To start anyway, alone until a peer answers: --join-anyway)"
    )


def test_several_silent_peers_are_counted(model_dir: Path):
    silent = r"^cannot join the swarm: none of the 2 --join peers answered within 0.3 s \(is it running"
    with InProcessSwarm(model_dir, [], swarm=SWARM, transport=QUICK) as swarm, pytest.raises(ShoalError, match=silent):
        swarm.add(LOW, join=(stopped_ticket(swarm), stopped_ticket(swarm)))


def test_join_anyway_starts_the_server_alone(model_dir: Path):
    with InProcessSwarm(model_dir, [], swarm=SWARM, transport=QUICK) as swarm:
        alone = swarm.add(LOW, join=(stopped_ticket(swarm),), join_anyway=True)
        assert alone.ticket.swarm_id == SWARM
        table = alone.presence.service.table  # online in its swarm, which it alone makes up for now
        assert {(record.peer, record.blocks) for record in table.servers()} == {(alone.node.id, LOW)}


def test_one_live_peer_among_the_tickets_is_enough(model_dir: Path):
    with InProcessSwarm(model_dir, [LOW], swarm=SWARM, transport=QUICK) as swarm:
        (first,) = swarm.servers
        second = swarm.add(HIGH, join=(stopped_ticket(swarm), first.ticket))
        assert first.node.id in {record.peer for record in second.presence.service.table.servers()}


def test_join_anyway_goes_with_join():
    with pytest.raises(UsageError, match=r"^--join-anyway goes with --join TICKET$"):
        ServerConfig(model="m", blocks=LOW, join_anyway=True)
