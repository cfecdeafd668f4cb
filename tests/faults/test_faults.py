"""Every fault of testkit's fault seam does exactly what it says, and the faulty server's own record
says what it did.

Each test serves a faulty server and an honest replica of the same blocks of a tiny random llama
(3 blocks, hidden 64) in this process, over the in-memory transport, sends both the same inputs and
compares the answers. One test crashes a server process (``python -m testkit.faulty_server``).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from shoal.checkpoints import load_span
from shoal.errors import BadRequest, ClosedError, ConnectTimeout, RequestTimeout, ShoalError, WireError
from shoal.ids import BlockRange
from shoal.launch import ServerProcess, serve_args
from shoal.protocols import BLOCKS
from shoal.server.builder import load_block_server
from shoal.server.config import ServerConfig
from shoal.server.handler import BlockServer
from shoal.server.preflight import check_server
from shoal.transport import BaseNode, MemoryNetwork, MessageStream, Node, Ticket, TransportConfig
from shoal.verify.tokens import push_token
from shoal.wire import Message
from shoal.wire.schema import OpenReply, OpenRequest, PushHop, StepReply, StepRequest
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
from testkit.faulty import LocalServer, make_faulty, perturbed_copy, serve_locally
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.aio import run

pytestmark = pytest.mark.timeout(60)

HIDDEN = 64
SPAN = (0, 3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = tiny_model("llama", seed=21, num_hidden_layers=3)
    return save_checkpoint(model, tmp_path_factory.mktemp("faults-model"))


def load(model_dir: Path, start: int, end: int, faults: list | None = None) -> Callable[[BaseNode], BlockServer]:
    """Builds a server of blocks ``start:end`` for a node (made faulty with ``faults``, if any)."""
    blocks = BlockRange(start, end)
    checked = check_server(ServerConfig(model=str(model_dir), blocks=blocks, cache_tokens=256))

    def build(node: BaseNode) -> BlockServer:
        server = load_block_server(checked, blocks, node)
        return make_faulty(server, faults) if faults is not None else server

    return build


def inputs(n: int, start: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, HIDDEN, generator=generator), torch.arange(start, start + n)[None]]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


class Session:
    """One session on one server, driven over the stream that opened it."""

    def __init__(self, stream: MessageStream, opened: OpenReply):
        self.stream, self.opened, self.position = stream, opened, 0
        self.last_id = 0  # the id of the latest step sent

    @classmethod
    async def open(cls, node: BaseNode, ticket: Ticket, max_length: int = 32) -> Session:
        stream = await node.open_stream(ticket, BLOCKS, timeout=5.0)
        reply = await stream.request(Message("open", 1, OpenRequest(max_length=max_length)), timeout=5.0)
        return cls(stream, reply.reply(OpenReply))

    def hop(self, ticket: Ticket, previous: str) -> Callable[[int, int, int], PushHop]:
        """Where the previous server (peer id ``previous``) pushes into this session (at ``ticket``):
        the hop for a step (its id, position and positions), with the token for that step."""

        def bound(step: int, position: int, n: int) -> PushHop:
            token = push_token(self.opened.token, previous, step=step, position=position, n=n, receipt=False)
            return PushHop(ticket=str(ticket), session=self.opened.session, token=token)

        return bound

    async def step(
        self, tensors: list[torch.Tensor], push: Sequence[Callable[[int, int, int], PushHop]] = (), timeout: float = 5.0
    ):
        self.last_id = self.stream.next_id()
        route = tuple(hop(self.last_id, self.position, tensors[0].shape[1]) for hop in push)
        meta = StepRequest(session=self.opened.session, position=self.position, push=route)
        reply = await self.stream.request(Message("step", self.last_id, meta, tensors), timeout)
        self.position += tensors[0].shape[1]
        assert reply.reply(StepReply).position == self.position
        return reply.tensors[0]


@dataclass
class Pair:
    """A faulty server and an honest replica of the same blocks, and a client of both."""

    honest: LocalServer
    faulty: LocalServer
    client: BaseNode
    network: MemoryNetwork

    @property
    def record(self) -> FaultRecord:
        return self.faulty.server.record

    async def sessions(self) -> tuple[Session, Session]:
        return await Session.open(self.client, self.honest.ticket), await Session.open(self.client, self.faulty.ticket)

    async def drive(self, sizes: Sequence[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Steps of ``sizes`` new positions, the same to both: (input, honest output, faulty output) each."""
        honest, faulty = await self.sessions()
        out = []
        for i, n in enumerate(sizes):
            tensors = inputs(n, honest.position, seed + i)
            out.append((tensors[0], await honest.step(tensors), await faulty.step(tensors)))
        return out


@contextlib.asynccontextmanager
async def pair(model_dir: Path, faults, span: tuple[int, int] = SPAN) -> AsyncIterator[Pair]:
    network = MemoryNetwork()
    servers = []
    try:
        servers.append(await serve_locally(load(model_dir, *span), network))
        servers.append(await serve_locally(load(model_dir, *span, faults), network))
        yield Pair(*servers, await network.start(), network)
    finally:
        for server in servers:
            await server.close()


def test_noise_has_the_relative_size_asked_and_is_recorded(model_dir):
    async def scenario():
        async with pair(model_dir, [Noise(0.1, seed=1)]) as p:
            return await p.drive([5, 1, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    ratios = [relative(faulty, honest) for _, honest, faulty in steps]
    assert all(0.05 <= r <= 0.2 for r in ratios), ratios
    assert [(e.fault, e.step, e.session, e.positions, e.blocks) for e in record] == [
        ("noise", 0, 0, (0, 5), SPAN),
        ("noise", 1, 0, (5, 6), SPAN),
        ("noise", 2, 0, (6, 7), SPAN),
    ]
    for entry, ratio in zip(record, ratios, strict=True):
        assert entry.size == pytest.approx(0.1, abs=1e-4) and ratio == pytest.approx(entry.size, abs=1e-3)


def test_zeros_and_identity_answer_exactly_that(model_dir):
    async def scenario(fault):
        async with pair(model_dir, [fault]) as p:
            return await p.drive([4, 1]), p.record.entries()

    for _, honest, faulty in run(scenario(Zeros()), 30)[0]:
        assert torch.equal(faulty, torch.zeros_like(honest)) and honest.abs().max() > 0.1
    steps, record = run(scenario(Identity()), 30)
    for hidden, honest, faulty in steps:
        assert torch.equal(faulty, hidden) and relative(honest, hidden) > 0.1
    assert [(e.fault, e.step, e.positions) for e in record] == [("identity", 0, (0, 4)), ("identity", 1, (4, 5))]


def test_composed_output_faults_apply_in_order(model_dir):
    async def scenario():
        async with pair(model_dir, [Identity(), Noise(0.2, seed=5)]) as p:
            return await p.drive([3, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    for hidden, _, faulty in steps:
        assert 0.1 <= relative(faulty, hidden) <= 0.4  # noise relative to the input it replaced the output with
    assert [(e.fault, e.step) for e in record] == [("identity", 0), ("noise", 0), ("identity", 1), ("noise", 1)]


def reference_chain(model_dir: Path, block: int, replace=None):
    """Blocks 0:3 of the checkpoint as separate one-block spans, block ``block`` left out
    (``replace`` None) or swapped for ``replace(layer)``; returns a stepper with caches."""
    spans = []
    for i in range(*SPAN):
        span, _ = load_span(model_dir, i, i + 1)
        if i == block and replace is None:
            continue
        if i == block:
            span.layers[0] = replace(span.layers[0])
        spans.append((span, span.allocate_cache(1, 32)))

    @torch.inference_mode()
    def step(hidden: torch.Tensor, position_ids: torch.Tensor, past: int) -> torch.Tensor:
        for span, cache in spans:
            hidden = span(hidden, position_ids, None, cache=cache, past_length=past)
        return hidden

    return step


def check_against(reference, steps) -> None:
    past = 0
    for hidden, honest, faulty in steps:
        n = hidden.shape[1]
        expected = reference(hidden, torch.arange(past, past + n)[None], past)
        torch.testing.assert_close(faulty, expected, atol=1e-4, rtol=0)
        assert relative(faulty, honest) > 1e-2  # the fault did change the answer
        past += n


def test_a_skipped_block_answers_what_the_other_blocks_compute(model_dir):
    async def scenario():
        async with pair(model_dir, [SkipBlock(1)]) as p:
            return await p.drive([4, 1, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    check_against(reference_chain(model_dir, block=1), steps)
    assert [(e.fault, e.step, e.blocks, e.positions) for e in record] == [
        ("skip_block", 0, (1, 2), (0, 4)),
        ("skip_block", 1, (1, 2), (4, 5)),
        ("skip_block", 2, (1, 2), (5, 6)),
    ]


def test_other_weights_run_one_block_with_its_perturbed_copy(model_dir):
    fault = OtherWeights(block=1, relative=0.5, seed=3)

    async def scenario():
        async with pair(model_dir, [fault]) as p:
            return await p.drive([4, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    original = load_span(model_dir, 1, 2)[0].layers[0]
    perturbed = perturbed_copy(original, fault.relative, fault.seed)
    for (name, before), (_, after) in zip(original.named_parameters(), perturbed.named_parameters(), strict=True):
        assert relative(after, before) == pytest.approx(0.5, abs=1e-4), name
    check_against(reference_chain(model_dir, block=1, replace=lambda layer: perturbed), steps)
    assert [(e.fault, e.step, e.blocks) for e in record] == [("other_weights", 0, (1, 2)), ("other_weights", 1, (1, 2))]


def test_every_nth_step_only_those_steps_differ(model_dir):
    async def scenario():
        async with pair(model_dir, [Noise(0.2, seed=2, when=When(first_step=1, every=2))]) as p:
            return await p.drive([3, 1, 1, 1, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    differs = [relative(faulty, honest) > 0.1 for _, honest, faulty in steps]
    assert differs == [False, True, False, True, False]
    for (_, honest, faulty), hit in zip(steps, differs, strict=True):
        if not hit:
            torch.testing.assert_close(faulty, honest, atol=1e-5, rtol=0)
    assert [(e.fault, e.step) for e in record] == [("noise", 1), ("noise", 3)]


def test_steps_are_counted_per_session(model_dir):
    async def scenario():
        async with pair(model_dir, [Zeros(when=When(last_step=0))]) as p:
            sessions = [await Session.open(p.client, p.faulty.ticket) for _ in range(2)]
            answers = []
            for i in range(2):  # step 0 of both sessions, then step 1 of both
                for session in sessions:
                    answers.append(await session.step(inputs(2, session.position, i)))
            return answers, p.record.entries()

    answers, record = run(scenario(), 30)
    assert [bool((a == 0).all()) for a in answers] == [True, True, False, False]
    assert [(e.session, e.step) for e in record] == [(0, 0), (1, 0)]


def test_after_position_p_earlier_positions_match(model_dir):
    async def scenario():
        async with pair(model_dir, [Noise(0.3, seed=4, when=When(from_position=3))]) as p:
            return await p.drive([5, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    (_, honest0, faulty0), (_, honest1, faulty1) = steps
    torch.testing.assert_close(faulty0[:, :3], honest0[:, :3], atol=1e-4, rtol=0)
    for position in (3, 4):
        assert relative(faulty0[:, position], honest0[:, position]) > 0.05
    assert relative(faulty1, honest1) > 0.1
    assert [(e.step, e.positions) for e in record] == [(0, (3, 5)), (1, (5, 6))]
    assert all(e.size == pytest.approx(0.3, abs=1e-4) for e in record)


def test_a_stale_cache_answers_right_once_then_wrong(model_dir):
    async def scenario():
        async with pair(model_dir, [StaleCache()]) as p:
            return await p.drive([4, 1, 1]), p.record.entries()

    steps, record = run(scenario(), 30)
    (_, honest0, faulty0), *later = steps
    torch.testing.assert_close(faulty0, honest0, atol=1e-5, rtol=0)  # its own positions were in the copy
    for _, honest, faulty in later:
        assert relative(faulty, honest) > 1e-2  # they attend to slots never written
    assert [(e.fault, e.step, e.positions) for e in record] == [
        ("stale_cache", 0, (0, 4)),
        ("stale_cache", 1, (4, 5)),
        ("stale_cache", 2, (5, 6)),
    ]


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
