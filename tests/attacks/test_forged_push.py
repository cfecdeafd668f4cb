"""Honest push routes (issue #33): a server of a push chain cannot forge pushes that make the client
blame an honest server, and a client cannot make a server dial whatever it names.

* A forging first hop: before its honest push to the next server, it pushes under the client's step
  id noise straight to the hop after that, with the tokens a push route shows it (the later hop's
  own, bound to the server before that hop: passing for it; or its own next hop's, for the later
  hop's session), or its output to its next hop at another position or without the receipt the
  client asked. The hop forged to refuses every forged push (counted as rejected): its receipts show
  the honest inputs, the generation equals transformers' and the client bans nobody.
* A swarm member refuses to push to a next hop that is not an online member of its swarm serving
  the next blocks (a standalone server, a member of other blocks, an arbitrary peer): it dials none
  of them, its reply says ``pushed: false`` and the client drives that hop itself, with the same
  tokens. A member named at made-up addresses is pushed to at the addresses it announced. A
  standalone server (no table) pushes only to a named peer that answers ``info`` with the next blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.client import AutoDistributedModelForCausalLM
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LOOPBACK, LocalServer
from shoal.protocols import BLOCKS
from shoal.server.handler import BlockServer
from shoal.server.push import Pusher
from shoal.swarm.liveness import Reach
from shoal.swarm.records import State
from shoal.transport import BaseNode, Ticket
from shoal.transport.memory import MEMORY_HOST
from shoal.wire import Message
from shoal.wire.schema import PushHop, PushRequest
from testkit.tiny import inputs, tiny_checkpoint
from tests.helpers.inprocess import no_server_errors, wait_until  # noqa: F401 (a fixture)
from tests.helpers.servers import Session

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_server_errors")]

FIRST, SECOND, THIRD = BlockRange(0, 1), BlockRange(1, 2), BlockRange(2, 4)
LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 4-block random llama."""
    return tiny_checkpoint(tmp_path_factory.mktemp("forged-push") / "tiny", "llama", seed=7)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.Tensor:
    """Local transformers' greedy generation from :data:`PROMPT`."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.inference_mode():
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)


# ---- a hop that forges pushes --------------------------------------------------------------------
#: How the forging first hop forges: (the hop it pushes to, what it changes).
FORGERIES = {
    # noise to the hop after its next, with that hop's token as the route shows it (bound to the next
    # server: passing for it), or with the token of its own next hop (that session's, bound to itself)
    "later_hops_token": ("later", "noise"),
    "next_hops_token": ("later", "noise, the next hop's token"),
    # its own output to its next hop, with that hop's token, one position further (whose error
    # reply would fail the honest hop), or not asking the receipt the client asked for (whose missing
    # receipt would get the honest hop banned as a liar)
    "moved": ("next", "position + 1"),
    "without_receipt": ("next", "no receipt asked"),
}


class ForgingPusher(Pusher):
    """Pushes honestly to the next server, after a forged push as ``how`` (:data:`FORGERIES`) says,
    under the same step id."""

    def __init__(self, honest: Pusher, how: str):
        super().__init__(honest.counters, honest.node, honest.span, honest.table, honest.refuses)
        self.how = how
        self.forged = 0  # forged pushes sent
        self._forgery: dict[str, object] = {}

    async def push(self, reply: Message, message: Message, route: tuple[PushHop, ...]) -> bool:
        if len(route) > 1:
            await self._forge(reply, message, route)
        return await super().push(reply, message, route)

    async def _forge(self, reply: Message, message: Message, route: tuple[PushHop, ...]) -> None:
        step, (nearer, later) = message.meta, route[:2]
        position, receipt, hidden = step.position, step.receipt, reply.tensors[0]
        if self.how in ("later_hops_token", "next_hops_token"):
            target, rest = later, route[2:]
            token = later.token if self.how == "later_hops_token" else nearer.token
            hidden = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(self.forged))
        else:
            target, rest, token = nearer, route[1:], nearer.token
            position, receipt = (position + 1, receipt) if self.how == "moved" else (position, not receipt)
        meta = PushRequest(session=target.session, token=token, position=position, step=message.id, push=rest,
                           receipt=receipt)  # fmt: skip
        stream = self._forgery.get(target.ticket)
        if stream is None:
            stream = self._forgery[target.ticket] = await self.node.open_stream(Ticket.parse(target.ticket), BLOCKS)
        await stream.send(Message("push", stream.next_id(), meta, [hidden, *message.tensors[1:]], reply.codecs))
        self.forged += 1


def forging(how: str):
    def prepare(server: BlockServer) -> BlockServer:
        server.pusher = ForgingPusher(server.pusher, how)
        return server

    return prepare


@pytest.mark.parametrize("how", list(FORGERIES))
def test_a_hop_forging_pushes_is_refused_and_nobody_honest_is_blamed(model_dir, reference, how):
    """The first of three hops forges a push at every step (:data:`FORGERIES`), before its honest
    push. The hop it forges to refuses each (the token is bound to another peer, another session or
    another step) and serves the honest pushes: the tokens equal transformers', no hop failed, no
    server is banned or convicted, every step was pushed through."""
    with InProcessSwarm(model_dir, []) as swarm:
        forger = swarm.add(FIRST, forging(how))
        second, third = swarm.add(SECOND), swarm.add(THIRD)
        model = swarm.connect(push=True, refresh_period=0)
        got = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(got, reference)
        steps = NEW_TOKENS  # one prefill, then one step per token but the last
        pusher = forger.server.pusher
        assert isinstance(pusher, ForgingPusher) and pusher.forged == steps
        forged_to = third if FORGERIES[how][0] == "later" else second
        wait_until(lambda: forged_to.server.counters.pushes_rejected == steps, what="every forged push refused")
        for server in (second, third):  # no forged step ran
            c = server.server.counters
            assert (c.pushes_received, c.pushes_rejected, c.steps) == (steps, steps * (server is forged_to), steps)
        assert forger.server.counters.pushes_sent == second.server.counters.pushes_sent == steps
        session = model.blocks._session
        assert session.recoveries == []
        assert [s.peer_id for s in session.chain] == [peer(forger), peer(second), peer(third)]
        directory = model.blocks.directory
        assert not any(directory.bans.banned(peer(s)) for s in swarm.servers) and not directory.banned


def peer(server: LocalServer) -> str:
    return server.node.id


# ---- whom a swarm member pushes to -----------------------------------------------------------------
class RecordingNode:
    """A server's node whose dials (``open_stream``) are recorded: the peers it pushes to."""

    def __init__(self, inner: BaseNode):
        self._inner = inner
        self.dialled: list[Ticket] = []

    async def open_stream(self, ticket: Ticket, *args, **kwargs):
        self.dialled.append(ticket)
        return await self._inner.open_stream(ticket, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def recording(server: BlockServer) -> BlockServer:
    server.pusher = server.pusher.via(RecordingNode(server.pusher.node))
    return server


def dialled(server: LocalServer) -> list[str]:
    """The peers ``server`` (prepared by :func:`recording`) dialled to push to."""
    return [t.peer_id for t in server.server.pusher.node.dialled]


def online(member: LocalServer, *others: LocalServer) -> None:
    """Wait until ``member``'s swarm table holds every one of ``others`` online, and reached."""
    table = member.presence.service.table

    def known() -> bool:
        records = [table.get(f"s:{peer(s)}") for s in others]
        return all(r is not None and r.record.state is State.ONLINE and table.reach(r.record) is Reach.REACHABLE
                   for r in records)  # fmt: skip

    wait_until(known, timeout=10.0, what="the members' records")


@pytest.fixture
def swarm_and_standalone(model_dir) -> Iterator[tuple[InProcessSwarm, InProcessSwarm]]:
    """A swarm with a member of :data:`LOW` (its dials recorded), and a standalone server of
    :data:`HIGH` on the same network (not a member)."""
    with InProcessSwarm(model_dir, [], swarm="honest-push") as swarm:
        swarm.add(LOW, recording)
        with InProcessSwarm(model_dir, [HIGH], start_node=swarm.start_node) as alone:
            yield swarm, alone


def test_a_member_never_pushes_to_a_non_member_and_the_client_drives_that_hop(swarm_and_standalone, reference):
    """The client routes over the member of LOW and the standalone server of HIGH, which serves the
    next blocks but is not in the swarm: the member never dials it, every step's push is refused
    (``pushes_failed``) and the client sends the standalone server each step itself. The tokens
    equal transformers'; nobody is banned."""
    swarm, alone = swarm_and_standalone
    (member,), (standalone,) = swarm.servers, alone.servers
    tickets = [member.ticket, standalone.ticket]
    with AutoDistributedModelForCausalLM.from_pretrained(
        str(swarm.model_dir), tickets, push=True, refresh_period=0, transport=LOOPBACK, start_node=swarm.start_node
    ) as model:
        got = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(got, reference)
        session = model.blocks._session
        assert [s.peer_id for s in session.chain] == [peer(member), peer(standalone)] and session.recoveries == []
        directory = model.blocks.directory
        assert not any(directory.bans.banned(peer(s)) for s in (member, standalone)) and not directory.banned
    c = member.server.counters
    assert (c.pushes_sent, c.pushes_failed, c.steps) == (0, NEW_TOKENS, NEW_TOKENS)  # asked at every step
    s = standalone.server.counters
    assert (s.pushes_received, s.pushes_rejected, s.steps) == (0, 0, NEW_TOKENS)
    assert dialled(member) == []


def test_a_member_pushes_only_to_online_members_of_the_next_blocks_at_their_announced_addresses(
    swarm_and_standalone,
):
    """A client names, as the next hop of a step to the member of LOW: the standalone server of HIGH,
    another member (of LOW), its own node (no blocks, no record), and a member of HIGH at made-up
    addresses. Only the last is pushed to (``pushed: true``; its session answers the pushed step),
    dialled at the addresses its record announces; the others are refused without a dial
    (``pushed: false``), and their sessions hear nothing."""
    swarm, alone = swarm_and_standalone
    (member,), (standalone,) = swarm.servers, alone.servers
    twin, high = swarm.add(LOW), swarm.add(HIGH)
    online(member, twin, high)
    x = inputs(member.server.backend.hidden_size, 2, seed=1)

    async def go() -> None:
        node = await swarm.network.start(LOOPBACK)
        try:
            first = await Session.open(node, member.ticket, max_length=16)
            to_standalone, to_twin, to_high = [
                await Session.open(node, s.ticket, max_length=16) for s in (standalone, twin, high)
            ]
            made_up = Ticket(peer(high), (f"{MEMORY_HOST}:9",), None, swarm.swarm_id)  # nobody listens there
            nexts = [
                (to_standalone, standalone.ticket),
                (to_twin, twin.ticket),
                (to_standalone, node.ticket()),  # the client's own node
                (to_high, made_up),
            ]
            for i, (to, ticket) in enumerate(nexts):  # each at position 0: the first session goes back there
                step_id = first.stream.next_id()
                hop = to.push_hop(ticket, peer(member), step=step_id, position=0, n=2, receipt=False)
                await first.send_step(0, x, push=(hop,), step_id=step_id)
                meta, _ = await first.result(step_id)
                assert meta.pushed is (i == len(nexts) - 1), i
            pushed, _ = await to_high.result(step_id)  # the pushed step, under the client's id
            assert pushed.position == 2
            for session in (first, to_standalone, to_twin, to_high):
                await session.close()
        finally:
            await node.close()

    swarm.runtime.run(go(), 30)
    assert [(t.peer_id, t.addrs) for t in member.server.pusher.node.dialled] == [(peer(high), high.ticket.addrs)]
    c = member.server.counters
    assert (c.pushes_sent, c.pushes_failed) == (1, 3)
    assert [s.server.counters.pushes_received for s in (standalone, twin, high)] == [0, 0, 1]


def test_a_standalone_server_pushes_only_to_a_named_peer_that_answers_with_the_next_blocks(model_dir):
    """No swarm, so no table to ask: the server asks a named next hop ``info`` on a new push stream
    first. A server of its own blocks is refused (``pushed: false``) and, named again, not dialled
    again; a client node (no blocks protocol) is refused too; a server of the next blocks is pushed
    to, and its session answers the pushed step."""
    with InProcessSwarm(model_dir, []) as swarm:
        first, twin, high = swarm.add(LOW, recording), swarm.add(LOW), swarm.add(HIGH)
        x = inputs(first.server.backend.hidden_size, 2, seed=1)
        client: list[str] = []

        async def go() -> None:
            node = await swarm.network.start(LOOPBACK)
            client.append(node.id)
            try:
                opened = [await Session.open(node, s.ticket, max_length=16) for s in (first, twin, high)]
                head, to_twin, to_high = opened
                nexts = [
                    (to_twin, twin.ticket),
                    (to_twin, twin.ticket),
                    (to_high, node.ticket()),
                    (to_high, high.ticket),
                ]
                for i, (to, ticket) in enumerate(nexts):  # each at position 0, as above
                    step_id = head.stream.next_id()
                    hop = to.push_hop(ticket, peer(first), step=step_id, position=0, n=2, receipt=False)
                    await head.send_step(0, x, push=(hop,), step_id=step_id)
                    meta, _ = await head.result(step_id)
                    assert meta.pushed is (i == len(nexts) - 1), i
                pushed, _ = await to_high.result(step_id)  # the pushed step, under the client's id
                assert pushed.position == 2
                for session in opened:
                    await session.close()
            finally:
                await node.close()

        swarm.runtime.run(go(), 30)
        assert dialled(first) == [peer(twin), *client, peer(high)]
        c = first.server.counters
        assert (c.pushes_sent, c.pushes_failed) == (1, 3)
        assert [s.server.counters.pushes_received for s in (twin, high)] == [0, 1]
