"""Quantised spans (``load_span(..., quantization=...)``) against full precision, what their weights
cost, and the errors when a format cannot be had.

Random models are a harsh test for quantisation (gaussian weights, near-tied logits), so the
tolerances below are stated against what was measured on these models, not against real checkpoints
(the benchmark measures perplexity on real weights): with Llama's own init (0.02), hidden 256, int8
logits are 1.4-1.9% off fp32 (relative L2; per row, bf16 activations) and nf4's 20-24%, while two
different random models' logits are ~140% apart; the argmax at each position of the fp32 greedy
sequence agrees 89-100% for int8 (per group of 32: 1.3-1.4% and 96-100%, at 1.25 bytes per weight).
"""

from __future__ import annotations

import sys

import pytest
import torch

from shoal.checkpoints import load_client_head, load_config, load_span
from shoal.errors import UsageError
from shoal.quantization import Quantization
from shoal.quantization.libraries import LIBRARIES, require_library
from shoal.quantization.weights import held_bytes, planned_bytes, quantized_weight_bytes
from shoal.server.preflight import check_model, check_quantization
from shoal.server.throughput import MIN_MARGIN_BYTES, block_bytes, default_num_blocks, meta_block
from testkit.tiny import save_checkpoint, tiny_checkpoint, tiny_config, tiny_model

pytestmark = pytest.mark.timeout(300)
INT8, NF4 = Quantization.INT8, Quantization.NF4
PROMPT = [1, 5, 9, 200]
INT8_LOGITS_RTOL, NF4_LOGITS_RTOL, INT8_ARGMAX_AGREEMENT = 0.03, 0.3, 0.85


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=[0, 1, 2])
def realistic(request, tmp_path_factory):
    """A 4-block llama with Llama's own init, wide enough for quantisation to behave as it does on real
    weights: its checkpoint, client head, fp32 greedy sequence and the fp32 logits along it."""
    model = tiny_model("llama", seed=request.param, initializer_range=0.02, hidden_size=256, intermediate_size=512)
    path = save_checkpoint(model, tmp_path_factory.mktemp("realistic") / f"seed{request.param}")
    head = load_client_head(path)
    span, _ = load_span(path, 0, 4)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(24):
            logits = head.logits(span(head.embed(ids), torch.arange(ids.shape[1])[None], None))
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
        logits = head.logits(span(head.embed(ids), torch.arange(ids.shape[1])[None], None))
    return path, head, ids, logits


def logits_along(path, head, ids, quantization: Quantization) -> torch.Tensor:
    span, _ = load_span(path, 0, 4, quantization=quantization)
    with torch.no_grad():
        return head.logits(span(head.embed(ids), torch.arange(ids.shape[1])[None], None))


def test_int8_logits_are_close_and_its_greedy_choices_mostly_equal(realistic):
    path, head, ids, expected = realistic
    logits = logits_along(path, head, ids, INT8)
    assert relative(logits, expected) < INT8_LOGITS_RTOL
    agreement = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agreement >= INT8_ARGMAX_AGREEMENT, f"int8 picks fp32's token at {agreement:.0%} of positions"


def test_nf4_logits_are_near_fp32_and_far_from_another_model(realistic, tmp_path):
    path, head, ids, expected = realistic
    assert relative(logits_along(path, head, ids, NF4), expected) < NF4_LOGITS_RTOL
    other = save_checkpoint(
        tiny_model("llama", seed=9, initializer_range=0.02, hidden_size=256, intermediate_size=512), tmp_path
    )
    span, _ = load_span(other, 0, 4)
    with torch.no_grad():
        unrelated = head.logits(span(head.embed(ids), torch.arange(ids.shape[1])[None], None))
    assert relative(unrelated, expected) > 4 * NF4_LOGITS_RTOL  # the bound above means something


def test_fingerprints_are_the_checkpoints_whatever_the_format(tmp_path):
    path = tiny_checkpoint(tmp_path)
    full, expected = load_span(path, 1, 3)
    for quantization in (INT8, NF4):
        span, prints = load_span(path, 1, 3, quantization=quantization)
        assert prints == expected
        assert held_bytes(span) < 0.3 * held_bytes(full)  # fp32 -> int8 or nf4 matrices


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_planned_bytes_are_what_a_quantised_block_holds(family, tmp_path):
    """Placement's arithmetic (``planned_bytes``, from a meta block) against the bytes a built
    block holds after a step (nf4 repacks its scales for the CPU kernel on the first one)."""
    path = tiny_checkpoint(tmp_path, family)
    config = load_config(path)
    for quantization in (INT8, NF4) if family != "qwen3_moe" else (INT8,):
        span, _ = load_span(path, 0, 2, quantization=quantization)
        with torch.no_grad():
            span(torch.randn(1, 3, config.hidden_size), torch.arange(3)[None], None)
        planned = [planned_bytes(meta_block(config, i), torch.float32, quantization) for i in range(2)]
        assert [held_bytes(block) for block in span.layers] == planned
    assert quantized_weight_bytes((64, 128), INT8) == 64 * 128 + 64 * 2  # Int8Linear: a bf16 scale per row
    assert quantized_weight_bytes((4, 64, 128), INT8) == 4 * 64 * 128 + 4 * 64 * 5  # experts: torchao's


def test_moe_experts_are_quantised_to_int8_and_refused_by_nf4(tmp_path):
    path = tiny_checkpoint(tmp_path, "qwen3_moe")
    config = load_config(path)
    span, _ = load_span(path, 0, 4)
    quantised, _ = load_span(path, 0, 4, quantization=INT8)
    experts = quantised.layers[1].mlp.experts
    assert type(experts.gate_up_proj).__name__ == "Int8Tensor" and experts.down_proj.dim() == 3
    x, positions = (
        torch.randn(1, 6, config.hidden_size, generator=torch.Generator().manual_seed(0)),
        torch.arange(6)[None],
    )
    with torch.no_grad():
        assert relative(quantised(x, positions, None), span(x, positions, None)) < 0.05  # measured 0.4-3%
    with pytest.raises(UsageError, match=r"--quant nf4 cannot hold MoE expert tensors \(down_proj, gate_up_proj"):
        check_quantization(NF4, check_model(str(path)))  # before a weight is read
    with pytest.raises(UsageError, match="--quant nf4 cannot hold MoE expert tensors"):
        load_span(path, 0, 4, quantization=NF4)


def test_placement_counts_quantised_bytes():
    """``default_num_blocks`` fits blocks at their quantised size, keeping room for one block in full
    precision (the one being loaded, before it is quantised)."""
    config = tiny_config(
        "llama", hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_hidden_layers=1000
    )
    full, int8, nf4 = (block_bytes(config, torch.bfloat16, q) for q in (Quantization.NONE, INT8, NF4))
    assert int8 < 0.51 * full and nf4 < 0.27 * full
    free = MIN_MARGIN_BYTES + 40 * full  # the margin a server keeps free, and room for 40 bf16 blocks
    fits = {
        q: default_num_blocks(config, torch.bfloat16, "cpu", 0, free_bytes=free, quantization=q) for q in Quantization
    }
    gguf = block_bytes(config, torch.bfloat16, Quantization.GGUF)
    assert fits == {
        Quantization.NONE: 40,
        INT8: 39 * full // int8,
        NF4: 39 * full // nf4,
        Quantization.GGUF: 39 * full // gguf,
    }
    assert fits[INT8] >= 77 and fits[NF4] >= 146


def test_a_missing_library_is_one_usage_error(monkeypatch):
    for quantization, (package, modules) in LIBRARIES.items():
        with monkeypatch.context() as patch:
            for name in [package, *modules]:
                patch.setitem(sys.modules, name, None)  # what import finds when the package is absent
            with pytest.raises(
                UsageError,
                match=rf"^--quant {quantization} needs the {package} package .*"
                r": pip install 'shoal\[quant\]'$",
            ):
                require_library(quantization)
    assert require_library(Quantization.NONE) is Quantization.NONE


def test_quantising_in_chunks_changes_nothing(monkeypatch):
    """Large matrices are quantised a few rows at a time (bounded temporaries while loading): the
    result is bitwise what the libraries make of the whole matrix."""
    import bitsandbytes as bnb
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    from shoal.quantization import weights

    monkeypatch.setattr(weights, "QUANT_CHUNK", 5000)  # several chunks for these shapes
    generator = torch.Generator().manual_seed(0)
    for shape, dtype in (((300, 128), torch.float32), ((4, 96, 64), torch.bfloat16)):
        weight = torch.randn(shape, generator=generator).to(dtype)
        chunked, whole = weights.int8_rows(weight), Int8Tensor.from_hp(weight, granularity=PerRow())
        for name in ("qdata", "scale", "zero_point"):
            assert torch.equal(getattr(chunked, name), getattr(whole, name))
        assert chunked.block_size == whole.block_size and chunked.shape == whole.shape
    weight = torch.randn(300, 128, generator=generator)
    data, state = weights.nf4_rows(weight)
    expected, expected_state = bnb.functional.quantize_4bit(
        weight, blocksize=64, compress_statistics=False, quant_type="nf4"
    )
    assert torch.equal(data, expected) and torch.equal(state.absmax, expected_state.absmax)
    assert state.shape == weight.shape
