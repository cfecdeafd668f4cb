"""Pushes between servers through the blocks protocol handler: only the token bound to the pushing
peer is taken, a late or stale push never overwrites a newer step, a pushed chain answers every hop
to the client, and an undeliverable push says so (the setting: ``tests/server/handler/test_inputs.py``)."""

from __future__ import annotations

import asyncio

import pytest

from shoal.errors import BadRequest, ClosedError
from shoal.protocols import BLOCKS
from shoal.transport import BaseNode, MessageStream
from shoal.verify.tokens import push_token
from shoal.wire import Message
from shoal.wire.schema import PushHop, PushRequest, StepReply
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.servers import Session, info, inputs, local_forward, wait_for_info
from tests.server.handler.bench import HIDDEN, IDLE, Bench, assert_same, assert_serving

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_server_errors")]


# ---- pushes ----------------------------------------------------------------------------------------
async def pending_reply(stream: MessageStream, wait: float = 0.1) -> asyncio.Task:
    """A read of ``stream``'s next message, checked to still be waiting after ``wait`` seconds
    (nothing arrived); await it later for what comes next."""
    task = asyncio.get_running_loop().create_task(stream.recv(10))
    await asyncio.sleep(wait)
    assert not task.done(), f"the session's client was sent {task.result() if not task.exception() else task}"
    return task


def test_pushes_need_the_session_token_and_a_forged_one_changes_nothing(serve, span):
    """Pushes (server-to-server hand-offs) into a session: unknown sessions, wrong, empty or
    non-ASCII tokens, the session's secret itself, the token bound to another peer than the pusher,
    another session's token, a step's token on another step id, position or receipt flag, and stale
    step ids are dropped and counted as rejected; malformed ones are refused to the pusher, naming
    the field. The session's client hears nothing and its cache is untouched (its length did not
    move). A push with the right token is served, answered on the session's own stream under the
    pushed step id; that step id again is stale."""
    bench = serve()

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        session = await Session.open(node, ticket, max_length=8)
        other = await Session.open(node, ticket, max_length=8)
        cache = span.allocate_cache(1, 8)
        prefill = inputs(HIDDEN, 2, seed=4)
        assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))  # step id 2
        pushed = inputs(HIDDEN, 2, start=2, seed=5)

        def bound(step=9, peer=node.id, secret=session.token, position=2, receipt=False) -> str:
            """What the client hands the peer it lets push that step (here its own node)."""
            return push_token(secret, peer, step=step, position=position, n=2, receipt=receipt)

        def push(session_id=session.id, token=None, step=9, position=2, receipt=False) -> PushRequest:
            token = token if token is not None else bound(step)
            return PushRequest(session=session_id, token=token, position=position, step=step, receipt=receipt)

        forged = [
            push(session_id="feedfacefeedface"),
            push(token="0" * 32),
            push(token=""),
            push(token="tökén"),
            push(token=session.token),  # the session's secret is no token
            push(token=bound(peer="ab" * 32)),  # another peer's token: not this pusher's
            push(token=bound(secret=other.token)),
            push(session_id=other.id),  # the right token, for another session
            push(step=10, token=bound(step=9)),  # the token of another step
            push(position=0),  # the step's token, at another position
            push(receipt=True),  # ... or asking another receipt than the client did
            push(step=2),  # the prefill's id: stale
        ]
        malformed = [
            (push(session_id=[session.id]), r"Expected `str`, got `array` - at `\$.session`"),
            (push(step="7"), r"Expected `int`, got `str` - at `\$.step`"),
            (push(step=-1), r"Expected `int` >= 0 - at `\$.step`"),
            (push(step=1 << 32), r"Expected `int` <= 4294967295 - at `\$.step`"),
        ]
        pusher = await node.open_stream(ticket, BLOCKS)
        for meta in forged:
            await pusher.send(Message("push", pusher.next_id(), meta, pushed))
        for meta, message in malformed:  # answered to the pusher: its stream stays usable
            with pytest.raises(BadRequest, match=message):
                await pusher.request(Message("push", pusher.next_id(), meta, pushed))
        await wait_for_info(node, ticket, lambda r: r.counters.pushes_rejected == len(forged))
        waiting = await pending_reply(session.stream)  # nothing reached the session's client
        step_id = await session.send_step(3, inputs(HIDDEN, 1, start=3))  # nor its cache: it still holds 2
        refused = await waiting
        assert refused.kind == "error" and refused.id == step_id
        assert refused.error_info() == ("bad_request", "position must be in [0, 2] (what the session holds)")

        waiting = await pending_reply(session.stream, wait=0)
        await pusher.send(Message("push", pusher.next_id(), push(), pushed))
        reply = await waiting
        assert reply.kind == "result" and reply.id == 9 and reply.reply(StepReply).position == 4
        assert_same(reply.tensors[0], local_forward(span, pushed, cache, 2))
        await pusher.send(Message("push", pusher.next_id(), push(), pushed))  # the same step again: stale
        await wait_for_info(node, ticket, lambda r: r.counters.pushes_rejected == len(forged) + 1)
        waiting = await pending_reply(session.stream)
        step_id = await session.send_step(5, inputs(HIDDEN, 1, start=5))  # it ran once: the session holds 4
        assert (await waiting).error_info()[1] == "position must be in [0, 4] (what the session holds)"

        c = (await info(node, ticket)).counters
        assert c.pushes_received == 1 and c.pushes_rejected == len(forged) + 1 and c.pushes_sent == 0
        assert c.errors == len(malformed) + 2 and c.steps == 2
        await session.close()
        await other.close()
        await pusher.finish()
        await assert_serving(node, ticket, span)

    bench.run(go())


def test_a_late_push_overtaken_while_it_waited_for_the_lock_never_overwrites_the_newer_step(serve, span):
    """The previous server's push of step s1 passes the first check (s1 is newer than the prefill)
    and waits for the session's lock behind the client's direct retry s2 of the same position. Once
    s2 ran, s1 is stale: checked again under the lock, it is dropped (counted as rejected), so the
    cache holds what s2 wrote and the next step equals the local blocks fed the prefill and s2."""
    bench = serve()

    async def waiting_for(lock: asyncio.Lock, count: int) -> None:
        async with asyncio.timeout(5.0):
            while len(lock._waiters or ()) < count:  # queued on the session's lock (FIFO)
                await asyncio.sleep(0.005)

    async def go():
        node = await bench.client()
        ticket = bench.ticket()
        session = await Session.open(node, ticket, max_length=8)
        cache = span.allocate_cache(1, 8)
        prefill = inputs(HIDDEN, 2, seed=4)
        assert_same(await session.step(0, prefill), local_forward(span, prefill, cache, 0))  # step id 2
        late_id = session.stream.next_id()  # s1 = 3: the step the previous server pushes, late
        served = bench.swarm.servers[0].server._sessions[session.id]
        pusher = await node.open_stream(ticket, BLOCKS)
        retry, late = inputs(HIDDEN, 1, start=2, seed=6), inputs(HIDDEN, 1, start=2, seed=5)
        await served.lock.acquire()  # a step of the session is running: what arrives now waits
        try:
            retry_id = await session.send_step(2, retry)  # s2 = 4: the client drives the hop itself
            await waiting_for(served.lock, 1)
            token = push_token(session.token, node.id, step=late_id, position=2, n=1, receipt=False)
            meta = PushRequest(session=session.id, token=token, position=2, step=late_id)
            await pusher.send(Message("push", pusher.next_id(), meta, late))
            await waiting_for(served.lock, 2)
        finally:
            served.lock.release()
        _, out = await session.result(retry_id)
        assert_same(out, local_forward(span, retry, cache, 2))
        await wait_for_info(node, ticket, lambda r: r.counters.pushes_rejected == 1)
        following = inputs(HIDDEN, 1, start=3, seed=7)  # the cache holds the prefill and s2, not s1
        assert_same(await session.step(3, following), local_forward(span, following, cache, 3))
        c = (await info(node, ticket)).counters
        assert (c.pushes_received, c.pushes_rejected, c.steps, c.errors) == (0, 1, 3, 0)
        await session.close()
        await pusher.finish()

    bench.run(go())


CHAIN = [(0, 1), (1, 2), (2, 4)]  # three servers, every block of the tiny llama


async def open_chain(bench: Bench, node: BaseNode, max_length: int = 16) -> list[Session]:
    return [await Session.open(node, server.ticket, max_length) for server in bench.swarm.servers]


def test_a_pushed_chain_answers_every_hop_to_the_client_and_counts_each_push(serve, spans):
    """A step sent to the first of three servers with the other two as its push route: each server
    hands its output to the next and answers the client on its own session stream, under the
    client's step id; every output equals the local blocks up to that server. Counters: each push
    sent once and received once, one step per server per client step."""
    bench = serve(CHAIN)

    async def go():
        node = await bench.client()
        sessions = await open_chain(bench, node)
        caches = [spans(0, end).allocate_cache(1, 16) for _, end in CHAIN]
        position = 0
        for n, seed in [(4, 1), (1, 2), (1, 3)]:
            x = inputs(HIDDEN, n, start=position, seed=seed)
            step_id = sessions[0].stream.next_id()
            route = tuple(s.push_hop(bench.ticket(i), bench.ticket(i - 1).peer_id, step=step_id, position=position, n=n)
                          for i, s in enumerate(sessions) if i)  # fmt: skip
            await sessions[0].send_step(position, x, push=route, step_id=step_id)
            for i, (session, (_, end)) in enumerate(zip(sessions, CHAIN, strict=True)):
                meta, out = await session.result(step_id)
                assert meta.position == position + n
                assert meta.pushed is (None if i == len(CHAIN) - 1 else True)
                assert_same(out, local_forward(spans(0, end), x, caches[i], position))
            position += n
        for i, server in enumerate(bench.swarm.servers):
            c = server.server.counters
            assert c.steps == 3 and c.positions_processed == 6, (i, c)
            assert (c.pushes_sent, c.pushes_received) == [(3, 0), (3, 3), (0, 3)][i], (i, c)
            assert c.pushes_failed == c.pushes_rejected == c.errors == 0
        for session in sessions:
            await session.close()

    bench.run(go())


def test_a_push_that_cannot_be_delivered_says_so_and_the_client_drives_the_hop(serve, spans):
    """A push route naming a peer that does not serve blocks: the step is served, its reply says
    ``pushed: false`` (counted as a failed push), and the client sends the next server the step
    itself; the session continues correctly."""
    bench = serve(CHAIN[:2])

    async def go():
        node = await bench.client()
        first, second = await open_chain(bench, node)
        token = push_token(second.token, bench.ticket(0).peer_id, step=2, position=0, n=3, receipt=False)
        nowhere = PushHop(ticket=str(node.ticket()), session=second.id, token=token)  # a client: no blocks
        x = inputs(HIDDEN, 3, seed=1)
        meta, out = await first.result(await first.send_step(0, x, push=(nowhere,)))
        assert meta.pushed is False
        assert_same(out, local_forward(spans(0, 1), x))
        assert_same(await second.step(0, [out, *x[1:]]), local_forward(spans(0, 2), x))
        c = bench.swarm.servers[0].server.counters
        assert (c.pushes_failed, c.pushes_sent) == (1, 0)
        assert bench.swarm.servers[1].server.counters.pushes_received == 0

    bench.run(go())


def test_pushes_keep_a_session_alive_that_its_client_never_talks_to(serve, spans):
    """Idle timeout 0.3 s; for 0.5 s the client steps only the first server, which pushes to the
    second: the second's session is not idle (pushes count) and is not timed out, while a session
    nobody steps is."""
    bench = serve(CHAIN[:2], session_timeout=IDLE)

    async def go():
        node = await bench.client()
        first, second = await open_chain(bench, node)
        forgotten = await Session.open(node, bench.ticket(1), max_length=16)
        cache = spans(0, 2).allocate_cache(1, 16)
        for position in range(10):  # 10 x 0.05 s
            x = inputs(HIDDEN, 1, start=position, seed=position)
            step_id = first.stream.next_id()
            route = (second.push_hop(bench.ticket(1), bench.ticket(0).peer_id, step=step_id, position=position, n=1),)
            await first.send_step(position, x, push=route, step_id=step_id)
            await first.result(step_id)
            _, out = await second.result(step_id)
            assert_same(out, local_forward(spans(0, 2), x, cache, position))
            await asyncio.sleep(0.05)
        c = (await info(node, bench.ticket(1))).counters
        assert c.sessions_timed_out == 1 and c.sessions_active == 1 and c.pushes_received == 10
        with pytest.raises(ClosedError):
            await forgotten.step(0, inputs(HIDDEN, 1))
        await first.close()
        await second.close()

    bench.run(go())
