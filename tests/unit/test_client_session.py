"""Remote sessions surviving failures, on real servers in this process (:class:`shoal.launch.InProcessSwarm`
over the in-memory transport): a killed, silent or reply-dropping server is replaced and the
replacement replayed, a draining one is moved after its reply, outputs equal plain ``transformers``
throughout (within 1e-4; generated tokens exactly), and routing hears about it all through
:class:`~shoal.client.remote.feedback.RouteFeedback`. SIGKILLed server processes: tests/routing/test_failover.py.

Four servers of a tiny random llama (4 blocks): two replicas of blocks 0:2 (``A``) and two of 2:4
(``B``). Which replica a fresh session runs on depends on measured round trips, so tests ask the
session's chain (:meth:`Run.on_route`) instead of assuming one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

import pytest
import torch
from torch import Tensor
from transformers import LogitsProcessorList

import shoal.client.remote.directory as directory_module
from shoal.client.remote.recovery import RecoveryRecord
from shoal.errors import BadRequest
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer, Prepare
from shoal.routing import NoRouteError
from shoal.transport import TransportConfig
from shoal.transport.config import Deadlines
from testkit.faults import DropReply, When
from testkit.faulty import make_faulty
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.inprocess import blocks_output, no_server_errors, wait_until  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_server_errors")]

A, B = BlockRange(0, 2), BlockRange(2, 4)
HIDDEN = 64
PREFILL = 5
MAX_LENGTH = 32
ATOL = 1e-4


@pytest.fixture(scope="module")
def reference():
    return tiny_model("llama", seed=5)


@pytest.fixture(scope="module")
def model_dir(reference, tmp_path_factory):
    return save_checkpoint(reference, tmp_path_factory.mktemp("tiny-sessions"))


@pytest.fixture
def swarms(model_dir):
    """``swarms(spans=(A, A, B, B), prepare={span: Prepare})``: fresh servers, closed after the test."""
    made: list[InProcessSwarm] = []

    def make(spans: Sequence[BlockRange] = (A, A, B, B), prepare: Mapping[BlockRange, Prepare] = {}):
        swarm = InProcessSwarm(model_dir, [])
        made.append(swarm)
        for span in spans:
            swarm.add(span, prepare.get(span))
        return swarm

    yield make
    for swarm in made:
        swarm.close()


def hidden(total: int, batch: int = 1, seed: int = 3) -> Tensor:
    return torch.randn(batch, total, HIDDEN, generator=torch.Generator().manual_seed(seed))


def assert_close(got: Tensor, expected: Tensor) -> None:
    """Within 1e-4 of the outputs' scale: the tiny model's hidden states reach |x| ~ 100, where
    float32 resolution alone is ~1e-5 (a replay or cache mistake is off by O(1))."""
    assert got.shape == expected.shape
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL * scale)


class Run:
    """A client of ``swarm`` with one session, fed ``x`` token by token after a prefill;
    ``at[t]`` runs before the step of position ``t``."""

    def __init__(self, swarm: InProcessSwarm, *, push: bool = True, batch_size: int = 1, **connect):
        self.swarm = swarm
        # verify="off" unless asked: these tests count each server's sessions and positions, which an
        # auditor on the spare would add to (recovery under audits: the tests that pass verify="audit")
        connect.setdefault("verify", "off")
        self.model = swarm.connect(push=push, refresh_period=0, routing_seed=0, **connect)
        self.sequence = self.model.blocks
        self.directory = self.sequence.directory
        self.session = self.sequence.open_session(batch_size=batch_size, max_length=MAX_LENGTH)

    def by_peer(self, peer: str) -> LocalServer:
        return next(s for s in self.swarm.servers if s.node.id == peer)

    def route(self) -> list[LocalServer]:
        return [self.by_peer(span.peer_id) for span in self.session.chain]

    def on_route(self, blocks: BlockRange) -> LocalServer:
        return next(s for s in self.route() if s.blocks == blocks)

    def spare(self, blocks: BlockRange) -> LocalServer:
        """The other live server of ``blocks`` (not the one on the route)."""
        used = self.on_route(blocks)
        return next(s for s in self.swarm.servers if s.blocks == blocks and s is not used and s.alive)

    def feed(self, x: Tensor, start: int = 0, at: Mapping[int, Callable[[], object]] | None = None) -> Tensor:
        outputs, t = [], start
        batch = x.shape[0]
        if start == 0:
            outputs.append(self.session.step(x[:, :PREFILL], torch.arange(PREFILL).expand(batch, -1), None))
            t = PREFILL
        while t < x.shape[1]:
            if at and t in at:
                at[t]()
            outputs.append(self.session.step(x[:, t : t + 1], torch.full((batch, 1), t), None))
            t += 1
        return torch.cat(outputs, dim=1)

    def close(self) -> None:
        """Close the session; every live server then holds no session (aborted hops settle async)."""
        self.session.close()
        for server in self.swarm.servers:
            if server.alive:
                wait_until(lambda s=server: s.server.counters.sessions_active == 0, what=f"{server.blocks} freed")


def positions(server: LocalServer) -> int:
    return server.server.counters.positions_processed


def start_drain(swarm: InProcessSwarm, server: LocalServer, timeout: float) -> asyncio.Future:
    """Start ``server``'s drain without waiting for it (the client keeps stepping meanwhile)."""
    future = asyncio.run_coroutine_threadsafe(server.server.drain(timeout), swarm.runtime.loop)
    wait_until(lambda: server.server.draining, what="draining")
    return future


# ---- a server dies ---------------------------------------------------------------------------------
@pytest.mark.parametrize("push", [True, False], ids=["push", "driven"])
@pytest.mark.parametrize("victim", ["A", "B"])
def test_a_killed_server_is_replaced_and_its_spare_replayed(swarms, reference, victim, push):
    swarm = swarms()
    run = Run(swarm, push=push)
    span, other_span = (A, B) if victim == "A" else (B, A)
    dead, spare = run.on_route(span), run.spare(span)
    kept, unused = run.on_route(other_span), run.spare(other_span)
    x = hidden(12)
    got = run.feed(x, at={8: lambda: swarm.kill(dead)})
    assert_close(got, blocks_output(reference, x))
    assert run.route() == ([spare, kept] if victim == "A" else [kept, spare])
    assert run.sequence.chain == run.session.chain  # the sequence asks the session
    (record,) = run.session.recoveries
    assert isinstance(record, RecoveryRecord)
    assert record.failed == dead.node.id and record.blocks == span and not record.drain
    assert record.position == 8 and dict(record.replayed) == {spare.node.id: 8}
    assert positions(spare) == 12  # the 8 replayed, then the 4 that followed
    assert positions(kept) == 12  # kept its session: no replay, no step twice
    assert positions(unused) == 0
    assert run.directory.bans.banned(dead.node.id)
    run.close()


def test_greedy_generation_survives_a_killed_server_token_for_token(swarms, reference):
    """``generate`` (push on) loses the server of blocks 2:4 after 4 new tokens: the tokens equal
    plain transformers' greedy ones, and the session was recovered once."""
    swarm = swarms()
    model = swarm.connect(refresh_period=0, routing_seed=0, verify="off")  # the spare's counts: the replacement's
    prompt = torch.tensor([[1, 17, 42, 99, 7, 3]])
    killed = []

    def kill_after_four(input_ids: Tensor, scores: Tensor) -> Tensor:
        if input_ids.shape[1] == prompt.shape[1] + 4 and not killed:
            (victim,) = [s for s in swarm.servers if s.node.id == model.blocks.chain[1].peer_id]
            killed.append(swarm.kill(victim))
        return scores

    processors = LogitsProcessorList([kill_after_four])
    got = model.generate(prompt, max_new_tokens=12, do_sample=False, logits_processor=processors)
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, expected)
    (victim,) = killed
    (spare,) = [s for s in swarm.servers if s.blocks == B and s is not victim]
    assert model.blocks.chain[1].peer_id == spare.node.id
    assert spare.server.counters.sessions_opened == 1 and positions(spare) == prompt.shape[1] + 11
    assert model.blocks.directory.bans.banned(victim.node.id)


@pytest.mark.parametrize("verify", ["off", "audit"])
def test_a_server_that_goes_quiet_mid_step_is_found_out_by_a_ping(swarms, reference, monkeypatch, verify):
    """From position 7 on, the server of B on the route answers nothing in time (its replies, pings
    included, are held back: the fault seam's reply delay switched on mid-session) but its streams
    stay open. The pushed step's late reply makes the client ping it, the ping times out, and the
    spare takes over: within the late-reply deadline plus the ping's timeout (0.25 s each here),
    not the request deadline. Audited too: the replacement's new auditor is never the server just
    found quiet (a dial of it would hold the step up for the recovery timeout)."""
    monkeypatch.setattr(directory_module, "PROBE_TIMEOUT", 0.25)
    swarm = swarms(prepare={B: lambda server: make_faulty(server, [])})
    run = Run(swarm, verify=verify)
    quiet, spare = run.on_route(B), run.spare(B)
    times = {}

    def go_quiet() -> None:
        quiet.server.fault_state.delay = 30.0
        times["quiet"] = time.perf_counter()

    x = hidden(10)
    got = run.feed(x, at={7: go_quiet, 8: lambda: times.setdefault("next", time.perf_counter())})
    assert_close(got, blocks_output(reference, x))
    assert run.route()[1] is spare
    (record,) = run.session.recoveries
    assert record.failed == quiet.node.id and record.position == 7 and dict(record.replayed) == {spare.node.id: 7}
    assert 0.45 <= times["next"] - times["quiet"] < 1.0
    assert quiet.server.record.entries("reply_delay")  # the seam did hold replies back


@pytest.mark.parametrize("push", [True, False], ids=["push", "driven"])
def test_a_dropped_reply_is_recovered(swarms, reference, push):
    """The server of B on the route runs its 4th step (position 7) but never sends the reply. Pushed:
    the late reply makes the client ping it, it answers, so the push (or its reply) was lost: the
    client sends it the step itself and the session goes on on the same servers. Driven: the
    client waits out its request deadline (0.5 s here), then replaces the server like a dead one."""
    drop = [DropReply(When(first_step=3, last_step=3))]
    swarm = swarms(prepare={B: lambda server: make_faulty(server, drop)})
    run = Run(swarm, push=push, transport=TransportConfig(deadlines=Deadlines(request=0.5)))
    dropper, spare = run.on_route(B), run.spare(B)
    spare.server.fault_state.faults = []  # only the server on the route drops a reply
    x = hidden(12)
    got = run.feed(x)
    assert_close(got, blocks_output(reference, x))
    assert dropper.server.record.steps("drop_reply") == [3]
    if push:
        assert run.session.recoveries == [] and run.route()[1] is dropper
        assert dropper.server.counters.steps == 9  # 8 steps, the dropped one twice
        assert positions(spare) == 0 and not run.directory.bans.banned(dropper.node.id)
    else:
        (record,) = run.session.recoveries
        assert record.failed == dropper.node.id and record.position == 7 and run.route()[1] is spare
        assert positions(spare) == 12 and run.directory.bans.banned(dropper.node.id)
    run.close()


# ---- a server leaves -----------------------------------------------------------------------------
def test_a_draining_server_is_moved_before_the_next_step(swarms, reference):
    """The server of B on the route starts draining before position 7: its reply to that step says
    so, the client moves B to the spare before the next step (the leaving server hands it the
    session's 8 positions of KV pages: no replay, :mod:`shoal.server.migrate`) and closes the old
    session politely; the drain then ends at once, long before its 5 s timeout."""
    swarm = swarms()
    run = Run(swarm)
    leaving, spare = run.on_route(B), run.spare(B)
    drains = []
    x = hidden(12)
    got = run.feed(x, at={7: lambda: drains.append((time.perf_counter(), start_drain(swarm, leaving, 5.0)))})
    assert_close(got, blocks_output(reference, x))
    ((started, drain),) = drains
    drain.result(timeout=2.0)
    assert time.perf_counter() - started < 1.0
    (record,) = run.session.recoveries
    assert record.drain and record.failed == leaving.node.id and record.position == 8  # after its reply
    assert dict(record.migrated) == {spare.node.id: 8} and record.replayed == {} and run.route()[1] is spare
    c = leaving.server.counters
    assert c.sessions_closed == 1 and c.sessions_abandoned == 0 and c.sessions_drained == 0
    assert c.sessions_migrated_out == 1 and spare.server.counters.sessions_migrated_in == 1
    assert c.positions_processed == 8 and positions(spare) == 4  # only the steps after the hand-over
    swarm.kill(leaving)
    run.close()


def test_a_draining_server_without_a_replacement_keeps_serving(swarms, reference):
    swarm = swarms(spans=(A, A, B))
    run = Run(swarm)
    leaving = run.on_route(B)
    drain = start_drain(swarm, leaving, 5.0)
    x = hidden(10)
    got = run.feed(x)
    assert_close(got, blocks_output(reference, x))
    assert run.route()[1] is leaving and run.session.recoveries == []
    run.close()
    drain.result(timeout=2.0)  # the session left: nothing to cut off
    assert leaving.server.counters.sessions_closed == 1 and leaving.server.counters.sessions_drained == 0


# ---- no way out, rollback, batches, refused steps ------------------------------------------------
def test_without_a_spare_the_error_names_the_missing_blocks(swarms):
    swarm = swarms(spans=(A, A, B))
    run = Run(swarm, route_wait=0)
    with pytest.raises(NoRouteError, match=r"^no live server left for blocks 2-3$") as caught:
        run.feed(hidden(10), at={7: lambda: swarm.kill(B)})
    assert caught.value.missing == [2, 3]


def test_rollback_then_failover_replays_only_the_kept_positions(swarms, reference):
    """Roll back to position 6, feed other tokens, then lose B's server: the spare's replay holds
    positions 0..5 of the first run and the new ones after, as transformers on the new sequence says."""
    swarm = swarms()
    run = Run(swarm)
    first = hidden(10, seed=1)
    run.feed(first)
    run.session.position = 6
    second = torch.cat([first[:, :6], hidden(6, seed=2)], dim=1)
    dead, spare = run.on_route(B), run.spare(B)
    got = run.feed(second, start=6, at={9: lambda: swarm.kill(dead)})
    assert_close(got, blocks_output(reference, second)[:, 6:])
    (record,) = run.session.recoveries
    assert record.position == 9 and dict(record.replayed) == {spare.node.id: 9}
    run.close()


def test_a_batch_of_two_with_failover(swarms, reference):
    swarm = swarms()
    run = Run(swarm, batch_size=2)
    dead = run.on_route(A)
    x = hidden(9, batch=2)
    got = run.feed(x, at={7: lambda: swarm.kill(dead)})
    assert_close(got, blocks_output(reference, x))
    assert [r.failed for r in run.session.recoveries] == [dead.node.id]
    run.close()


def test_a_bad_request_is_raised_and_leaves_the_session_usable(swarms, reference):
    """A server refusing a step (here: hidden states of the wrong width, which only the server
    checks) is not a failure to route around: the error surfaces, nobody is banned or replaced, and
    the next good step works."""
    swarm = swarms()
    run = Run(swarm)
    x = hidden(8)
    first = run.feed(x[:, :PREFILL])
    route = run.route()
    with pytest.raises(BadRequest, match=r"hidden states must be \[batch, tokens, 64\], got \[1, 1, 32\]"):
        run.session.step(x[:, PREFILL : PREFILL + 1, :32].contiguous(), torch.tensor([[PREFILL]]), None)
    assert run.session.position == PREFILL and run.session.recoveries == [] and run.route() == route
    assert not any(run.directory.bans.failures(s.node.id) for s in swarm.servers)
    rest = run.feed(x, start=PREFILL)
    assert_close(torch.cat([first, rest], dim=1), blocks_output(reference, x))
    assert run.session.recoveries == [] and positions(run.spare(A)) == positions(run.spare(B)) == 0
    assert [positions(s) for s in route] == [8, 8]  # kept their sessions
    run.close()


# ---- what routing hears --------------------------------------------------------------------------
def test_routing_hears_every_one_token_step_and_every_failure_through_route_feedback(swarms, monkeypatch):
    """Every reply to a one-token step reports its latency for that server (the prefill does not),
    every reply a success, and the server that died a failure, through the directory's
    RouteFeedback methods; the latency model then prices each server by what was observed."""
    swarm = swarms()
    run = Run(swarm)
    heard: list[tuple] = []
    for name in ("observed_step", "succeeded", "failed"):
        method = getattr(run.directory, name)

        def spy(*args, _name=name, _method=method):
            heard.append((_name, *args))
            return _method(*args)

        monkeypatch.setattr(run.directory, name, spy)
    a, dead, spare = run.on_route(A), run.on_route(B), run.spare(B)
    run.feed(hidden(9), at={7: lambda: swarm.kill(dead)})
    observed = [(peer, ms) for name, peer, ms in (h for h in heard if h[0] == "observed_step")]
    peers = [a.node.id, dead.node.id] * 2 + [a.node.id, spare.node.id] + [a.node.id, spare.node.id]
    assert [peer for peer, _ in observed] == peers
    assert all(0 < ms < 1000 for _, ms in observed)
    assert [h[1:] for h in heard if h[0] == "failed"] == [(dead.node.id, None)]
    assert {h[1] for h in heard if h[0] == "succeeded"} == {a.node.id, dead.node.id, spare.node.id}
    latency = run.directory.latency
    assert set(latency.observed_ms) == {a.node.id, dead.node.id, spare.node.id}
    chain = run.session.chain
    assert run.directory.expected_step_ms(chain[0]) == latency.observed_ms[a.node.id]
    assert run.directory.bans.banned(dead.node.id)
    run.close()


def test_stateless_forward_reroutes_around_dead_servers(swarms, reference):
    """One replica of each span is dead: every forward (each draws its route) equals transformers;
    a dead server costs the client its connect deadline (0.2 s here) once, then it is banned."""
    swarm = swarms()
    model = swarm.connect(refresh_period=0, routing_seed=5, transport=TransportConfig(deadlines=Deadlines(connect=0.2)))
    dead = [swarm.kill(swarm.servers[0]), swarm.kill(swarm.servers[3])]
    x = hidden(6)
    for _ in range(4):
        assert_close(model.blocks.forward(x, torch.arange(6).view(1, -1), None), blocks_output(reference, x))
    bans = model.blocks.directory.bans
    assert any(bans.banned(s.node.id) for s in dead)
    assert all(bans.failures(s.node.id) <= 1 for s in dead)  # each dead server cost a connect deadline once at most
    assert not any(bans.failures(s.node.id) for s in swarm.servers if s.alive)
