"""Audit rounds (:mod:`shoal.client.verification`) over stand-in servers: what each round sends an
auditor, a liar convicted from its first wrong position, a lying auditor replaced, disputes without
a third replica, unverified spans; and greedy generation through a liar in a real swarm. The pure
decisions: ``test_audit.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from shoal.client.remote.history import SpanHistory
from shoal.client.verification.audit import Conviction, Disputed, UnsettledDispute, Verification
from shoal.client.verification.auditors import Audits
from shoal.ids import BlockRange, PeerId
from shoal.routing import NoRouteError, ServerSpan
from shoal.wire import Codec
from tests.helpers.aio import run
from tests.helpers.audits import HIDDEN, SPAN, FakeHop, span_of

pytestmark = pytest.mark.timeout(60)


# ---- audit rounds over stand-in servers ------------------------------------------------------------


def honest(hidden: Tensor) -> Tensor:
    """What every honest server of SPAN computes: position-wise, so no cache is needed to stand in."""
    return torch.tanh(hidden * 1.5) + 0.25


@dataclass
class Servers:
    """Stand-in servers of SPAN by peer id: ``liars`` maps a peer to the position its lies start at."""

    peers: list[str]
    liars: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, float] = field(default_factory=dict)  # a liar's lie, when not 0.5
    steps: list[tuple[str, int, int]] = field(default_factory=list)  # (peer, position, n) of every step
    forwards: list[tuple[str, int]] = field(default_factory=list)  # (peer, n) of every stateless forward
    failed: list[str] = field(default_factory=list)
    convicted: list[str] = field(default_factory=list)
    disputed: dict[str, str] = field(default_factory=dict)  # peer -> why it is routed around

    def compute(self, peer: str, hidden: Tensor, position: int) -> Tensor:
        out = honest(hidden)
        lie = self.liars.get(peer)
        if lie is not None:
            positions = torch.arange(position, position + hidden.shape[1])
            out = out + self.sizes.get(peer, 0.5) * (positions >= lie).float()[None, :, None]
        return out

    # the recovery, planner, feedback, node and replay an Audits uses
    cache_tokens, needs, prompts = 0, (), None

    async def open_hop(self, span: ServerSpan, timeout: float | None = None) -> FakeHop:
        return FakeHop(span)

    def route_replica(self, like: ServerSpan, *, exclude=(), cache_tokens: int = 0, needs=()) -> ServerSpan | None:
        return next((span_of(p) for p in self.peers if p not in exclude and p != like.peer_id), None)

    def route_cover(self, like: ServerSpan, *, exclude=(), needs=()) -> None:
        return None  # one span only: no pieces of other spans

    def is_local(self, peer_id: str) -> bool:
        return False  # no span runs in the client's own process

    def failed_peer(self, peer: str, ban_seconds: float | None = None) -> None:
        self.failed.append(peer)

    async def replay(self, hop: FakeHop, tensors: list[Tensor], n: int, position: int = 0) -> Tensor:
        self.steps.append((hop.span.peer_id, position, n))
        return self.compute(hop.span.peer_id, tensors[0], position)

    async def request(self, ticket, protocol, message, timeout=None):
        self.forwards.append((ticket, message.tensors[0].shape[1]))
        return SimpleNamespace(tensors=[self.compute(ticket, message.tensors[0], 0)])


def audits_over(servers: Servers, every: int = 4, mode: str = "audit") -> tuple[Audits, Verification]:
    verification = Verification(mode, every)
    feedback = SimpleNamespace(failed=servers.failed_peer, convicted=servers.convicted.append,
                               disputed=servers.disputed.__setitem__)  # fmt: skip
    audits = Audits(servers, servers, feedback, servers, servers.replay, verification, compression=Codec.RAW,
                    request_deadline=5.0)  # fmt: skip
    return audits, verification


class Session:
    """Steps of a one-hop chain over SPAN served by ``peer``, recorded as a session records them."""

    def __init__(self, servers: Servers, audits: Audits, peer: str = "a", seed: int = 0):
        self.servers, self.audits = servers, audits
        self.hop = FakeHop(span_of(peer))
        self.history = SpanHistory(batch_size=1)
        self.position = 0
        self.generator = torch.Generator().manual_seed(seed)
        run(audits.follow([self.hop], self.history, 0, ()))

    def step(self, n: int):
        """One step of ``n`` positions; the audit round's conviction, if one was due."""
        hidden = torch.randn(1, n, HIDDEN, generator=self.generator)
        out = self.servers.compute(self.hop.span.peer_id, hidden, self.position)
        end = self.position + n
        positions = torch.arange(self.position, end)[None]
        self.history.record({0: hidden, 2: out}, frozenset({0, 2}), positions, None, end)
        self.position = end
        return run(self.audits.round(self.history, end)) if self.audits.due(end) else None


def test_each_round_sends_the_auditor_only_the_positions_it_has_not_seen():
    servers = Servers(["a", "b", "c"])
    audits, verification = audits_over(servers, every=4)
    session = Session(servers, audits)
    assert session.step(6) is None  # a prefill longer than K: audited at once
    for _ in range(10):
        assert session.step(1) is None
    assert run(audits.round(session.history, session.position)) is None  # the final audit: what is left
    assert servers.steps == [("b", 0, 6), ("b", 6, 4), ("b", 10, 4), ("b", 14, 2)]
    assert servers.forwards == [] and servers.convicted == []
    assert (verification.audits, verification.audited_positions, verification.disagreements) == (4, 16, 0)
    assert audits.verified() == {(0, 2): True} and verification.unverified_blocks == 0
    assert not audits.pending(16) and audits.checked_up_to(16) == 16


def test_a_lying_server_is_convicted_from_its_first_wrong_position():
    servers = Servers(["a", "b", "c"], liars={"a": 9})
    audits, verification = audits_over(servers, every=4)
    session = Session(servers, audits)
    convictions = [session.step(n) for n in (6, 1, 1, 1, 1)]  # rounds at 6 and at 10
    assert convictions[:4] == [None] * 4
    conviction = convictions[4]
    assert (conviction.index, conviction.peer, conviction.blocks, conviction.position) == (0, "a", SPAN, 9)
    assert conviction.replace  # its own output: the session replaces its hop
    assert servers.forwards == [("c", 10)]  # the third replica recomputed [0, 10) statelessly
    assert servers.convicted == ["a"] and verification.banned == ("a",)
    assert (verification.disagreements, verification.settled, verification.bans) == (1, 1, 1)
    audits.rolled_back(9)  # the session rolls back to the lie
    assert [(t.audited, t.since) for t in audits.tracks] == [(6, 0)]


def test_a_lying_auditor_is_replaced_and_its_positions_audited_again():
    servers = Servers(["a", "b", "c"], liars={"b": 7})
    audits, verification = audits_over(servers, every=4)
    session = Session(servers, audits)
    assert [session.step(n) for n in (6, 1, 1, 1, 1)] == [None] * 5
    assert servers.convicted == ["b"] and verification.banned == ("b",)
    track = audits.tracks[0]
    assert track.auditor.span.peer_id == "c" and track.audited == 6  # [6, 10) not vouched for yet
    assert servers.steps[-1] == ("c", 0, 6)  # the new auditor got the history it had checked, to cache
    assert run(audits.round(session.history, session.position)) is None
    assert servers.steps[-1] == ("c", 6, 4) and track.audited == 10


def test_without_a_third_replica_both_sides_of_the_dispute_are_routed_around_and_nobody_banned():
    """Nobody can tell which of the two lied: the round asks the session to roll back to where they
    first disagree and replace the hop, and both leave this client's routes with the reason;
    neither is convicted, and the track keeps no auditor from the dispute."""
    servers = Servers(["a", "b"], liars={"a": 7})
    audits, verification = audits_over(servers, every=4)
    session = Session(servers, audits)
    repairs = [session.step(n) for n in (6, 1, 1, 1, 1)]
    assert repairs[:4] == [None] * 4
    repair = repairs[4]
    dispute = Disputed((PeerId("a"), PeerId("b")), SPAN, 7)
    assert repair == Conviction(0, None, SPAN, 7, replace=True, dispute=dispute)
    assert (verification.disagreements, verification.unsettled, verification.bans) == (1, 1, 0)
    assert servers.convicted == [] and verification.banned == () and verification.caught == ()
    assert verification.disputes == (dispute,) and verification.excluded == ("a", "b")
    assert servers.disputed == {"a": dispute.reason, "b": dispute.reason}
    assert dispute.reason == "a and b disagree on blocks 0-1 from position 7 and no third replica settled it"
    assert audits.tracks[0].auditor is None and audits.checked_up_to(10) <= 7  # nothing past the dispute vouched for
    error = UnsettledDispute(dispute, [0, 1])
    assert isinstance(error, NoRouteError) and error.missing == [0, 1]
    assert str(error) == ("servers a and b disagree on blocks 0-1 from position 7 and no third replica settled it; "
                          "no route is left without both for blocks 0-1: not generating on over either")  # fmt: skip


def test_a_dispute_over_an_earlier_servers_outputs_keeps_the_hop_and_staffs_another_auditor():
    """The history holds x's outputs up to 8 (the hop a took over there); x and the auditor b
    disagree from 5 and the third replica c agrees with neither: x and b are routed around, the
    session rolls back to 5 without replacing a (nothing disputed is its own), and c audits a now."""
    servers = Servers(["b", "a", "c"], liars={"x": 5, "c": 0}, sizes={"c": 2.0})  # b audits x, then a
    audits, verification = audits_over(servers, every=100)
    session = Session(servers, audits, peer="x")
    assert [session.step(n) for n in (6, 1, 1)] == [None] * 3  # no audit due yet
    track = audits.tracks[0]
    session.hop = track.hop = FakeHop(span_of("a"))
    track.since, track.before = 8, PeerId("x")
    assert session.step(2) is None
    repair = run(audits.round(session.history, 10))
    dispute = Disputed((PeerId("x"), PeerId("b")), SPAN, 5)
    assert repair == Conviction(0, None, SPAN, 5, replace=False, dispute=dispute)
    assert servers.forwards == [("c", 10)] and servers.convicted == [] and verification.bans == 0
    assert set(servers.disputed) == {"x", "b"} and track.auditor.span.peer_id == "c"


def test_a_span_without_a_second_replica_is_unverified_from_the_start():
    servers = Servers(["a"])
    audits, verification = audits_over(servers)
    session = Session(servers, audits)
    assert session.step(12) is None and servers.steps == []
    assert verification.unverified_blocks == 2 and audits.verified() == {(0, 2): False}


def test_redundant_auditors_are_never_servers_of_the_main_chain():
    """The stand-in planner offers any other server as a replica: in audit mode hop 0 gets the
    server of hop 1 as its auditor; in redundant mode no server of the chain audits, and an auditor
    that a repair puts on the chain is replaced (closed) at once."""
    servers = Servers(["a", "b", "c", "d"])
    first, second = FakeHop(span_of("a")), FakeHop(span_of("b", BlockRange(2, 4)))
    audits, _ = audits_over(servers)
    run(audits.follow([first, second], SpanHistory(batch_size=1), 0, ()))
    assert [t.auditor.span.peer_id for t in audits.tracks] == ["b", "a"]  # audit mode: only the hop's own excluded

    audits, _ = audits_over(servers, every=1, mode="redundant")
    run(audits.follow([first, second], SpanHistory(batch_size=1), 0, ()))
    assert [t.auditor.span.peer_id for t in audits.tracks] == ["c", "c"]
    old_auditors = [t.auditor for t in audits.tracks]
    third = FakeHop(span_of("c"))  # a repair replaced a by c, the auditor of both hops
    run(audits.follow([third, second], SpanHistory(batch_size=1), 0, ()))
    assert [t.hop for t in audits.tracks] == [third, second]
    assert [t.auditor.span.peer_id for t in audits.tracks] == ["a", "a"]  # neither c nor b
    assert all(auditor.closed for auditor in old_auditors)


# ---- a real swarm ---------------------------------------------------------------------------------


def test_greedy_generation_through_a_liar_equals_the_honest_run(tmp_path):
    from transformers import AutoModelForCausalLM

    from shoal.launch import InProcessSwarm
    from testkit.faults import Noise, When
    from testkit.faulty import make_faulty
    from testkit.tiny import save_checkpoint, tiny_model
    from tests.helpers.byzantine import connect_over, peer_of, steer_through, would_route_over

    low, high = BlockRange(0, 2), BlockRange(2, 4)
    model_dir = save_checkpoint(tiny_model("llama", seed=0), tmp_path / "model")
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompt = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(100))
    expected = reference.generate(prompt, max_new_tokens=32, do_sample=False)
    streamed: list[int] = []

    class Collect:
        def put(self, value: Tensor) -> None:
            streamed.extend(value.flatten().tolist())

        def end(self) -> None:
            streamed.append(-1)

    fault = Noise(0.1, seed=3, when=When(from_position=21))
    with InProcessSwarm(model_dir, []) as swarm:
        lows = [swarm.add(low), swarm.add(low)]
        highs = [swarm.add(high), swarm.add(high)]
        liar = swarm.add(high, lambda server: make_faulty(server, [fault]))
        with connect_over(swarm, [*lows, *highs, liar], verify="audit", audit_every=8) as model:
            assert steer_through(model, [lows[0], liar]) == [peer_of(lows[0]), peer_of(liar)]
            got = model.generate(prompt, max_new_tokens=32, do_sample=False, streamer=Collect(), hold_back=True)
            assert torch.equal(got, expected)
            assert liar.server.record.entries(), "the liar never lied: the test is void"
            verification = model.verification
            assert verification.banned == (peer_of(liar),) and verification.rollbacks == 1, verification
            assert verification.unverified_blocks == 0 and verification.unsettled == 0, verification
            assert not would_route_over(model, liar)
            assert all(entry["verified"] for entry in model.blocks.describe_route())
            assert peer_of(liar) not in {s.peer_id for s in model.blocks.chain}
    assert streamed == [*got[0].tolist(), -1]  # held back until audited: never a token the repair replaced
