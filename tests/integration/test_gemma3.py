"""Real Gemma-3-270M (``shoal models fetch gemma3``, base model, 18 blocks, sliding window 512 on 5 of
every 6 layers) through shoal equals local transformers in fp32.

* Two in-process servers ``[0:9] [9:18]`` (:class:`~shoal.launch.InProcessSwarm`): teacher-forced
  logits at every position of a 600-token prompt, past the window, in one stateless forward and
  through an inference session that prefills past the window then decodes token by token; and 64
  greedy tokens from a plain prompt.
* Slice loading, as ``test_slice_loading`` proves it on a random llama: ``shoal serve`` processes
  started from copies holding only their span's shards compute their blocks, keep a resident set
  bounded by their span (Gemma's 671 MB embedding matrix alone would break the bound), and a client
  from a copy holding only the embeddings/norm shard matches the local model over them.

The prompt past the window is the Gemma Terms of Use, which ``shoal models fetch`` saves beside the
weights. Stateless logits come out of the same code on both sides here: they are compared to 1e-4 and
whether they are bitwise equal is reported in the terminal summary.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from shoal.checkpoints import load_client_head, load_config, load_span, load_tensors, weight_map
from shoal.checkpoints.loading import span_tensor_filter
from shoal.client import AutoDistributedModelForCausalLM
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm, start_parallel
from shoal.transport import Node
from testkit.tiny import tiny_checkpoint
from tests.helpers.aio import run
from tests.helpers.parity import assert_logits_close, greedy_with_gap
from tests.helpers.servers import (
    CLIENT_CONFIG,
    block_prefixes,
    copy_keeping,
    forward,
    info,
    peak_rss_bytes,
    rss_bytes,
    shard_files,
    start_server,
    stop_server,
    stop_servers,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_BLOCKS = 18
SPANS = (BlockRange(0, 9), BlockRange(9, 18))
WINDOW = 512
LONG = 600  # prompt tokens: positions >= 512 no longer see the first ones in the sliding layers
PREFILL, DECODED = 540, 20  # the session: 540 at once (past the window), 20 one by one, then the rest
GREEDY_PROMPT = "Once upon a time"  # 64 greedy tokens without eos; smallest top-2 gap ~0.06
MIN_GAP = 1e-3
ATOL = 1e-4
MB = 1 << 20
K, MARGIN = 1.5, 32 * MB  # a span's server: rss < baseline + K * bytes(span) + MARGIN (see test_slice_loading)


def terms_text(model_dir: Path) -> str:
    """The Gemma Terms of Use as plain text, from the copy saved beside the weights."""
    page = (model_dir / "GEMMA_TERMS.html").read_text()
    page = re.sub(r"(?s)<(script|style).*?</\1>", " ", page)
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))
    return text[text.index("Gemma Terms of Use Last modified") :]


@pytest.fixture(scope="module")
def tokenizer(gemma3_dir):
    return AutoTokenizer.from_pretrained(str(gemma3_dir))


@pytest.fixture(scope="module")
def reference(gemma3_dir):
    model = AutoModelForCausalLM.from_pretrained(str(gemma3_dir), dtype=torch.float32).eval()
    assert model.config.sliding_window == WINDOW and model.config.num_hidden_layers == NUM_BLOCKS
    assert {"sliding_attention", "full_attention"} == set(model.config.layer_types)
    return model


@pytest.fixture(scope="module")
def long_prompt(gemma3_dir, tokenizer) -> torch.Tensor:
    ids = tokenizer(terms_text(gemma3_dir), return_tensors="pt").input_ids
    assert ids.shape[1] >= LONG, f"the terms are only {ids.shape[1]} tokens"
    return ids[:, :LONG]


@pytest.fixture(scope="module")
def swarm_model(gemma3_dir):
    with InProcessSwarm(gemma3_dir, SPANS) as swarm:
        model = swarm.connect(list(SPANS))
        assert [s.blocks for s in model.blocks.chain] == list(SPANS)
        yield model


def test_teacher_forced_logits_past_the_window(swarm_model, reference, long_prompt, parity_findings):
    """Every position of a 600-token prompt in one stateless forward, then through a session (prefill
    540, 20 decode steps, a last chunk of 40): logits within 1e-4 of local transformers."""
    with torch.no_grad():
        expected = reference(long_prompt).logits
        got = swarm_model(long_prompt).logits
    assert got.shape == expected.shape == (1, LONG, reference.config.vocab_size)
    err = float((got - expected).abs().max())
    bitwise = bool(torch.equal(got, expected))
    del got
    assert err <= ATOL, f"stateless: max |logits diff| {err} > {ATOL}"

    # the session against the same steps run locally (same shapes, so the same sums); its distance to
    # the one-forward logits, summed in other orders, is reported only. The prefill keeps its last
    # position's logits only (all 540 are checked above).
    chunks = [(0, PREFILL), *((p, p + 1) for p in range(PREFILL, PREFILL + DECODED)), (PREFILL + DECODED, LONG)]
    session_err, session_bitwise, chunking = 0.0, True, 0.0
    reference_cache = DynamicCache(config=reference.config)
    with torch.no_grad(), swarm_model.inference_session(max_length=LONG) as cache:
        for a, b in chunks:
            step, keep = long_prompt[:, a:b], 1 if a == 0 else 0
            logits = swarm_model(step, cache=cache, logits_to_keep=keep).logits
            local = reference(step, cache=reference_cache, use_cache=True, logits_to_keep=keep).logits
            session_err = max(session_err, float((logits - local).abs().max()))
            session_bitwise &= bool(torch.equal(logits, local))
            chunking = max(chunking, float((local - expected[:, b - local.shape[1] : b]).abs().max()))
    assert session_err <= ATOL, f"session: max |logits diff| {session_err} > {ATOL}"
    line = (
        f"gemma3 2 hops, {LONG} tokens (window {WINDOW}): stateless logits max|diff| {err:.3g} "
        f"(bitwise equal: {bitwise}); session (prefill {PREFILL}, {DECODED} decode steps, a chunk) "
        f"{session_err:.3g} (bitwise equal: {session_bitwise}); local chunked vs one forward {chunking:.3g}"
    )
    print(line)
    parity_findings.append(line)


def test_greedy_64_tokens(swarm_model, reference, tokenizer):
    """64 greedy tokens from a plain prompt (a base model) equal local transformers, token for token."""
    prompt = tokenizer(GREEDY_PROMPT, return_tensors="pt").input_ids
    expected, gap = greedy_with_gap(reference, prompt, max_new_tokens=64)
    assert expected.shape[1] == prompt.shape[1] + 64, "the reference stopped early"
    assert gap > MIN_GAP, f"reference greedy run has a near-tie (top-2 gap {gap:.2e})"
    got = swarm_model.generate(prompt, max_new_tokens=64, do_sample=False)
    assert got.shape == expected.shape
    mismatch = (got != expected).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at (row, col) {mismatch[0].tolist()}"


# --- slice loading ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def span_dirs(gemma3_dir, tmp_path_factory) -> dict[BlockRange, Path]:
    """For each span, a copy of the checkpoint holding only that span's block shards."""
    root = tmp_path_factory.mktemp("gemma3-spans")
    dirs = {}
    for span in SPANS:
        mine = block_prefixes(range(span.start, span.end))
        dirs[span] = copy_keeping(
            gemma3_dir, root / f"blocks-{span.start}-{span.end}", lambda n, m=mine: n.startswith(m)
        )
    return dirs


@pytest.fixture(scope="module")
def head_dir(gemma3_dir, tmp_path_factory) -> Path:
    """A copy holding only the embeddings/norm shard: every block shard deleted."""
    blocks = block_prefixes(range(NUM_BLOCKS))
    return copy_keeping(gemma3_dir, tmp_path_factory.mktemp("gemma3-head") / "head", lambda n: not n.startswith(blocks))


@pytest.fixture(scope="module")
def slice_servers(span_dirs):
    """One ``shoal serve`` process per span, from its own copy, loading in parallel."""
    started, errors = start_parallel([lambda s=s: start_server(span_dirs[s], str(s)) for s in SPANS])
    try:
        assert not errors, "servers did not start:\n" + "\n".join(errors)
        yield dict(zip(SPANS, started, strict=True))
    finally:
        stop_servers(s for s in started if s is not None)


@pytest.fixture(scope="module")
def baseline_server(tmp_path_factory):
    """A server process that holds next to nothing (two blocks of a 64-wide tiny model)."""
    process = start_server(tiny_checkpoint(tmp_path_factory.mktemp("gemma3-baseline")), "0:2")
    yield process
    stop_server(process)


def test_copies_hold_only_their_own_shards(gemma3_dir, span_dirs, head_dir):
    shards = shard_files(gemma3_dir)
    assert len(shards) == NUM_BLOCKS + 1
    for span, model_dir in span_dirs.items():
        present = {p.name for p in model_dir.glob("*.safetensors")}
        assert len(present) == len(span)
        held = set().union(*(shards[name] for name in present))
        assert all(name.startswith(block_prefixes(range(span.start, span.end))) for name in held)
        assert weight_map(model_dir) == weight_map(gemma3_dir)
    (head_shard,) = head_dir.glob("*.safetensors")
    assert shards[head_shard.name] == {"model.embed_tokens.weight", "model.norm.weight"}  # tied: no lm_head


def test_servers_from_their_slices_compute_their_blocks(gemma3_dir, slice_servers, tokenizer):
    """Each server reports its span and the full checkpoint's block fingerprints, and answers a
    forward of real hidden states (the embedded prompt, then the first span's output) as the same
    blocks built locally from the full checkpoint do."""
    ids = tokenizer(GREEDY_PROMPT + ", there was a little girl", return_tensors="pt").input_ids
    hidden = load_client_head(gemma3_dir).embed(ids)
    positions = torch.arange(ids.shape[1])[None]

    async def go():
        nonlocal hidden
        async with await Node.start(CLIENT_CONFIG) as node:
            for span, process in slice_servers.items():
                local, prints = load_span(gemma3_dir, span.start, span.end)
                served = (await info(node, process.ticket)).span
                assert (served.blocks, served.num_blocks) == (span, NUM_BLOCKS)
                assert served.fingerprints == [prints[i] for i in range(span.start, span.end)]
                expected = local(hidden, positions, None)
                got = await forward(node, process.ticket, [hidden, positions])
                scale = float(expected.abs().max())  # Gemma's residual stream reaches the thousands
                torch.testing.assert_close(got, expected, rtol=0, atol=ATOL * max(1.0, scale))
                hidden = expected

    run(go(), timeout=120)


def test_server_memory_grows_with_its_span_not_the_model(gemma3_dir, slice_servers, baseline_server):
    """rss and its high-water mark < baseline + 1.5 * bytes(span) + 32 MB for each server, where the
    whole checkpoint, or the embeddings alone, would not fit under that bound."""

    def tensor_bytes(wanted) -> int:
        return sum(t.numel() * t.element_size() for t in load_tensors(gemma3_dir, wanted).values())

    config = load_config(gemma3_dir)
    spans = {s: tensor_bytes(span_tensor_filter(config, s.start, s.end)) for s in SPANS}
    whole = tensor_bytes(lambda name: True)
    rest = whole - sum(spans.values())

    async def touch():  # each server answers once before it is measured
        async with await Node.start(CLIENT_CONFIG) as node:
            await forward(node, baseline_server.ticket, [torch.randn(1, 7, 64), torch.arange(7)[None]])
            for process in slice_servers.values():
                await forward(node, process.ticket, [torch.randn(1, 7, config.hidden_size), torch.arange(7)[None]])

    run(touch(), timeout=120)
    baseline = rss_bytes(baseline_server.pid)
    for span, process in slice_servers.items():
        rss, peak, bound = rss_bytes(process.pid), peak_rss_bytes(process.pid), baseline + K * spans[span] + MARGIN
        print(f"\ngemma3 server {span}: rss {rss / MB:.0f} MB, peak {peak / MB:.0f} MB, bound {bound / MB:.0f} MB")
        assert rss < bound and peak < bound, f"server {span}: rss {rss / MB:.0f} / peak {peak / MB:.0f} MB >= bound"
        assert baseline + whole > bound and baseline + rest > bound  # holding more would break it
        assert rss > baseline + spans[span] // 2  # the blocks really are resident


def test_client_from_the_head_shard_alone_matches_the_local_model(head_dir, slice_servers, reference, tokenizer):
    """A client from the copy without any block shard, over the two slice servers: stateless logits
    and logits through an inference session equal local transformers'."""
    client = AutoDistributedModelForCausalLM.from_pretrained(
        str(head_dir), initial_peers=[str(slice_servers[s].ticket) for s in SPANS], transport=CLIENT_CONFIG
    )
    try:
        assert [(r["start"], r["end"]) for r in client.blocks.describe_route()] == [(s.start, s.end) for s in SPANS]
        tokenizer.padding_side = "left"
        batch = tokenizer([GREEDY_PROMPT + " in a land far away", "The bicycle"], padding=True, return_tensors="pt")
        ids, mask = batch.input_ids, batch.attention_mask
        assert not mask.all(), "the batch should need padding"
        assert_logits_close(client, reference, ids, atol=ATOL, attention_mask=mask)
        with torch.no_grad():
            expected = reference(ids[:1]).logits
            with client.inference_session(max_length=16) as cache:
                first = client(ids[:1, :4], cache=cache).logits
                rest = client(ids[:1, 4:], cache=cache).logits
        torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, rtol=0, atol=ATOL)
    finally:
        client.close()
