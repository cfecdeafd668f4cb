"""Audits are on by default (issue 34): a client given no ``verify`` audits, a swarm with nothing
to audit against still answers (its blocks reported unverified, one warning line a session at
most), and ``verify="off"`` says once per client that nothing is checked.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from shoal.client.verification.audit import DEFAULT_AUDIT_EVERY
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import connect_over
from tests.helpers.parity import honest_greedy, prompt_of

pytestmark = pytest.mark.timeout(90)

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
MODEL_SEED = 0  # test_verify's llama: greedy runs from this prompt keep wide top-2 gaps
NEW_TOKENS = 24
PROMPT = prompt_of(100)
UNVERIFIED = "unverified in this session"
UNCHECKED = "answers from untrusted servers are not checked"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("verify-default"), "llama", MODEL_SEED, tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def expected(model_dir) -> torch.Tensor:
    return honest_greedy(model_dir, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def swarm(model_dir):
    """Two replicas of [0:2], one server of [2:4]."""
    with InProcessSwarm(model_dir, [LOW, LOW, HIGH]) as swarm:
        yield swarm


def lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_client_given_no_verify_audits_what_it_can(swarm, expected, caplog):
    """[0:2] has a replica: audited every K positions. [2:4] has none: reported unverified, the
    answer goes on, and two sessions log one warning line each."""
    caplog.set_level(logging.WARNING)
    with connect_over(swarm, swarm.servers) as model:
        for _ in range(2):  # two sessions
            assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
        verification = model.verification
        assert (verification.mode, verification.audit_every) == ("audit", DEFAULT_AUDIT_EVERY)
        assert verification.audits >= 2 and verification.disagreements == 0, verification
        assert verification.unverified == (2, 3), verification
    assert lines(caplog, UNVERIFIED) == [f"blocks {HIGH} are {UNVERIFIED}: no other server can check them"] * 2
    assert lines(caplog, UNCHECKED) == []


def test_disjoint_spans_generate_unverified_with_one_line_a_session(swarm, expected, caplog):
    """No span has a replica: nothing to audit, the tokens are the honest ones, every block is
    reported unverified, once."""
    caplog.set_level(logging.WARNING)
    low, high = swarm.servers[0], swarm.servers[2]
    with connect_over(swarm, [low, high]) as model:
        assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
        verification = model.verification
        assert (verification.unverified_blocks, verification.audits) == (4, 0), verification
    assert len(lines(caplog, UNVERIFIED)) == 1, caplog.text
    assert [r.levelno for r in caplog.records] == [logging.WARNING], caplog.text  # no other warning


def test_verify_off_warns_once_per_client_and_audits_nothing(swarm, expected, caplog):
    caplog.set_level(logging.WARNING)
    with connect_over(swarm, swarm.servers, verify="off") as model:
        for _ in range(2):
            assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
        assert (model.verification.mode, model.verification.audits) == ("off", 0)
    assert lines(caplog, UNCHECKED) == ["verify='off': answers from untrusted servers are not checked"]
    assert lines(caplog, UNVERIFIED) == []
