"""The client asks a server to push only when it and the next server announced ``push``.

The decision itself (:func:`shoal.client.remote.driver.push_reach`), and what a session actually sends
through real servers in this process (:class:`shoal.launch.InProcessSwarm`), some of which announce
capabilities without ``push`` (their ``info`` says so; nothing else about them changes). Each
server records what reaches it: which steps came from the client (with which push route) and
which pushes from another server. Outputs equal plain ``transformers`` either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import torch

from shoal.client.remote.driver import push_reach
from shoal.ids import BlockRange, PeerId
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.routing import RouteInfo, ServerSpan
from shoal.server.handler import BlockServer
from shoal.transport import MessageStream
from shoal.wire import Message
from shoal.wire.schema import CAPABILITIES, CODEC_RAW, PUSH, PushRequest, StepRequest
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.inprocess import blocks_output, no_server_errors  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_server_errors")]

P = frozenset({PUSH})
NONE = frozenset()


def spans(*capabilities: frozenset[str]) -> list[ServerSpan]:
    return [
        ServerSpan(PeerId(f"peer{i}"), BlockRange(i, i + 1), None, RouteInfo(capabilities=caps))
        for i, caps in enumerate(capabilities)
    ]


@pytest.mark.parametrize(
    ("capabilities", "enabled", "expected"),
    [
        ((P, P, P), True, [2, 2, 2]),  # one segment, pushed end to end
        ((P, P, P), False, [0, 1, 2]),  # push turned off: the client drives every hop
        ((P, NONE, P), True, [0, 1, 2]),  # the middle server can neither receive nor send a push
        ((P, P, NONE), True, [1, 1, 2]),  # the last one cannot receive: the push stops before it
        ((NONE, P, P), True, [0, 2, 2]),  # the first cannot send: pushed from the second on
        ((P, P, NONE, P, P), True, [1, 1, 2, 4, 4]),
        ((P,), True, [0]),
        ((), True, []),
    ],
)
def test_push_reach(capabilities, enabled, expected):
    assert push_reach(spans(*capabilities), enabled) == expected


# ---- real servers ----------------------------------------------------------------------------------
SPANS = {"a": BlockRange(0, 1), "b": BlockRange(1, 2), "c": BlockRange(2, 4)}
WITHOUT_PUSH = frozenset({CODEC_RAW})  # what a server that cannot push announces
PROMPT, STEPS = 4, 3


@pytest.fixture(scope="module")
def reference():
    return tiny_model("llama", seed=7)


@pytest.fixture(scope="module")
def model_dir(reference, tmp_path_factory):
    return save_checkpoint(reference, tmp_path_factory.mktemp("tiny-capabilities"))


class _Tap:
    """A stream the server reads through, noting every message it receives and from whom."""

    def __init__(self, inner: MessageStream, peer_id: str, received: list[tuple[str, Message]]):
        self._inner, self._peer_id, self._received = inner, peer_id, received

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def recv(self, timeout: float | None = None) -> Message:
        message = await self._inner.recv(timeout)
        self._received.append((self._peer_id, message))
        return message


@dataclass
class Recording:
    """Turns a loaded server into one that announces ``capabilities`` and records what it receives."""

    capabilities: frozenset[str]
    received: list[tuple[str, Message]] = field(default_factory=list)

    def __call__(self, server: BlockServer) -> BlockServer:
        server.info = msgspec.structs.replace(server.info, capabilities=self.capabilities)
        handle = server.handle

        async def recording_handle(stream: MessageStream, peer_id: str) -> None:
            await handle(_Tap(stream, peer_id, self.received), peer_id)

        server.handle = recording_handle
        return server

    def steps_from(self, peer: str) -> list[StepRequest]:
        return [m.meta for p, m in self.received if p == peer and m.kind == "step"]

    def pushes(self) -> list[PushRequest]:
        return [m.meta for _, m in self.received if m.kind == "push"]


@dataclass
class Generated:
    got: torch.Tensor
    expected: torch.Tensor
    servers: dict[str, LocalServer]
    recordings: dict[str, Recording]
    client: str  # the client node's peer id

    def client_steps(self, name: str) -> list[StepRequest]:
        return self.recordings[name].steps_from(self.client)

    def counter(self, name: str, counter: str) -> int:
        return getattr(self.servers[name].server.counters, counter)


@pytest.fixture
def generate(model_dir, reference):
    """``generate(caps_a, caps_b, caps_c, push=True)``: three servers a (0:1), b (1:2), c (2:4)
    announcing those capabilities; a session of a 4-position prefill then 3 one-token steps."""
    swarms: list[InProcessSwarm] = []

    def run(*capabilities: frozenset[str], push: bool = True, verify: str = "off") -> Generated:
        swarm = InProcessSwarm(model_dir, [])
        swarms.append(swarm)
        recordings = {name: Recording(caps) for name, caps in zip(SPANS, capabilities, strict=True)}
        servers = {name: swarm.add(span, recordings[name]) for name, span in SPANS.items()}
        # verify="off" unless asked: these tests are of push reach, which audit mode narrows (see below)
        model = swarm.connect(push=push, refresh_period=0, routing_seed=0, verify=verify)
        session = model.blocks.open_session(batch_size=1, max_length=16)
        assert [s.peer_id for s in session.chain] == [servers[n].node.id for n in SPANS]
        x = torch.randn(1, PROMPT + STEPS, 64, generator=torch.Generator().manual_seed(7))
        outputs = [session.step(x[:, :PROMPT], torch.arange(PROMPT).view(1, -1), None)]
        for t in range(PROMPT, PROMPT + STEPS):
            outputs.append(session.step(x[:, t : t + 1], torch.tensor([[t]]), None))
        session.close()
        got = torch.cat(outputs, dim=1)
        return Generated(got, blocks_output(reference, x), servers, recordings, model.blocks.node.id)

    yield run
    for swarm in swarms:
        swarm.close()


def assert_matches(run: Generated) -> None:
    scale = float(run.expected.abs().max())
    torch.testing.assert_close(run.got, run.expected, rtol=0, atol=1e-4 * scale)


def test_all_push_capable_the_client_sends_only_to_the_first(generate):
    run = generate(CAPABILITIES, CAPABILITIES, CAPABILITIES)
    assert_matches(run)
    assert [len(run.client_steps(n)) for n in SPANS] == [4, 0, 0]
    routes = [[(hop.ticket, hop.session) for hop in step.push] for step in run.client_steps("a")]
    pushed = {n: {p.session for p in run.recordings[n].pushes()} for n in "bc"}
    assert all(len(pushed[n]) == 1 for n in "bc")  # every push into the one session each opened
    b_ticket, c_ticket = (str(run.servers[n].ticket) for n in "bc")
    assert routes == [[(b_ticket, *pushed["b"]), (c_ticket, *pushed["c"])]] * 4
    assert [run.counter(n, "pushes_received") for n in SPANS] == [0, 4, 4]
    assert [run.counter(n, "pushes_sent") for n in SPANS] == [4, 4, 0]
    assert [run.counter(n, "steps") for n in SPANS] == [4, 4, 4]


def test_a_server_without_push_gets_no_push_and_the_client_drives_its_hops(generate):
    """b did not announce ``push``: a's steps carry no push hops (a may not push to b), b's none
    (it cannot push), and the client sends every hop its step itself."""
    run = generate(CAPABILITIES, WITHOUT_PUSH, CAPABILITIES)
    assert_matches(run)
    assert [len(run.client_steps(n)) for n in SPANS] == [4, 4, 4]
    assert all(step.push == () for n in SPANS for step in run.client_steps(n))
    assert [run.counter(n, "pushes_received") for n in SPANS] == [0, 0, 0]
    assert [run.counter(n, "pushes_sent") for n in SPANS] == [0, 0, 0]
    assert run.recordings["b"].pushes() == []
    assert [step.position for step in run.client_steps("b")] == [0, 4, 5, 6]


def test_push_stops_before_a_server_that_cannot_receive_it(generate):
    run = generate(CAPABILITIES, CAPABILITIES, WITHOUT_PUSH)
    assert_matches(run)
    assert [len(run.client_steps(n)) for n in SPANS] == [4, 0, 4]
    b_ticket = str(run.servers["b"].ticket)
    assert all([hop.ticket for hop in step.push] == [b_ticket] for step in run.client_steps("a"))
    assert all(step.push == () for step in run.client_steps("c"))
    assert all(push.push == () for push in run.recordings["b"].pushes())  # b is not asked to push on to c
    assert run.recordings["c"].pushes() == []
    assert [run.counter(n, "pushes_received") for n in SPANS] == [0, 4, 0]
    assert [run.counter(n, "pushes_sent") for n in SPANS] == [4, 0, 0]


def test_a_first_server_without_push_is_sent_no_route_and_the_rest_is_pushed(generate):
    run = generate(WITHOUT_PUSH, CAPABILITIES, CAPABILITIES)
    assert_matches(run)
    assert [len(run.client_steps(n)) for n in SPANS] == [4, 4, 0]
    assert all(step.push == () for step in run.client_steps("a"))
    c_ticket = str(run.servers["c"].ticket)
    assert all([hop.ticket for hop in step.push] == [c_ticket] for step in run.client_steps("b"))
    assert [run.counter(n, "pushes_received") for n in SPANS] == [0, 0, 4]
    assert [run.counter(n, "pushes_sent") for n in SPANS] == [0, 4, 0]


def test_audit_mode_pushes_only_over_hops_whose_receipts_pin_their_inputs(generate):
    """Audit mode (the default) compares a hop's outputs with an auditor's on the inputs recorded for
    it; a pushed hop's receipts prove it computed on those. c announces no receipts, so the client
    sends every hop itself, and the answer is the same."""
    run = generate(CAPABILITIES, CAPABILITIES, WITHOUT_PUSH, verify="audit")
    assert_matches(run)
    assert [len(run.client_steps(n)) for n in SPANS] == [4, 4, 4]
    assert [run.counter(n, "pushes_sent") for n in SPANS] == [0, 0, 0]


def test_push_off_sends_every_hop_from_the_client(generate):
    run = generate(CAPABILITIES, CAPABILITIES, CAPABILITIES, push=False)
    assert_matches(run)
    assert [len(run.client_steps(n)) for n in SPANS] == [4, 4, 4]
    assert all(step.push == () for n in SPANS for step in run.client_steps(n))
    assert [run.counter(n, "pushes_received") for n in SPANS] == [0, 0, 0]
