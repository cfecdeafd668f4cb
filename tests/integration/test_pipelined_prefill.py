"""Pipelined prefill (:mod:`shoal.client.remote.pipeline`): a step longer than ``prefill_chunk`` travels the
chain in chunks, sent on without waiting for the previous chunk's replies.

One in-process swarm of a tiny random llama (4 blocks): ``[0:2] [2:4] [0:1] [1:2]``; a client over
``[0:2], [2:4]`` routes over 2 servers, one over ``[0:1], [1:2], [2:4]`` over 3. A 37-position
prompt in chunks of 8 is 5 chunks (the last of 5). Pipelined equals unpipelined: greedy tokens
exactly, logits within 1e-4 and block outputs within 1e-5 of their largest value (fp32; chunks change
only the matmul shapes), with
push and without (then the client relays every chunk hop by hop), with receipts asked and not.
The servers' own counters show the chunks as steps of their own (``steps``, ``pushes_received``),
and the session's history holds one receipt per chunk per hop, as for sequential steps. A server
that crashes at the third chunk (:class:`testkit.faults.Crash`), or pushes a forged third chunk on
(:class:`testkit.faults.Equivocate`: the next hop's receipt shows it), is replaced from the chunks
every hop had answered, and the tokens stay right. A prompt no longer than a chunk is one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.client.remote.pipeline import chunk_bounds
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from testkit.faults import Crash, Equivocate, When
from testkit.faulty import make_faulty
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.byzantine import connect_over, peer_of, steer_through
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
FIRST, SECOND = BlockRange(0, 1), BlockRange(1, 2)
CHAINS = {2: (LOW, HIGH), 3: (FIRST, SECOND, HIGH)}
CHUNK = 8
PROMPT_LENGTH = 37  # 5 chunks: 4 of 8 and one of 5
CHUNKS = 5
NEW_TOKENS = 8
HIDDEN = 64  # testkit.tiny's hidden size
LOGITS_TOLERANCE = 1e-4
#: hidden states (values up to ~1e2 here) relative to the largest: chunks differ by ~1e-6 of it (fp32 matmul shapes)
HIDDEN_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("pipeline-model"), "llama", 0, tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def swarm(model_dir):
    with InProcessSwarm(model_dir, [LOW, HIGH, FIRST, SECOND]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def reference_tokens(model_dir) -> torch.Tensor:
    """Local transformers' greedy run (fp32): what every run over the swarm must answer."""
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return reference.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False)


def prompt() -> torch.Tensor:
    return torch.randint(3, 256, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(7))


def chain_servers(swarm: InProcessSwarm, hops: int) -> list[LocalServer]:
    """The honest servers of a chain of ``hops`` (the first server of each span: the fixture's)."""
    return [swarm.server(span) for span in CHAINS[hops]]


def counters(servers: Sequence[LocalServer]) -> list[tuple[int, int]]:
    """(steps, pushes_received) of each server, as it counts them."""
    return [(c.steps, c.pushes_received) for c in (s.server.describe().counters for s in servers)]


def deltas(after: list[tuple[int, int]], before: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]


def test_chunk_bounds():
    assert chunk_bounds(37, 8) == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 37)]
    assert chunk_bounds(16, 8) == [(0, 8), (8, 16)]
    assert chunk_bounds(8, 8) == [(0, 8)]
    assert chunk_bounds(37, None) == chunk_bounds(37, 0) == [(0, 37)]
    with pytest.raises(ValueError, match="must be None, 0"):
        chunk_bounds(37, -1)


@pytest.mark.usefixtures("no_server_errors")
@pytest.mark.parametrize("push", [True, False], ids=["push", "relay"])
@pytest.mark.parametrize("hops", [2, 3])
def test_pipelined_generation_equals_unpipelined(swarm, reference_tokens, hops, push):
    servers = chain_servers(swarm, hops)
    runs = {}
    for chunk in (None, CHUNK):
        with connect_over(swarm, servers, push=push, prefill_chunk=chunk) as model:
            assert [s.peer_id for s in model.blocks.chain] == [peer_of(s) for s in servers]
            before = counters(servers)
            out = model.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
            runs[chunk] = out, deltas(counters(servers), before)
    (plain, plain_counts), (piped, piped_counts) = runs[None], runs[CHUNK]
    assert torch.equal(plain.sequences, reference_tokens)
    assert torch.equal(piped.sequences, reference_tokens)
    difference = (torch.stack(piped.logits) - torch.stack(plain.logits)).abs().max().item()
    assert difference <= LOGITS_TOLERANCE, f"logits differ by {difference:.2e}"
    # every server ran the 5 chunks as steps of their own, instead of one prefill step
    decode_steps = NEW_TOKENS - 1
    assert [steps for steps, _ in plain_counts] == [1 + decode_steps] * hops
    assert [steps for steps, _ in piped_counts] == [CHUNKS + decode_steps] * hops
    # with push, every server after the first got each chunk from the one before; relayed, from the client
    expected_pushes = [0] + [CHUNKS + decode_steps if push else 0] * (hops - 1)
    assert [pushes for _, pushes in piped_counts] == expected_pushes


def block_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of 2 prefill rows (the first left-padded by 3) and their positions and mask."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, PROMPT_LENGTH, HIDDEN, generator=generator)
    mask = torch.ones(2, PROMPT_LENGTH, dtype=torch.bool)
    mask[0, :3] = False
    position_ids = (mask.long().cumsum(1) - 1).clamp_min(0)
    return hidden, position_ids, mask


def run_session(model, chunk: int | None, receipts: bool) -> tuple[list[torch.Tensor], object]:
    """A block session over the chain: the padded prefill, then 2 decode steps; (outputs, session)."""
    model.blocks.prefill_chunk = chunk
    session = model.blocks.open_session(2, 64)
    if not receipts:  # no receipts asked of servers that offer them (the client's choice)
        session._driver.receipts = False
        session._driver.install(session._driver.hops)
    hidden, position_ids, mask = block_inputs(seed=11)
    outputs = [session.step(hidden, position_ids, mask)]
    generator = torch.Generator().manual_seed(12)
    for i in range(2):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], dim=1)
        positions = position_ids[:, -1:] + 1 + i
        outputs.append(session.step(torch.randn(2, 1, HIDDEN, generator=generator), positions, mask))
    assert session.position == PROMPT_LENGTH + 2
    return outputs, session


@pytest.mark.usefixtures("no_server_errors")
@pytest.mark.parametrize("receipts", [True, False], ids=["receipts", "no-receipts"])
@pytest.mark.parametrize("push", [True, False], ids=["push", "relay"])
@pytest.mark.parametrize("hops", [2, 3])
def test_pipelined_step_equals_unpipelined(swarm, hops, push, receipts):
    servers = chain_servers(swarm, hops)
    with connect_over(swarm, servers, push=push) as model:
        plain, plain_session = run_session(model, None, receipts)
        piped, piped_session = run_session(model, CHUNK, receipts)
        for got, expected in zip(piped, plain, strict=True):
            assert got.shape == expected.shape
            difference = ((got - expected).abs().max() / expected.abs().max()).item()
            assert difference <= HIDDEN_TOLERANCE, f"outputs differ by {difference:.2e} of their largest"
        # the history is that of sequential steps: one per chunk, each hop's receipts checked per chunk
        history = piped_session._history
        starts = [span.start for span in CHAINS[hops]]
        # audit mode (the default) also keeps the last hop's outputs, what its auditor's are compared with
        assert history.blocks() == [*starts, CHAINS[hops][-1].end]
        assert history.position_ids().shape == (2, PROMPT_LENGTH + 2)
        chunk_steps = [(a, b - a) for a, b in chunk_bounds(PROMPT_LENGTH, CHUNK)]
        decode_steps = [(PROMPT_LENGTH, 1), (PROMPT_LENGTH + 1, 1)]
        for block in starts:
            asked = [(r.position, r.n) for r in history.receipts(block)]
            assert asked == (chunk_steps + decode_steps if receipts else [])
            assert [(r.position, r.n) for r in plain_session._history.receipts(block)] == (
                [(0, PROMPT_LENGTH), *decode_steps] if receipts else []
            )
        # a replacement would be replayed these inputs: the same as the unpipelined session's
        for block in starts:
            got, expected = history.at(block), plain_session._history.at(block)
            assert ((got - expected).abs().max() / expected.abs().max()).item() <= HIDDEN_TOLERANCE
        plain_session.close()
        piped_session.close()


@pytest.mark.usefixtures("no_server_errors")
def test_a_prompt_no_longer_than_a_chunk_is_one_step(swarm):
    servers = chain_servers(swarm, 3)
    with connect_over(swarm, servers, prefill_chunk=CHUNK) as model:
        session = model.blocks.open_session(1, 16)
        before = counters(servers)
        hidden = torch.randn(1, CHUNK, HIDDEN, generator=torch.Generator().manual_seed(3))
        session.step(hidden, torch.arange(CHUNK)[None], None)
        assert deltas(counters(servers), before) == [(1, 0), (1, 1), (1, 1)]
        session.close()


FAILURES = {
    "crash-first-hop": (LOW, Crash(step=2)),  # dies at the third chunk
    "crash-last-hop": (HIGH, Crash(step=2)),
    "equivocate": (LOW, Equivocate(0.1, seed=1, when=When(first_step=2, last_step=2))),  # a forged third chunk
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_server_failing_mid_pipeline(swarm, reference_tokens, failure):
    span, fault = FAILURES[failure]
    faulty = swarm.add(span, lambda server: make_faulty(server, [fault]))
    try:
        spare = swarm.server(span)  # an honest replica of its span
        other = swarm.server(HIGH if span == LOW else LOW)
        chain = [faulty, other] if span == LOW else [other, faulty]
        with connect_over(swarm, [*chain, spare], prefill_chunk=CHUNK) as model:
            assert steer_through(model, chain) == [peer_of(s) for s in chain]
            got = model.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, reference_tokens)
            faults = [(e.step, e.positions) for e in faulty.server.record.entries()]
            assert faults == [(2, (16, 24))], f"the server did not fail at the third chunk alone: {faults}"
            (recovery,) = model.blocks._session.recoveries
            # the chunks every hop had answered when the failure was seen stand (at most the two before it; how
            # many the other hop had finished by then is timing): the replacement is replayed those
            assert recovery.failed == peer_of(faulty)
            assert recovery.position in (0, CHUNK, 2 * CHUNK)
            assert dict(recovery.replayed) == ({peer_of(spare): recovery.position} if recovery.position else {})
            now = [s.peer_id for s in model.blocks.chain]
            assert peer_of(faulty) not in now and peer_of(spare) in now
    finally:
        swarm.kill(faulty)
