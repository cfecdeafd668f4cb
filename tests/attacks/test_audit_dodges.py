"""A liar cannot dodge audits by computing in another dtype, nor by starving its auditors (issue #34).

A tiny random llama of 4 blocks. Each case adds one liar on ``[2:4]`` (noise 1e-1 from position
:data:`LIE_FROM`, so the prompt and the first decode steps are honest) beside honest ``[0:2]``
servers, the client steered through the liar (:func:`tests.helpers.byzantine.steer_through`):

* **another dtype**: the liar computes in bfloat16 beside fp32 replicas. They audit it within the
  bfloat16 tolerance (the coarser of the two); the liar is convicted; the honest bfloat16 server that
  audits the fp32 ``[0:2]`` hop raises no false alarm.
* **starved auditors**: the liar's two honest replicas have room for one session of 64 tokens, and
  a throwaway client holds it on both (so an auditor session cannot open: busy). The audit falls
  back to stateless forwards (no cache needed): the liar is convicted all the same.

Every case: the greedy tokens equal local transformers (fp32) and no honest server is banned.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.client.remote.hops import Hop
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.wire import Message
from shoal.wire.schema import OpenRequest, StepRequest
from testkit.faults import Noise, When
from testkit.faulty import make_faulty
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import assert_caught, connect_over, peer_of, steer_through
from tests.helpers.parity import honest_greedy, prompt_of

pytestmark = pytest.mark.timeout(120)

K = 8
NEW_TOKENS = 24
MODEL_SEED = 0
PROMPT_SEED = 100
MIN_GAP = 1e-3
LIE_FROM = 16
LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
HELD_TOKENS = 64  # the starved replicas' whole cache, held by a throwaway client
HIDDEN_SIZE = 64  # testkit.tiny's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("dodges-model"), "llama", MODEL_SEED, tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def expected(model_dir) -> torch.Tensor:
    return honest_greedy(model_dir, prompt_of(PROMPT_SEED), NEW_TOKENS, MIN_GAP)


@pytest.fixture(scope="module")
def swarm(model_dir):
    with InProcessSwarm(model_dir, []) as swarm:
        swarm.low = [swarm.add(LOW), swarm.add(LOW, dtype=torch.bfloat16)]
        yield swarm


def liar_on(swarm: InProcessSwarm, **settings) -> LocalServer:
    lie = Noise(0.1, seed=3, when=When(from_position=LIE_FROM))
    return swarm.add(HIGH, lambda server: make_faulty(server, [lie]), **settings)


async def hold(node, span) -> Hop:
    """A session on ``span``'s server that fills its whole cache (stepped: an unstepped reservation is
    taken back when another session needs the pages)."""
    hop = await Hop.open(node, span, OpenRequest(max_length=HELD_TOKENS), 10.0)
    hidden = torch.zeros(1, HELD_TOKENS, HIDDEN_SIZE)
    positions = torch.arange(HELD_TOKENS)[None]
    await hop.stream.send(Message("step", 1, StepRequest(session=hop.session, position=0), [hidden, positions]))
    reply = await hop.receive(30.0)
    assert reply is not None and reply.kind == "result", reply
    return hop


def run_through(swarm: InProcessSwarm, liar: LocalServer, honest: list[LocalServer], expected: torch.Tensor):
    """Generate over the liar and ``honest``, steered through the liar; check the repair."""
    with connect_over(swarm, [liar, *honest], verify="audit", audit_every=K) as model:
        route = steer_through(model, [swarm.low[0], liar])
        assert route == [peer_of(swarm.low[0]), peer_of(liar)], "the chain does not go through the liar"
        got = model.generate(prompt_of(PROMPT_SEED), max_new_tokens=NEW_TOKENS, do_sample=False)
        verification = assert_caught(model, liar, got, expected, lie_from=LIE_FROM, k=K)
        assert verification.unsettled == 0, verification
        for server in honest:
            assert peer_of(server) not in model.blocks.directory.banned, f"honest {peer_of(server)[:10]} banned"
        return verification


def test_a_liar_in_another_dtype_is_audited_within_the_coarser_tolerance(swarm, expected):
    liar = liar_on(swarm, dtype=torch.bfloat16)
    try:
        replicas = [swarm.add(HIGH), swarm.add(HIGH)]
        try:
            verification = run_through(swarm, liar, [*swarm.low, *replicas], expected)
            assert verification.disagreements == 1, verification  # the lie; no false alarm across dtypes
        finally:
            for server in replicas:
                swarm.kill(server)
    finally:
        swarm.kill(liar)


def test_a_starved_auditor_still_audits(swarm, expected):
    """The liar's replicas are starved; a ``[0:4]`` server (no replica of the liar's span: no
    auditor session on it) is where the repaired chain goes."""
    starved = [swarm.add(HIGH, cache_tokens=HELD_TOKENS), swarm.add(HIGH, cache_tokens=HELD_TOKENS)]
    whole = swarm.add(BlockRange(0, 4))
    liar = liar_on(swarm)
    try:
        with connect_over(swarm, [*swarm.low, *starved]) as hog:  # a throwaway client holds both caches
            spans = [s for s in hog.blocks.directory.spans if s.peer_id in {peer_of(x) for x in starved}]
            held = [hog.blocks.runtime.run(hold(hog.blocks.node, span)) for span in spans]
            try:
                verification = run_through(swarm, liar, [*swarm.low, *starved, whole], expected)
            finally:
                for hop in held:
                    hog.blocks.runtime.run(hop.abort())
        counters = [server.server.counters for server in (*starved, whole)]
        assert counters[0].sessions_rejected_busy + counters[1].sessions_rejected_busy >= 1, counters
        assert sum(c.forward_requests for c in counters) >= 2, counters  # the stateless check, the third opinion
        assert verification.audits >= 1, verification
    finally:
        for server in (liar, *starved, whole):
            swarm.kill(server)
