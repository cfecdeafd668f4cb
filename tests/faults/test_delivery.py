"""Faults of delivery (the setting: ``test_faults.py``): equivocation, delayed, dropped and malformed
replies, crashes in process and of a server process; the backend's checks pass through unchanged,
and faults travel as JSON. One test crashes a server process (``python -m testkit.faulty_server``)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from shoal.errors import BadRequest, ClosedError, ConnectTimeout, RequestTimeout, ShoalError, WireError
from shoal.launch import ServerProcess, serve_args
from shoal.protocols import BLOCKS
from shoal.transport import MemoryNetwork, Node, TransportConfig
from shoal.wire import Message
from testkit.faults import (
    CRASH_EXIT_CODE,
    Crash,
    DropReply,
    Equivocate,
    FaultRecord,
    Identity,
    Malformed,
    Noise,
    OtherWeights,
    ReplyDelay,
    SkipBlock,
    StaleCache,
    When,
    Zeros,
    decode_faults,
    encode_faults,
    fault_flags,
    faulty_server_args,
)
from testkit.faulty import serve_locally
from tests.faults.bench import HIDDEN, SPAN, Session, inputs, load, pair, relative
from tests.helpers.aio import run

pytestmark = pytest.mark.timeout(60)


def test_equivocation_pushes_the_next_server_another_tensor_than_the_reply(model_dir):
    async def scenario():
        network = MemoryNetwork()
        servers = []
        try:
            honest = await serve_locally(load(model_dir, 0, 2), network)
            servers.append(honest)
            liar = await serve_locally(load(model_dir, 0, 2, [Equivocate(0.3, seed=6)]), network)
            servers.append(liar)
            mirror = await serve_locally(load(model_dir, 2, 3, [Identity()]), network)  # echoes its input
            servers.append(mirror)
            client = await network.start()
            first, replica, second = [await Session.open(client, s.ticket) for s in (liar, honest, mirror)]
            results = []
            for i, n in enumerate([3, 1]):
                tensors = inputs(n, first.position, i)
                reply = await first.step(tensors, push=(second.hop(mirror.ticket, liar.node.id),))
                received = await second.stream.recv(5.0)  # the mirror answers the pushed step on its session
                assert received.kind == "result" and received.id == first.last_id
                second.position += n
                results.append((reply, await replica.step(tensors), received.tensors[0]))
            return results, liar.server.record.entries(), liar.server.counters.pushes_sent
        finally:
            for server in servers:
                await server.close()

    results, record, pushes = run(scenario(), 30)
    for reply, honest, pushed in results:
        torch.testing.assert_close(reply, honest, atol=1e-5, rtol=0)  # the client sees the honest output
        assert 0.15 <= relative(pushed, reply) <= 0.6  # the next server got another one
    assert pushes == 2
    assert [(e.fault, e.step, e.positions) for e in record] == [("equivocate", 0, (0, 3)), ("equivocate", 1, (3, 4))]
    assert all(e.size == pytest.approx(0.3, abs=1e-4) for e in record)


def test_reply_delay_holds_every_reply(model_dir):
    delay = 0.25

    async def scenario():
        async with pair(model_dir, [ReplyDelay(delay)]) as p:
            timings = {}
            for name, server in (("honest", p.honest), ("faulty", p.faulty)):
                started = time.perf_counter()
                await p.client.request(server.ticket, BLOCKS, Message("info", 1), timeout=5.0)
                timings[f"{name} info"] = time.perf_counter() - started
            _, faulty = await p.sessions()
            started = time.perf_counter()
            await faulty.step(inputs(2, 0, 0))
            timings["faulty step"] = time.perf_counter() - started
            return timings, p.record.entries()

    timings, record = run(scenario(), 30)
    early = 0.005  # asyncio fires a timer up to its clock resolution early
    assert timings["faulty info"] >= delay - early and timings["faulty step"] >= delay - early, timings
    assert timings["honest info"] < delay, timings
    assert [(e.fault, e.step) for e in record] == [("reply_delay", None)] * 2 + [("reply_delay", 0)]  # info, open, step


def test_a_dropped_reply_never_comes(model_dir):
    async def scenario():
        async with pair(model_dir, [DropReply(When(first_step=1, last_step=1))]) as p:
            honest, faulty = await p.sessions()
            await faulty.step(inputs(3, 0, 0))
            await honest.step(inputs(3, 0, 0))
            await honest.step(inputs(1, 3, 1))
            with pytest.raises(RequestTimeout):
                await faulty.step(inputs(1, 3, 1), timeout=0.5)
            return p.record.entries(), p.faulty.server.counters.steps

    record, steps = run(scenario(), 30)
    assert steps == 2  # the step ran; only its reply was dropped
    assert [(e.fault, e.step, e.positions) for e in record] == [("drop_reply", 1, (3, 4))]


def test_replies_dropped_with_a_seeded_probability(model_dir):
    forwards, seed = 8, 4

    async def scenario():
        async with pair(model_dir, [DropReply(When(probability=0.5, seed=seed))]) as p:
            lost = []
            for i in range(forwards):
                message = Message("forward", 1, tensors=inputs(2, 0, i))
                await p.client.request(p.honest.ticket, BLOCKS, message, timeout=5.0)
                try:
                    await p.client.request(p.faulty.ticket, BLOCKS, message, timeout=0.25)
                except RequestTimeout:
                    lost.append(i)
            return lost, p.record.entries()

    lost, record = run(scenario(), 30)
    draws = random.Random(seed)
    assert lost == [i for i in range(forwards) if draws.random() < 0.5]  # one seeded draw per step, in order
    assert 0 < len(lost) < forwards
    assert [(e.fault, e.step, e.session) for e in record] == [("drop_reply", i, None) for i in lost]


def test_an_in_process_crash_closes_the_node(model_dir):
    async def scenario():
        async with pair(model_dir, [Crash(step=1)]) as p:
            _, faulty = await p.sessions()
            await faulty.step(inputs(3, 0, 0))
            with pytest.raises(ClosedError):
                await faulty.step(inputs(1, 3, 1), timeout=5.0)
            with pytest.raises(ConnectTimeout):
                await p.client.request(p.faulty.ticket, BLOCKS, Message("info", 1), timeout=0.3)
            await p.client.request(p.honest.ticket, BLOCKS, Message("info", 1), timeout=5.0)
            return p.record.entries(), p.faulty.node.closed

    record, closed = run(scenario(), 30)
    assert closed
    assert [(e.fault, e.step, e.session, e.positions) for e in record] == [("crash", 1, 0, (3, 4))]


@pytest.mark.slow
def test_a_server_process_crashes_at_step_n(model_dir, tmp_path):
    record_path = tmp_path / "record.jsonl"
    flags = fault_flags(Crash(step=2), record=record_path)
    args = faulty_server_args(serve_args(model_dir, SPAN, "--num-threads", "1", *flags))
    assert args[:2] == ["-m", "testkit.faulty_server"]
    server = ServerProcess(args, ready_timeout=60, env={"OMP_NUM_THREADS": "1"})
    try:

        async def scenario():
            async with await Node.start(TransportConfig(bind_addr="127.0.0.1:0")) as node:
                session = await Session.open(node, server.ticket)
                await session.step(inputs(3, 0, 0))
                await session.step(inputs(1, 3, 1))
                with pytest.raises(ShoalError):  # no reply: the process died (it sent no close either)
                    await session.step(inputs(1, 4, 2), timeout=1.5)

        run(scenario(), 30)
        assert server.proc.wait(10) == CRASH_EXIT_CODE
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)
    assert [(e.fault, e.step, e.session, e.positions) for e in FaultRecord.read(record_path)] == [
        ("crash", 2, 0, (4, 5))
    ]


def test_the_backend_checks_pass_through_unchanged(model_dir):
    async def scenario():
        async with pair(model_dir, [Noise(0.5), StaleCache()]) as p:
            errors = []
            for session in await p.sessions():
                wrong_width = [torch.zeros(1, 2, HIDDEN + 1), torch.arange(2)[None]]
                with pytest.raises(BadRequest) as width:
                    await session.step(wrong_width)
                session.position = 31
                with pytest.raises(BadRequest) as past_end:
                    await session.step(inputs(2, 0, 0))
                errors.append((str(width.value), str(past_end.value)))
            return errors, p.record.entries()

    (honest, faulty), record = run(scenario(), 30)
    assert faulty == honest
    assert record == []  # refused steps alter nothing


def test_faults_travel_as_json():
    faults = [
        ReplyDelay(0.15),
        DropReply(When(first_step=2, every=3, probability=0.5, seed=1)),
        Crash(step=4),
        Noise(0.1, seed=2, when=When(from_position=5)),
        Zeros(),
        Identity(),
        SkipBlock(1),
        OtherWeights(block=0, relative=0.2),
        StaleCache(When(last_step=3)),
        Equivocate(0.3),
    ]
    assert decode_faults(encode_faults(faults)) == faults
    assert decode_faults('[{"fault": "reply_delay", "seconds": 0.15}]') == [ReplyDelay(0.15)]
    with pytest.raises(ValueError, match="bogus"):
        decode_faults('[{"fault": "bogus"}]')
    with pytest.raises(ValueError, match="seconds"):
        decode_faults('[{"fault": "reply_delay", "seconds": "soon"}]')
    with pytest.raises(ValueError, match="every"):
        When(every=0)
    plain = ["-m", "shoal.cli.main", "serve", "model", "--blocks", "0:3"]
    assert faulty_server_args(plain) == plain
    assert faulty_server_args([*plain, *fault_flags(Zeros())]) == [
        "-m", "testkit.faulty_server", "model", "--blocks", "0:3", "--faults", '[{"fault":"zeros"}]',
    ]  # fmt: skip


def test_a_malformed_reply_is_a_clear_wire_error_and_recorded(model_dir):
    async def scenario():
        async with pair(model_dir, [Malformed(When(first_step=1, last_step=1))]) as p:
            honest, faulty = await p.sessions()
            await faulty.step(inputs(3, 0, 0))
            await honest.step(inputs(3, 0, 0))
            with pytest.raises(WireError):
                await faulty.step(inputs(1, 3, 1), timeout=5.0)
            return p.record.entries(), p.faulty.server.counters.steps

    record, steps = run(scenario(), 30)
    assert steps == 2  # the step ran; its reply went out as garbage
    assert [(e.fault, e.step, e.positions) for e in record] == [("malformed", 1, (3, 4))]
