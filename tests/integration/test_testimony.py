"""Testimony outlives the session: a lie caught only by generate()'s final audit is still testified
to, and its confirmations counted, by the time the client closes.

The swarm of tests/integration/test_evidence.py: a tiny llama (4 blocks), ``[0:2]`` x1, ``[2:4]`` x2
honest and a liar on ``[2:4]`` adding noise from position 31 on. The client audits every 8 positions:
12 prompt tokens and 24 new ones put 35 positions through the chain, audited at 12, 20 and 28, so
only the final audit (28:35) catches the lie. The honest judges take a second to answer (slower
than the rest of generate), so the testimony is still on its way when generate returns; closing
the client waits for it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from testkit.faults import Noise, When
from testkit.faulty import make_faulty
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import connect_over, lies, peer_of, steer_through
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.parity import greedy_with_gap

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_server_errors")]

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
PROMPT = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(100))
NEW_TOKENS = 24
LIE_FROM = 31  # after the audit at 28, before the end (35)
JUDGING_DELAY = 1.0


def slowed(judge) -> None:
    """``judge`` (a server's Judge) answers ``JUDGING_DELAY`` seconds late."""
    judged = judge.judge

    async def late(request, sender, draining: bool = False):
        await asyncio.sleep(JUDGING_DELAY)
        return await judged(request, sender, draining=draining)

    judge.judge = late


def test_a_lie_found_by_the_final_audit_is_confirmed_by_the_time_the_client_closes(tmp_path):
    model_dir = tiny_checkpoint(tmp_path, "llama", 0, tokenizer=char_tokenizer())
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected, gap = greedy_with_gap(reference, PROMPT, max_new_tokens=NEW_TOKENS)
    assert gap > 1e-3
    fault = Noise(0.1, seed=5, when=When(from_position=LIE_FROM))
    with InProcessSwarm(model_dir, []) as swarm:
        first = swarm.add(LOW)
        honest = [swarm.add(HIGH), swarm.add(HIGH)]
        liar = swarm.add(HIGH, lambda server: make_faulty(server, [fault]))
        for server in honest:
            slowed(server.server.judge)
        with connect_over(swarm, [liar, *honest, first], verify="audit", audit_every=8) as model:
            assert steer_through(model, [first, liar]) == [peer_of(first), peer_of(liar)]
            got = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, expected)
            told = lies(liar.server.record.entries())
            assert told is not None and told.first == LIE_FROM, liar.server.record.entries()
            verification = model.verification
            assert verification.banned == (peer_of(liar),) and verification.caught[0].position == LIE_FROM
            assert verification.evidence_confirmed < 2  # still on its way: generate did not wait for it
            closing = time.monotonic()
        closed_in = time.monotonic() - closing  # connect_over closed the client
        counts = (verification.evidence_sent, verification.evidence_confirmed, verification.evidence_rejected)
        assert counts == (2, 2, 0)
        assert closed_in < 10.0
        for judge in honest:
            counters = judge.server.counters
            assert (counters.evidence_received, counters.evidence_confirmed) == (1, 1)
