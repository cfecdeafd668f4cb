"""A liar cannot dodge audits by serving a span nobody else serves alike (issue #34).

A tiny random llama of 6 blocks. Honest servers: ``[0:3]`` x2, ``[2:6]`` and ``[3:6]``; the liar
serves ``[0:2]``, a span no other server has, so it has no exact replica. The only whole-span chains are
liar ``[0:2]`` + ``[2:6]`` and ``[0:3]`` + ``[3:6]``; the client is steered through the liar
(:func:`tests.helpers.byzantine.steer_through`). Its hop is audited through a piece of a ``[0:3]``
server (``ForwardRequest.blocks`` = ``[0:2]``), the dispute settled by the other ``[0:3]`` server's
piece: the liar is convicted, the answer repaired and equal to local transformers. The ``[2:6]``
hop is audited through two pieces (``[2:3]`` of a ``[0:3]`` server, then ``[3:6]``); a liar inside such
a cover convicts nobody (which piece lied is not known) and is dropped. Nobody honest is banned.
``require_verified=True`` over servers nobody can check fails closed before any step.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shoal.client.verification.audit import UnverifiedBlocks
from shoal.errors import UsageError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from testkit.faults import Noise, When
from testkit.faulty import make_faulty
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import assert_caught, connect_over, lies, peer_of, steer_through, would_route_over
from tests.helpers.parity import honest_greedy, prompt_of

pytestmark = pytest.mark.timeout(120)

K = 8
NEW_TOKENS = 24
MODEL_SEED = 0
PROMPT_SEED = 100
MIN_GAP = 1e-3
LIE_FROM = 16  # the liar is honest over the prompt and the first decode steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("unique-span-model")
    return tiny_checkpoint(out, "llama", MODEL_SEED, tokenizer=char_tokenizer(), num_hidden_layers=6)


@pytest.fixture(scope="module")
def expected(model_dir) -> torch.Tensor:
    return honest_greedy(model_dir, prompt_of(PROMPT_SEED), NEW_TOKENS, MIN_GAP)


@pytest.fixture(scope="module")
def swarm(model_dir):
    with InProcessSwarm(model_dir, []) as swarm:
        swarm.honest = [swarm.add(BlockRange(0, 3)), swarm.add(BlockRange(0, 3)), swarm.add(BlockRange(2, 6)),
                        swarm.add(BlockRange(3, 6))]  # fmt: skip
        yield swarm


def test_a_liar_on_a_unique_span_is_caught_through_pieces(swarm, expected):
    high = swarm.honest[2]
    lie = Noise(0.1, seed=1, when=When(from_position=LIE_FROM))
    liar = swarm.add(BlockRange(0, 2), lambda server: make_faulty(server, [lie]))
    try:
        with connect_over(swarm, [liar, *swarm.honest], verify="audit", audit_every=K) as model:
            route = steer_through(model, [liar, high])
            assert route == [peer_of(liar), peer_of(high)], "the chain does not go through the liar"
            got = model.generate(prompt_of(PROMPT_SEED), max_new_tokens=NEW_TOKENS, do_sample=False)
            verification = assert_caught(model, liar, got, expected, lie_from=LIE_FROM, k=K)
            assert verification.rollbacks >= 1, verification
            assert not would_route_over(model, liar)
            for server in swarm.honest:  # [2:6] is on no route without the liar: it is only never banned
                assert peer_of(server) not in model.blocks.directory.banned, f"honest {peer_of(server)[:10]} banned"
                if server is not high:
                    assert would_route_over(model, server), f"honest server {peer_of(server)[:10]} is avoided"
            assert verification.unverified_blocks == 0, verification
    finally:
        swarm.kill(liar)


def test_honest_hops_audited_through_pieces_agree(swarm, expected):
    """``[2:6]``'s only check is two pieces of other servers; ``[0:3]``'s a replica: no false alarm."""
    low_a, _, high, tail = swarm.honest
    with connect_over(swarm, [low_a, high, tail], verify="audit", audit_every=K) as model:
        steer_through(model, [low_a, tail])
        got = model.generate(prompt_of(PROMPT_SEED), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(got, expected)
        verification = model.verification
        assert verification.audits >= 2 and verification.disagreements == 0 and verification.bans == 0, verification
        # [3:6] has [3:6] of the [2:6] server; [0:3] nobody (the other [0:3] server is not known here)
        assert verification.unverified == (0, 1, 2), verification


def test_a_liar_inside_a_cover_convicts_nobody(swarm, expected):
    """An honest ``[2:6]`` hop whose cover is a lying piece (``[2:3]`` of a ``[1:3]`` liar) and an honest
    ``[3:6]``: a third opinion (another cover) sides with the hop. Which piece lied is not known, so
    nobody is convicted: the cover is dropped and the hop checked by another; the tokens stand."""
    _, low_b, high, tail = swarm.honest
    lie = Noise(0.1, seed=2, when=When(from_position=LIE_FROM))
    liar = swarm.add(BlockRange(1, 3), lambda server: make_faulty(server, [lie]))
    head, tail_b = swarm.add(BlockRange(0, 2)), swarm.add(BlockRange(3, 6))
    try:
        with connect_over(swarm, [head, high, liar, low_b, tail, tail_b], verify="audit", audit_every=K) as model:
            assert steer_through(model, [head, high]) == [peer_of(head), peer_of(high)]
            directory, dearer = model.blocks.directory, {peer_of(low_b), peer_of(tail_b)}
            directory.spans = [replace(s, info=replace(s.info, step_ms=10.0)) if s.peer_id in dearer else s
                               for s in directory.spans]  # fmt: skip  # the first cover: the liar's piece, tail
            got = model.generate(prompt_of(PROMPT_SEED), max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, expected), f"first wrong token {(got != expected).nonzero()[0].tolist()}"
            told = lies(liar.server.record.entries())
            assert told is not None and told.first == LIE_FROM, liar.server.record.entries()
            verification = model.verification
            assert verification.disagreements >= 1 and verification.settled >= 1, verification
            assert verification.banned == () and verification.rollbacks == 0, verification
            assert not directory.banned, directory.banned
            assert verification.unverified_blocks == 0, verification
    finally:
        for server in (liar, head, tail_b):
            swarm.kill(server)


def test_require_verified_fails_closed(swarm):
    low_a, tail = swarm.honest[0], swarm.honest[3]
    before = [s.server.counters.steps for s in (low_a, tail)]
    wait = 0.5  # the open waits this long for a checker to join (none does) before it refuses
    checked = connect_over(swarm, [low_a, tail], verify="audit", audit_every=K, require_verified=True, route_wait=wait)
    started = time.monotonic()
    with checked as model, pytest.raises(UnverifiedBlocks, match=r"blocks \[0, 1, 2, 3, 4, 5\]"):
        model.generate(prompt_of(PROMPT_SEED), max_new_tokens=4, do_sample=False)
    assert wait <= time.monotonic() - started < wait + 10.0
    assert [s.server.counters.steps for s in (low_a, tail)] == before, "a step ran on unverified blocks"
    # the sessions the refused chain opened are closed, not left to fill the peer's session limit
    assert [s.server.counters.sessions_active for s in (low_a, tail)] == [0, 0]
    with pytest.raises(UsageError, match="require_verified"):  # audits are the default: only 'off' contradicts it
        connect_over(swarm, [low_a, tail], verify="off", require_verified=True).__enter__()
