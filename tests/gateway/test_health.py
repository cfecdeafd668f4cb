"""Health checks over a swarm of two servers (blocks 0-2 and 3-5): ``/healthz`` and ``/readyz`` of
``shoal api`` and of each server's metrics port. When the server of blocks 3-5 starts to leave
(SIGTERM, while a session it holds keeps its drain going), its own ``/readyz`` says it is draining
and the gateway's says those blocks have no online server, while both ``/healthz`` stay 200."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from shoal.transport import Node
from tests.gateway.conftest import MODEL_ID
from tests.gateway.support import LOOPBACK, MetricsSwarm, gateway, wait_for
from tests.helpers.aio import run
from tests.helpers.servers import Session

pytestmark = pytest.mark.timeout(180)

SPLIT = [(0, 3), (3, 6)]


def get(url: str) -> tuple[int, dict]:
    """(status, JSON body) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def split_swarm(chat_model):
    """Two servers; a drain may last 30 s (until the sessions it holds close)."""
    swarm = MetricsSwarm(chat_model[0]).start(SPLIT, ("--drain-timeout", "30"))
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.mark.slow
def test_ready_until_a_span_loses_its_last_server(chat_model, split_swarm):
    first, last = split_swarm.servers
    metrics = {s.peer: f"http://127.0.0.1:{s.metrics_port}" for s in split_swarm.servers}
    with gateway(chat_model[0], split_swarm.ticket) as api:
        assert get(f"{api.url}/healthz") == (200, {"status": "ok"})
        ready = {"ready": True, "model": MODEL_ID, "num_blocks": 6, "servers_online": 2}
        wait_for(lambda: get(f"{api.url}/readyz") == (200, ready), 20, what="the gateway ready")
        for server in split_swarm.servers:
            assert get(f"{metrics[server.peer]}/healthz") == (200, {"status": "ok"})
            span = f"{server.span[0]}:{server.span[1]}"
            assert get(f"{metrics[server.peer]}/readyz") == (200, {"ready": True, "model": MODEL_ID, "blocks": span})

        async def leave_while_a_session_is_open() -> None:
            async with await Node.start(LOOPBACK) as node:
                session = await Session.open(node, last.process.ticket, max_length=16)
                last.process.terminate()  # SIGTERM: offline record, then a drain that waits for our session

                def draining():
                    status, body = get(f"{metrics[last.peer]}/readyz")
                    return body if status == 503 and body["reason"].startswith("draining") else None

                body = await asyncio.to_thread(wait_for, draining, 10, 0.05, "the server's readyz draining")
                assert body == {
                    "ready": False,
                    "reason": "draining: the server is leaving the swarm or moving",
                    "model": MODEL_ID,
                    "blocks": "3:6",
                }
                assert get(f"{metrics[last.peer]}/healthz") == (200, {"status": "ok"})

                def gateway_unready():
                    status, body = get(f"{api.url}/readyz")
                    return body if status == 503 else None

                body = await asyncio.to_thread(wait_for, gateway_unready, 10, 0.1, "the gateway's readyz 503")
                assert body == {
                    "ready": False,
                    "reason": f"blocks 3-5 of {MODEL_ID} have no online server",
                    "model": MODEL_ID,
                    "num_blocks": 6,
                    "servers_online": 1,
                    "uncovered": [3, 4, 5],
                }
                assert get(f"{api.url}/healthz") == (200, {"status": "ok"})
                assert get(f"{metrics[first.peer]}/readyz")[0] == 200  # the other server is unaffected
                await session.close()  # the drain ends: the server exits

        run(leave_while_a_session_is_open(), 60)
        assert last.process.proc.wait(20) == 0
