"""A detected lie is never kept (issue 34): two replicas of a span, one lying, and no third to settle.

The swarm serves a tiny random llama (4 blocks): ``[0:2]`` twice, ``[2:4]`` by an honest server and
a liar (:func:`testkit.faulty.make_faulty`: noise 1e-1 from position :data:`LIE_FROM` on), and, for
the clients that know it, ``[0:4]`` by one more honest server that also carries a LoRA adapter: it
serves a client asking for none the base model's outputs, but a server with other adapters is no
replica of the others (nor a piece of a check: their outputs need not be alike,
:func:`shoal.client.remote.directory.replicas`), so it cannot settle a dispute of theirs. The
client's chain is steered through the liar (:func:`tests.helpers.byzantine.steer_through`); the
honest ``[2:4]`` server is its auditor and nothing can settle their dispute. Both leave the client's
routes; neither is convicted nor reported to a judge (nobody knows which lied):

* with ``[0:4]`` there, the session rolls back to the dispute and regenerates over it: 32 greedy
  tokens equal local transformers', in audit and in redundant mode;
* without it, ``generate`` fails with :class:`~shoal.client.verification.audit.UnsettledDispute`
  naming the blocks and both servers, and so does the client's next session;
* a ``hold_back`` streamer never got a token after the dispute's position before the dispute was
  found (what it emitted is exactly the answer); a plain one did (the premise: the lie changed tokens);
* the gateway's stream (``/v1/completions``, which holds text back in audit mode) joins to the honest
  text, or stops with the error after an honest prefix.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from shoal.client.verification.audit import Disputed, UnsettledDispute
from shoal.gateway.app import build_app
from shoal.gateway.engine import Engine
from shoal.gateway.swarm import Watchers
from shoal.ids import BlockRange, PeerId
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from testkit.faults import Noise, When
from testkit.faulty import make_faulty
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import connect_over, lies, peer_of, steer_through
from tests.helpers.parity import greedy_with_gap

pytestmark = pytest.mark.timeout(60)

LOW, HIGH, WHOLE = BlockRange(0, 2), BlockRange(2, 4), BlockRange(0, 4)
K = 8
PROMPT_LENGTH = 10
NEW_TOKENS = 32
LIE_FROM = 21  # a decode position: audits at 10 and 18 pass, the one at 26 finds the dispute
MIN_GAP = 1e-3  # the honest run's top-2 logit gaps are above this: token equality is a fair test


@dataclass
class World:
    swarm: InProcessSwarm
    expected: torch.Tensor
    lows: list[LocalServer]
    honest: LocalServer  # the liar's only replica, its auditor
    liar: LocalServer
    whole: LocalServer  # the route around both: an honest server that cannot settle their dispute

    def servers(self, around: bool) -> list[LocalServer]:
        return [*self.lows, self.honest, self.liar, *([self.whole] if around else [])]


@dataclass
class Stream:
    """A streamer that notes, for each token it is given, its index in the answer and how many
    disputes the client had found when it came (``unsettled``)."""

    model: object
    tokens: list[tuple[int, int, int]] = field(default_factory=list)  # (index, token, disputes then)
    length: int | None = None
    ended: int = 0

    def put(self, value: torch.Tensor) -> None:
        ids = value.flatten().tolist()
        if self.length is None:  # the prompt
            self.length = len(ids)
            return
        for token in ids:
            self.tokens.append((self.length, token, self.model.verification.unsettled))
            self.length += 1

    def end(self) -> None:
        self.ended += 1

    def before_dispute(self) -> list[int]:
        return [index for index, _, disputes in self.tokens if disputes == 0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    model_dir = tiny_checkpoint(tmp_path_factory.mktemp("dispute"), "llama", 0, tokenizer=char_tokenizer())
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = prompt()  # every position attended, as the gateway does (id 0 is the pad token)
    expected, gap = greedy_with_gap(reference, ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS)
    assert gap > MIN_GAP, f"the honest run has a near-tie (top-2 gap {gap:.2e})"
    assert expected.shape == (1, PROMPT_LENGTH + NEW_TOKENS)
    fault = Noise(0.1, seed=3, when=When(from_position=LIE_FROM))
    with InProcessSwarm(model_dir, []) as swarm:
        lows = [swarm.add(LOW), swarm.add(LOW)]
        honest = swarm.add(HIGH)
        liar = swarm.add(HIGH, lambda server: make_faulty(server, [fault]))
        whole = swarm.add(WHOLE, adapters=(("tuned", make_adapter(reference, model_dir.parent / "adapter")),))
        yield World(swarm, expected, lows, honest, liar, whole)


def make_adapter(reference, out_dir: Path) -> Path:
    """A peft LoRA adapter of ``reference`` (random, non-zero): what makes its server unlike the others."""
    torch.manual_seed(50)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(reference), config).save_pretrained(str(out_dir))
    return out_dir


def prompt() -> torch.Tensor:
    return torch.randint(3, 256, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(100))


def client(world: World, mode: str, around: bool):
    every = {"audit_every": K} if mode == "audit" else {}
    return connect_over(world.swarm, world.servers(around), verify=mode, route_wait=0, **every)


def check_nobody_convicted(world: World, model, auditor_lies: bool = False) -> Disputed:
    """One unsettled dispute, between the liar and its honest replica (the hop's server first, then
    its auditor): both out of the client's routes with the reason, neither convicted nor banned
    (not even for a while), nothing sent to judges. Returns the dispute."""
    verification = model.verification
    assert (verification.disagreements, verification.unsettled, verification.rollbacks) == (1, 1, 1), verification
    assert verification.bans == 0 and verification.banned == () and verification.caught == (), verification
    assert verification.evidence_sent == 0, verification
    (dispute,) = verification.disputes
    pair = (PeerId(peer_of(world.liar)), PeerId(peer_of(world.honest)))
    assert dispute.peers == (pair[::-1] if auditor_lies else pair) and dispute.blocks == HIGH, dispute
    told = lies(world.liar.server.record.entries())
    assert told is not None and dispute.position == told.first == LIE_FROM, (dispute, told)
    directory = model.blocks.directory
    assert directory.banned == set(), directory.banned
    assert not directory.bans.banned(peer_of(world.honest)), "the honest server is banned for a while"
    assert directory.excluded == {peer: dispute.reason for peer in dispute.peers}
    return dispute


@pytest.mark.parametrize("mode", ["audit", "redundant"])
@pytest.mark.parametrize("liar_is", ["hop", "auditor"])
def test_routed_around_both_the_answer_is_the_honest_one(world, mode, liar_is):
    """The liar serves the chain's ``[2:4]`` hop and the honest server audits it, or the other way
    round: the client cannot tell these apart, and does the same in both."""
    with client(world, mode, around=True) as model:
        chain = [world.lows[0], world.liar if liar_is == "hop" else world.honest]
        assert steer_through(model, chain) == [peer_of(s) for s in chain], "the chain is not the one wanted"
        stream = Stream(model)
        got = model.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, streamer=stream, hold_back=True)
        assert torch.equal(got, world.expected), f"first wrong token at {(got != world.expected).nonzero()[0]}"
        dispute = check_nobody_convicted(world, model, auditor_lies=liar_is == "auditor")
        assert [s.peer_id for s in model.blocks.chain] == [peer_of(world.whole)]  # around both
        # hold_back: before the dispute was found, no token past its position; in all, exactly the answer
        assert max(stream.before_dispute()) <= dispute.position, stream.tokens
        assert [token for _, token, _ in stream.tokens] == got[0, PROMPT_LENGTH:].tolist() and stream.ended == 1


def test_without_hold_back_a_streamer_sees_the_disputed_tokens(world):
    """The premise of the hold-back assertions: the lie changed the tokens generated before the dispute."""
    with client(world, "audit", around=True) as model:
        steer_through(model, [world.lows[0], world.liar])
        stream = Stream(model)
        got = model.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, streamer=stream)
        assert torch.equal(got, world.expected)
        (dispute,) = model.verification.disputes
        early = [(index, token) for index, token, disputes in stream.tokens if disputes == 0]
        assert max(index for index, _ in early) > dispute.position
        assert any(token != int(got[0, index]) for index, token in early), "the lie changed no token: the test is void"


def test_no_route_left_without_both_fails_with_a_clear_error(world):
    with client(world, "audit", around=False) as model:
        steer_through(model, [world.lows[0], world.liar])
        stream = Stream(model)
        liar, honest = peer_of(world.liar)[:10], peer_of(world.honest)[:10]
        match = rf"servers {liar} and {honest} disagree on blocks 2-3 from position {LIE_FROM} .*for blocks 2-3"
        with pytest.raises(UnsettledDispute, match=match) as raised:
            model.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, streamer=stream, hold_back=True)
        assert raised.value.missing == [2, 3]
        dispute = check_nobody_convicted(world, model)
        assert raised.value.dispute == dispute
        # hold_back: only tokens audited clean came out, an honest prefix that stops short of the dispute
        streamed = [token for _, token, _ in stream.tokens]
        assert streamed and PROMPT_LENGTH + len(streamed) <= dispute.position + 1 and not stream.ended, stream.tokens
        assert streamed == world.expected[0, PROMPT_LENGTH : PROMPT_LENGTH + len(streamed)].tolist()
        with pytest.raises(UnsettledDispute, match=match):  # the client's next session says the same
            model.generate(prompt(), max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("around", [True, False], ids=["routed-around", "no-route-left"])
def test_gateway_stream_shows_no_disputed_text(world, around):
    """The gateway holds text back in audit mode: the streamed deltas join to the honest text; when
    no route is left, an honest prefix (none of it past the dispute), then the error event."""
    honest = char_tokenizer().decode(world.expected[0, PROMPT_LENGTH:].tolist())
    with client(world, "audit", around) as model:
        steer_through(model, [world.lows[0], world.liar])
        app = build_app(Engine(model, "tiny"), Watchers(world.swarm.transport, None))
        body = {"model": "tiny", "prompt": prompt()[0].tolist(), "max_tokens": NEW_TOKENS, "temperature": 0,
                "stream": True}  # fmt: skip
        with (
            TestClient(app, base_url="http://localhost") as http,
            http.stream("POST", "/v1/completions", json=body) as reply,
        ):
            assert reply.status_code == 200
            events = [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines()
                      if line.startswith("data: {")]  # fmt: skip
        dispute = check_nobody_convicted(world, model)
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    if around:
        assert text == honest and "error" not in events[-1], events[-1]
        state = events[-1]["shoal"]["verification"]
        assert (state["unsettled"], state["bans"], state["rollbacks"]) == (1, 0, 1), state
    else:
        assert honest.startswith(text) and len(text) <= dispute.position + 1 - PROMPT_LENGTH, text
        error = events[-1]["error"]
        assert error["code"] == "swarm_unavailable" and "disagree on blocks 2-3" in error["message"], error
