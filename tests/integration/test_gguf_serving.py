"""GGUF-served spans in a swarm: what they announce, and what a client gets through two of them.

The tiny llama written as GGUF (``testkit.tiny_gguf``) runs by default; the known models' files
(``@pytest.mark.slow``, skipped unless fetched) compare greedy tokens with the same swarm on their
fp32 checkpoints, the figures ``python -m bench.compression`` reports."""

from __future__ import annotations

import pytest
import torch

from shoal.checkpoints import load_client_head, load_config, load_span
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.quantization import Quantization
from testkit.tiny_gguf import tiny_gguf_checkpoint

pytestmark = pytest.mark.timeout(300)
SPANS = (BlockRange(0, 2), BlockRange(2, 4))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = InProcessSwarm(tiny_gguf_checkpoint(tmp_path_factory.mktemp("gguf-swarm")), [])
    try:
        for span in SPANS:
            swarm.add(span, quant=Quantization.GGUF)
        yield swarm
    finally:
        swarm.close()


def test_servers_announce_gguf_and_the_files_fingerprints(swarm):
    _, prints = load_span(swarm.model_dir, 0, 4, quantization=Quantization.GGUF)
    for local in swarm.servers:
        assert local.server.info.quantization is Quantization.GGUF
        assert local.server.info.fingerprints == [prints[i] for i in range(local.blocks.start, local.blocks.end)]


def test_a_client_through_two_gguf_servers_computes_what_the_spans_compute_here(swarm):
    client = swarm.connect()  # the default min_quality (int8 and better) accepts gguf
    head = load_client_head(swarm.model_dir)
    first, _ = load_span(swarm.model_dir, 0, 2, quantization=Quantization.GGUF)
    second, _ = load_span(swarm.model_dir, 2, 4, quantization=Quantization.GGUF)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None]
    with torch.no_grad():
        expected = head.logits(second(first(head.embed(ids), positions, None), positions, None))
    torch.testing.assert_close(client(ids).logits, expected, rtol=0, atol=1e-4)


PROMPTS = (
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Why is the sky blue? Answer in two sentences.",
    "At what temperature does water boil at sea level?",
)


def _greedy(model_dir, quant: Quantization) -> list[list[int]]:
    with InProcessSwarm(model_dir, [], cache_tokens=1024) as swarm:
        num_blocks = load_config(model_dir).num_hidden_layers
        for span in (BlockRange(0, num_blocks // 2), BlockRange(num_blocks // 2, num_blocks)):
            swarm.add(span, quant=quant)
        model = swarm.connect()
        outs = []
        for prompt in PROMPTS:
            ids = model.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
                return_dict=True,
            )["input_ids"]  # fmt: skip
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            outs.append(out[0, ids.shape[1] :].tolist())
        return outs


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("model", ["smollm2"])
def test_greedy_tokens_through_gguf_servers_follow_the_fp32_checkpoints(model):
    """Measured (this Xeon, torch 2.13): smollm2 matches 64 of 64 tokens on 4 prompts and 19 on the
    first (a near tie flips under bf16 activations); asserted: every prompt's first 16 tokens and
    4 of 5 prompts whole."""
    from shoal.checkpoints.fetch import is_fetched, model_cache_dir

    model_dir = model_cache_dir(model)
    if not is_fetched(model) or not list(model_dir.glob("*.gguf")):
        pytest.skip(f"{model} or its GGUF is not fetched (shoal models fetch {model})")
    reference, served = _greedy(model_dir, Quantization.NONE), _greedy(model_dir, Quantization.GGUF)
    pairs = zip(reference, served, strict=True)
    matches = [next((i for i, (a, b) in enumerate(zip(r, s, strict=True)) if a != b), 64) for r, s in pairs]
    assert min(matches) >= 16 and sum(m == 64 for m in matches) >= 4, matches


@pytest.mark.slow
def test_shoal_serve_a_known_models_gguf_file_serves_it_as_stored():
    """``shoal serve FILE.gguf --blocks 0:2``: the known model's swarm, gguf in its ``info``, the
    file's fingerprints, and the forward the GGUF span computes here."""
    from shoal.checkpoints.fetch import is_fetched, model_cache_dir
    from shoal.transport import Node
    from tests.helpers.aio import run
    from tests.helpers.servers import CLIENT_CONFIG, forward, info, inputs, local_forward, start_server, stop_server

    model_dir = model_cache_dir("smollm2")
    files = list(model_dir.glob("*.gguf"))
    if not is_fetched("smollm2") or not files:
        pytest.skip("smollm2 or its GGUF is not fetched (shoal models fetch smollm2)")
    process = start_server(files[0], "0:2")
    try:
        x = inputs(576, 5)

        async def ask():
            async with await Node.start(CLIENT_CONFIG) as node:
                return (await info(node, process.ticket)).span, await forward(node, process.ticket, x)

        served, output = run(ask(), timeout=120)
    finally:
        stop_server(process)
    span, prints = load_span(model_dir, 0, 2, quantization=Quantization.GGUF)
    assert served.quantization is Quantization.GGUF and served.model == "smollm2"
    assert served.fingerprints == [prints[0], prints[1]]
    torch.testing.assert_close(output, local_forward(span, x), rtol=0, atol=1e-4)
