"""``shoal serve`` and the in-process harness build a server by the same steps
(:mod:`shoal.server.builder`): started with the same settings, each founding a swarm of its own, a
``shoal serve`` child process and an :class:`~shoal.launch.InProcessSwarm` server announce the same
server record and the same model record, but for what names, places, signs or times them (ids,
addresses, signatures, timestamps and expiry). The throughput is given (``--throughput``), so
nothing announced is measured. Both tables are read the same way: a test node asks each server for
its own table (gossip op ``table``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm, LocalSwarm
from shoal.swarm.records import ModelRecord, ServerRecord, State, decode
from shoal.swarm.service import fetch_table
from shoal.transport import Node, Ticket
from shoal.transport.identity import generate_key
from testkit.tiny import tiny_checkpoint
from tests.helpers.registry import ENV, GOSSIP, LOOPBACK, SWARM_FLAGS

pytestmark = pytest.mark.timeout(240)

SPAN = BlockRange(1, 3)
THROUGHPUT = 42.5
#: the same settings, as ServerConfig fields (the harness) and as ``shoal serve`` flags (the process)
SETTINGS = {
    "cache_tokens": 1024,
    "page_size": 32,
    "max_batch": 8,
    "max_sessions_per_peer": 4,
    "session_timeout": 30.0,
    "num_threads": 1,
    "throughput": THROUGHPUT,
    "gossip": GOSSIP,
}
FLAGS = (
    "--cache-tokens", "1024", "--page-size", "32", "--max-batch", "8", "--max-sessions-per-peer", "4",
    "--session-timeout", "30", "--num-threads", "1", "--throughput", str(THROUGHPUT), *SWARM_FLAGS,
)  # fmt: skip
#: what differs between any two servers however they were built
SERVER_IDENTITY = {"swarm", "peer", "addrs", "relay", "timestamp", "expires"}
MODEL_IDENTITY = {"swarm", "publisher", "timestamp", "expires"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("builder-model"), "llama", seed=5, num_hidden_layers=4)


async def announced(node: Node, ticket: Ticket, timeout: float = 30.0) -> tuple[ServerRecord, ModelRecord]:
    """The server's own online record and the model record, from the table of the server at
    ``ticket`` (polled until both are there)."""
    deadline = time.monotonic() + timeout
    while True:
        table = await fetch_table(node, ticket, 5.0)
        records = [decode(data).record for data in table.records]
        server = [r for r in records if isinstance(r, ServerRecord) and r.peer == ticket.peer_id]
        model = [r for r in records if isinstance(r, ModelRecord)]
        if server and model and server[0].state is State.ONLINE:
            return server[0], model[0]
        assert time.monotonic() < deadline, f"no online server record and model record yet: {records}"
        await asyncio.sleep(0.1)


def without(record: ServerRecord | ModelRecord, fields: set[str]) -> dict:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name not in fields}


@pytest.mark.slow
def test_in_process_and_process_servers_announce_the_same_records(model_dir):
    harness = InProcessSwarm(model_dir, [], start_node=Node.start, transport=LOOPBACK, swarm="in-process", **SETTINGS)
    with LocalSwarm(model_dir, extra_args=FLAGS, swarm=True, env=ENV, ready_timeout=120) as processes, harness:
        (child,) = processes.start([SPAN])
        local = harness.add(SPAN)
        node = harness.runtime.run(Node.start(LOOPBACK, {}, secret_key=generate_key()))
        try:
            from_process = harness.runtime.run(announced(node, child.ticket), timeout=60)
            in_process = harness.runtime.run(announced(node, local.ticket), timeout=60)
        finally:
            harness.runtime.run(node.close(), timeout=10)
    (server_p, model_p), (server_i, model_i) = from_process, in_process
    assert server_p.peer != server_i.peer and server_p.swarm != server_i.swarm  # two servers, two swarms
    assert without(server_i, SERVER_IDENTITY) == without(server_p, SERVER_IDENTITY)
    assert without(model_i, MODEL_IDENTITY) == without(model_p, MODEL_IDENTITY)
    # and what they agree on is what was asked for
    assert (server_i.blocks, len(server_i.fingerprints), server_i.throughput) == (SPAN, 2, THROUGHPUT)
    assert server_i.cache_tokens_free == 1024 and server_i.step_ms == pytest.approx(1000.0 / THROUGHPUT)
    assert model_i.num_blocks == 4 and model_i.fingerprints[SPAN.start : SPAN.end] == server_i.fingerprints
