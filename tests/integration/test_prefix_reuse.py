"""Shared prefixes on an in-process 2-server swarm (shoal.server.prefix): a session repeating a closed
session's inputs reuses its full KV pages on both servers and answers exactly as without reuse; forged
prefixes, other peers' unshared prefixes and reclaimed pages are not reused; rollback into a shared page
copies it. Page size 16 (the default): a 40-position prompt has 2 full pages (32 positions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.inprocess import blocks_output, no_server_errors  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.usefixtures("no_server_errors"), pytest.mark.timeout(120)]

LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
PROMPT = 40  # positions: pages [0, 16) and [16, 32) are full, [32, 40) is not
FULL = 32
NEW_TOKENS = 4
HIDDEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("prefix-model"), "llama", 5, tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def swarm(model_dir):
    with InProcessSwarm(model_dir, [LOW, HIGH]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def clients(swarm):
    """Two clients: two peers."""
    return swarm.connect(), swarm.connect()


def assert_hidden_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Hidden states within 1e-4 of their largest value (this init grows them to ~50: float noise
    of chunked vs whole passes scales with them; logits are compared at 1e-4 absolute)."""
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= 1e-4 * scale


def hits(swarm: InProcessSwarm) -> list[int]:
    return [local.server.describe().counters.prefix_hit_tokens for local in swarm.servers]


def prompt_of(seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def generate(model, ids: torch.Tensor, share_prefix: int = 0):
    with model.inference_session(PROMPT + NEW_TOKENS, share_prefix=share_prefix):
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def check_answer(reference, ids: torch.Tensor, got: tuple[torch.Tensor, torch.Tensor]) -> None:
    want = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(got[0], want.sequences)
    assert torch.allclose(got[1], torch.stack(want.logits), atol=1e-4, rtol=0)


def test_a_repeated_prompt_reuses_full_pages_on_both_servers(swarm, clients, reference) -> None:
    model = clients[0]
    ids = prompt_of(1)
    first = generate(model, ids)
    check_answer(reference, ids, first)
    before = hits(swarm)
    again = generate(model, ids)
    assert [now - was for now, was in zip(hits(swarm), before, strict=True)] == [FULL, FULL]
    assert torch.equal(again[0], first[0])
    check_answer(reference, ids, again)
    longer = torch.cat([ids, prompt_of(2)[:, :8]], dim=1)  # the same prefix, a longer prompt
    before = hits(swarm)
    with model.inference_session(PROMPT + 8 + NEW_TOKENS):
        out = model.generate(longer, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert [now - was for now, was in zip(hits(swarm), before, strict=True)] == [FULL, FULL]
    assert torch.equal(out, reference.generate(longer, max_new_tokens=NEW_TOKENS, do_sample=False))


def test_a_forged_prefix_is_not_reused(swarm, clients, reference) -> None:
    """Same positions, other hidden states in the second page: only the first page is reused, and the
    answer is the forged inputs' own."""
    model = clients[0]
    hidden = torch.randn(1, PROMPT, HIDDEN, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(PROMPT)[None]
    session = model.blocks.open_session(1, PROMPT)
    session.step(hidden, positions, None)
    session.close()
    forged = hidden.clone()
    forged[0, 20] += 1e-3
    before = hits(swarm)
    session = model.blocks.open_session(1, PROMPT)
    out = session.step(forged, positions, None)
    session.close()
    assert [now - was for now, was in zip(hits(swarm), before, strict=True)] == [16, 16]
    assert_hidden_close(out, blocks_output(reference, forged))


def test_other_peers_reuse_only_shared_prefixes(swarm, clients, reference) -> None:
    owner, other = clients
    ids = prompt_of(4)
    generate(owner, ids)
    before = hits(swarm)
    check_answer(reference, ids, generate(other, ids))
    assert hits(swarm) == before  # not shared: the other peer computes it all
    shared = prompt_of(5)
    generate(owner, shared, share_prefix=16)  # its first page only
    before = hits(swarm)
    check_answer(reference, shared, generate(other, shared))
    assert [now - was for now, was in zip(hits(swarm), before, strict=True)] == [16, 16]


def test_rollback_into_a_shared_page_leaves_the_other_session_intact(swarm, clients, reference) -> None:
    model = clients[0]
    g = torch.Generator().manual_seed(6)
    hidden, other = torch.randn(1, PROMPT + 1, HIDDEN, generator=g), torch.randn(1, PROMPT, HIDDEN, generator=g)
    positions = torch.arange(PROMPT + 1)[None]
    first = model.blocks.open_session(1, PROMPT + 1)
    first.step(hidden[:, :PROMPT], positions[:, :PROMPT], None)
    second = model.blocks.open_session(1, PROMPT)
    before = hits(swarm)
    second.step(hidden[:, :PROMPT], positions[:, :PROMPT], None)  # adopts both full pages
    assert [now - was for now, was in zip(hits(swarm), before, strict=True)] == [FULL, FULL]
    second.position = 20  # into the second (shared) page
    out = second.step(other[:, 20:], positions[:, 20:PROMPT], None)
    mixed = torch.cat([hidden[:, :20], other[:, 20:]], dim=1)
    assert_hidden_close(out, blocks_output(reference, mixed)[:, 20:])
    last = first.step(hidden[:, PROMPT:], positions[:, PROMPT:], None)  # still sees its own pages
    assert_hidden_close(last, blocks_output(reference, hidden)[:, PROMPT:])
    first.close()
    second.close()


def test_reclaim_under_pressure_frees_cached_pages_lru(model_dir, reference) -> None:
    """4 pages a server: a new prompt's session takes the least recently used cached page."""
    with InProcessSwarm(model_dir, [LOW, HIGH], cache_tokens=64) as small:
        model = small.connect()
        old, new = prompt_of(7), prompt_of(8)
        check_answer(reference, old, generate(model, old))
        assert [s.server.describe().counters.prefix_cache_pages for s in small.servers] == [2, 2]
        check_answer(reference, new, generate(model, new))  # 3 pages: 2 free, 1 reclaimed (old's second)
        assert [s.server.describe().counters.prefix_cache_pages for s in small.servers] == [3, 3]
        before = hits(small)
        check_answer(reference, old, generate(model, old))
        assert [now - was for now, was in zip(hits(small), before, strict=True)] == [16, 16]
