"""Slice loading, proven on disk and in memory: a server needs only its blocks' shards, a client only
the embeddings/norm/head shard, and a server's resident memory grows with its span, not the model.

The model (random llama: hidden 512, intermediate 2048, 8 blocks, vocab 32000, untied head, fp32)
has ~16.8 MB per block and ~131 MB of embeddings + LM head, ~265 MB in all, so holding anything
beyond a span is visible in a process's resident set. ``save_sharded`` writes one shard per block
plus one for the rest; every party below starts from a copy that holds only its own shards.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from shoal.checkpoints import load_span, weight_map
from shoal.checkpoints.loading import load_tensors, span_tensor_filter
from shoal.client import AutoDistributedModelForCausalLM
from shoal.ids import BlockRange
from shoal.launch import start_parallel
from shoal.transport import Node
from testkit.tiny import save_checkpoint, tiny_checkpoint, tiny_model
from tests.helpers.aio import run
from tests.helpers.parity import assert_logits_close
from tests.helpers.servers import (
    CLIENT_CONFIG,
    block_prefixes,
    copy_keeping,
    forward,
    info,
    inputs,
    local_forward,
    peak_rss_bytes,
    rss_bytes,
    shard_files,
    start_server,
    stop_server,
    stop_servers,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_BLOCKS = 8
HIDDEN = 512
SPANS = ((0, 3), (3, 5), (5, 8))  # the middle one has blocks deleted on both sides
MB = 1 << 20
# resident-set bound for a server of a span: baseline + K * span bytes + MARGIN (see the memory test)
K = 1.5
MARGIN = 32 * MB


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    # Llama's own init (0.02): with testkit.tiny's large one, 512-wide activations would dwarf 1e-4
    return tiny_model(
        "llama",
        hidden_size=HIDDEN,
        intermediate_size=2048,
        num_hidden_layers=NUM_BLOCKS,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=256,
        initializer_range=0.02,
    )


@pytest.fixture(scope="module")
def full_dir(model, tmp_path_factory):
    return save_checkpoint(model, tmp_path_factory.mktemp("slice") / "full")


def tensor_bytes(model_dir, wanted) -> int:
    return sum(t.numel() * t.element_size() for t in load_tensors(model_dir, wanted).values())


@pytest.fixture(scope="module")
def sizes(model, full_dir) -> dict:
    """Bytes of each span's tensors, of the non-block tensors, and of the whole checkpoint."""
    spans = {(a, b): tensor_bytes(full_dir, span_tensor_filter(model.config, a, b)) for a, b in SPANS}
    whole = tensor_bytes(full_dir, lambda name: True)
    return {"spans": spans, "rest": whole - sum(spans.values()), "whole": whole}


@pytest.fixture(scope="module")
def span_dirs(full_dir, tmp_path_factory) -> dict:
    """For each span, a copy of the checkpoint holding only that span's block shards (no other
    block's shard, no embeddings/norm/head shard)."""
    root = tmp_path_factory.mktemp("span-copies")
    dirs = {}
    for a, b in SPANS:
        mine = block_prefixes(range(a, b))
        dirs[a, b] = copy_keeping(full_dir, root / f"blocks-{a}-{b}", lambda name, mine=mine: name.startswith(mine))
    return dirs


@pytest.fixture(scope="module")
def head_dir(full_dir, tmp_path_factory):
    """A copy holding only the embeddings/norm/head shard, config and index: every block shard deleted."""
    everything = block_prefixes(range(NUM_BLOCKS))
    return copy_keeping(full_dir, tmp_path_factory.mktemp("head-copy") / "head", lambda n: not n.startswith(everything))


@pytest.fixture(scope="module")
def baseline_server(tmp_path_factory):
    """A server process that loads (next to) nothing: two blocks of a 64-wide model, ~0.2 MB."""
    process = start_server(tiny_checkpoint(tmp_path_factory.mktemp("baseline")), "0:2")
    yield process
    stop_server(process)


@pytest.fixture(scope="module")
def servers(span_dirs):
    """One server per span, from its own copy, loading in parallel."""
    spans = list(span_dirs)
    started, errors = start_parallel([lambda s=s: start_server(span_dirs[s], f"{s[0]}:{s[1]}") for s in spans])
    try:
        assert not errors, "servers did not start:\n" + "\n".join(errors)
        yield dict(zip(spans, started, strict=True))
    finally:
        stop_servers(s for s in started if s is not None)


def test_copies_hold_only_their_own_shards(full_dir, span_dirs, head_dir):
    shards = shard_files(full_dir)
    assert len(shards) == NUM_BLOCKS + 1
    for (a, b), model_dir in span_dirs.items():
        present = {p.name for p in model_dir.glob("*.safetensors")}
        assert len(present) == b - a
        held = set().union(*(shards[s] for s in present))
        assert all(name.startswith(block_prefixes(range(a, b))) for name in held)
        assert weight_map(model_dir) == weight_map(full_dir)  # the index still names every shard
    (head_shard,) = head_dir.glob("*.safetensors")
    assert shards[head_shard.name] == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


def test_servers_from_their_slices_compute_their_blocks(model, full_dir, servers):
    """Each server, started from a copy with only its span's shards, reports its span and the
    fingerprints of the full checkpoint's blocks, and its forward equals the same blocks run locally
    from the full checkpoint (a masked batch of 2 included)."""

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            for (a, b), process in servers.items():
                span, prints = load_span(full_dir, a, b)
                served = (await info(node, process.ticket)).span
                assert (served.blocks, served.num_blocks) == (BlockRange(a, b), NUM_BLOCKS)
                assert served.fingerprints == [prints[i] for i in range(a, b)]
                for x in (inputs(HIDDEN, 7, seed=a), inputs(HIDDEN, 5, batch=2, seed=b, mask=True)):
                    if len(x) == 3:
                        x[2][0, 2] = False  # a masked-out token in the first row
                    torch.testing.assert_close(
                        await forward(node, process.ticket, x), local_forward(span, x), rtol=0, atol=1e-4
                    )

    run(go(), timeout=120)


def test_server_memory_grows_with_its_span_not_the_model(servers, baseline_server, sizes):
    """Bound, per server of span S: rss < baseline + 1.5 * bytes(S) + 32 MB, for the current resident
    set and for its high-water mark (VmHWM: loading never went above it either). ``baseline`` is the
    rss of a server process that imports and runs the same code but holds a ~0.2 MB model, measured
    the same way (after answering a forward). The factor allows some loading overhead, the margin
    allocator and thread-arena noise. The bound means something: the whole checkpoint (~253 MB),
    or even the embeddings and head alone (~125 MB), exceed the slack it gives each span here
    (80 MB for 2 blocks, 104 MB for 3)."""
    processes = {"baseline": baseline_server, **{f"{a}:{b}": p for (a, b), p in servers.items()}}

    async def touch():  # every server answers once before it is measured
        async with await Node.start(CLIENT_CONFIG) as node:
            await forward(node, baseline_server.ticket, inputs(64, 7))
            for process in servers.values():
                await forward(node, process.ticket, inputs(HIDDEN, 7))

    run(touch(), timeout=120)
    rss = {name: rss_bytes(p.pid) for name, p in processes.items()}
    peak = {name: peak_rss_bytes(p.pid) for name, p in processes.items()}
    report = ", ".join(f"{n}: rss {rss[n] / MB:.0f} MB (peak {peak[n] / MB:.0f})" for n in processes)
    print(f"\nmemory: {report}; whole checkpoint {sizes['whole'] / MB:.0f} MB, rest {sizes['rest'] / MB:.0f} MB")

    baseline = rss["baseline"]
    for (a, b), span_bytes in sizes["spans"].items():
        name, bound = f"{a}:{b}", baseline + K * span_bytes + MARGIN
        assert rss[name] < bound, f"server {name}: rss {rss[name] / MB:.0f} MB >= bound {bound / MB:.0f} MB"
        assert peak[name] < bound, f"server {name}: peak rss {peak[name] / MB:.0f} MB >= bound {bound / MB:.0f} MB"
        assert baseline + sizes["whole"] > bound  # serving the whole model would break the bound
        assert baseline + sizes["rest"] > bound  # so would holding the embeddings and head
        assert rss[name] > baseline + span_bytes // 2  # the blocks really are resident


def test_client_from_the_head_shard_alone_matches_the_local_model(model, head_dir, servers):
    """``AutoDistributedModelForCausalLM.from_pretrained`` from a copy without any block shard,
    over the three slice servers: stateless logits and logits through an inference session equal
    the local transformers model's."""
    tickets = [str(servers[span].ticket) for span in SPANS]
    client = AutoDistributedModelForCausalLM.from_pretrained(
        str(head_dir), initial_peers=tickets, transport=CLIENT_CONFIG
    )
    try:
        assert [(r["start"], r["end"]) for r in client.blocks.describe_route()] == list(SPANS)
        torch.manual_seed(1)
        ids = torch.randint(0, 32000, (2, 9))
        assert_logits_close(client, model, ids, atol=1e-4)
        with torch.no_grad():
            expected = model(ids[:1]).logits
            with client.inference_session(max_length=16) as cache:
                first = client(ids[:1, :6], cache=cache).logits
                rest = client(ids[:1, 6:], cache=cache).logits
        torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, rtol=0, atol=1e-4)
    finally:
        client.close()
