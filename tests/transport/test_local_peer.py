"""A peer in this very process (``BaseNode.add_local_peer``: the span a gateway serves itself) is
reached over in-process pipes: whatever its ticket's addresses say, with the same frames, a round
trip of zero, and a prompt error once it has closed. (The whole transport contract runs on such
peers too: ``test_contract.py``'s ``local`` transport.)"""

from __future__ import annotations

import time

import pytest
import torch

from shoal.errors import ClosedError
from shoal.transport import META, Node, Ticket
from shoal.wire import Message
from tests.helpers.aio import run
from tests.transport.test_contract import CONFIG, CONTRACT, contract_handler

pytestmark = pytest.mark.timeout(60)


def test_a_local_peer_is_reached_in_process_at_any_address_with_zero_rtt():
    async def go():
        server = await Node.start(CONFIG, {CONTRACT: contract_handler})
        client = await Node.start(CONFIG)
        try:
            client.add_local_peer(server)
            nowhere = Ticket(server.id, ("127.0.0.1:9",))  # no iroh endpoint answers there
            x = torch.arange(12.0).reshape(3, 4)
            reply = await client.request(nowhere, CONTRACT, Message("forward", 1, tensors=[x]), timeout=2)
            assert torch.equal(reply.tensors[0], x)
            assert client.rtt_ms(nowhere, CONTRACT) == 0.0
            assert len(client.links) == 1 and client.links == server.links
            assert server.received.total > 0  # framed bytes, counted as any stream's
            await server.close()
            assert not client.links  # the server's close ended the connection
            started = time.monotonic()
            with pytest.raises(ClosedError, match="in this process"):
                await client.request(nowhere, CONTRACT, Message("forward", 2, tensors=[x]), timeout=2)
            assert time.monotonic() - started < 0.5  # at once, not after a connect deadline
            with pytest.raises(ValueError):
                client.add_local_peer(client)
        finally:
            await client.close()
            await server.close()

    run(go(), timeout=30)


def test_meta_answers_over_the_local_path_too():
    async def go():
        server = await Node.start(CONFIG, {CONTRACT: contract_handler})
        async with server, await Node.start(CONFIG) as client:
            client.add_local_peer(server)
            reply = await client.request(server.ticket(), META, Message("ping", 3))
            return reply.id, len(client.links)

    assert run(go(), timeout=30) == (3, 1)
