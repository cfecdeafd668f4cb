"""End to end: an audited client that catches a liar testifies, and the liar's honest replicas confirm.

The swarm of tests/integration/test_verify.py, smaller: a tiny random llama (4 blocks), ``[0:2]`` x1
and ``[2:4]`` x2 honest, plus a liar on ``[2:4]`` adding noise 1e-1 from position 20 on. A client with
``verify="audit"`` (K = 8) over all four, its chain steered through the liar, generates 24 greedy
tokens: the same as the local reference, the liar convicted by a third replica, and the evidence
sent to the two honest servers of ``[2:4]`` (the only other servers of those blocks), who both
confirm it: the client's :class:`~shoal.client.verification.audit.Verification` and their own counters say so.
In a swarm (``InProcessSwarm(swarm=...)``) their signed verdicts spread: every server's table, the
``[0:2]`` server's too, convicts the liar (:func:`shoal.swarm.verdicts.convicted`), and nobody else.
"""

from __future__ import annotations

import time

import pytest
import torch

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.swarm.verdicts import convicted
from testkit.faults import Noise, When
from testkit.faulty import make_faulty
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import connect_over, lies, peer_of, steer_through
from tests.helpers.inprocess import wait_until
from tests.helpers.parity import honest_greedy, prompt_of

pytestmark = pytest.mark.timeout(90)

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
MODEL_SEED = 0  # test_verify's llama and prompt: greedy choices far apart
PROMPT = prompt_of(100)
NEW_TOKENS = 24
LIE_FROM = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("evidence-model"), "llama", MODEL_SEED, tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def expected(model_dir) -> torch.Tensor:
    return honest_greedy(model_dir, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("swarm_id", [None, "evidence-swarm"])
def test_a_convicted_liar_is_confirmed_by_its_honest_replicas(model_dir, expected, swarm_id):
    fault = Noise(0.1, seed=5, when=When(from_position=LIE_FROM))
    with InProcessSwarm(model_dir, [], swarm=swarm_id) as swarm:
        first = swarm.add(LOW)
        honest = [swarm.add(HIGH), swarm.add(HIGH)]
        liar = swarm.add(HIGH, lambda server: make_faulty(server, [fault]))
        servers = (first, *honest, liar)
        if swarm_id is not None:  # the client reads the swarm's table: it must know every server
            model_name = first.server.info.model
            for server in servers:
                table = server.presence.service.table
                wait_until(lambda t=table: len(list(t.servers(model_name))) == len(servers), timeout=10.0,
                           what="every server in every table")  # fmt: skip
        with connect_over(swarm, [liar, *honest, first], verify="audit", audit_every=8) as model:
            assert steer_through(model, [first, liar]) == [peer_of(first), peer_of(liar)]
            got = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, expected)
            told = lies(liar.server.record.entries())
            assert told is not None and told.first == LIE_FROM, liar.server.record.entries()
            verification = model.verification
            assert verification.banned == (peer_of(liar),), verification
            wait_until(lambda: verification.evidence_confirmed == 2, timeout=20.0, what="both judges confirming")
            assert (verification.evidence_sent, verification.evidence_rejected) == (2, 0), verification
        for judge in honest:
            counters = judge.server.counters
            assert (counters.evidence_received, counters.evidence_confirmed, counters.evidence_rejected) == (1, 1, 0)
            assert judge.server.judge.convicted(peer_of(liar))
        assert liar.server.counters.evidence_received == 0  # never sent to the accused
        assert first.server.counters.evidence_received == 0  # nor to servers of other blocks
        if swarm_id is not None:
            for server in servers:
                table = server.presence.service.table
                wait_until(lambda t=table: set(convicted(t, model_name, time.time())) == {peer_of(liar)},
                           timeout=10.0, what=f"{peer_of(server)[:10]} convicting the liar alone")  # fmt: skip
