"""GGUF tensors served as they are: their codes dequantise to exactly what gguf-py (and so the fp32
checkpoints shoal fetches) make of them, and the int4 kernel computes with them at bf16 precision.

A tiny random llama written as GGUF (``testkit.tiny_gguf``) covers the loader end to end; the real
files of the known models, where fetched, cover Q4_K and the rope permutation of real q/k rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.checkpoints import load_span
from shoal.checkpoints.gguf import GGUFSource, find_gguf
from shoal.checkpoints.loading import CheckpointError, load_config, load_tensors
from shoal.quantization import Quantization, parse_min_quality
from shoal.quantization.gguf import PACKED_TYPES, Int4Linear, affine_codes, int4_grid
from testkit.tiny_gguf import TYPES, tiny_gguf_checkpoint

pytestmark = pytest.mark.timeout(120)
#: one matmul through the kernel against fp32 (bf16 activations, scales and output): measured 0.2-0.35%
MATMUL_RTOL = 0.01
#: the tiny random llama's 4 blocks on N(0, 1) inputs: gguf 2.7%, a bf16 server 3.8% (random blocks amplify)
SPAN_RTOL = 0.06


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf_checkpoint(tmp_path_factory.mktemp("tiny-gguf"))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_codes_dequantise_exactly_as_gguf_py_and_the_kernel_computes_with_them(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType[type_name]
    weights = np.random.default_rng(0).standard_normal((96, 128)).astype(np.float32)
    raw = quantize(weights, kind)
    reference = dequantize(raw, kind)
    codes = affine_codes(raw, type_name, 128)
    assert codes.codes.max() < 2 ** PACKED_TYPES[type_name]
    np.testing.assert_array_equal(codes.dequantize(), reference)  # bit for bit
    layer = Int4Linear(codes, bias=torch.ones(96))
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1))
    expected = x @ torch.from_numpy(reference).t() + 1
    assert layer(x).shape == (3, 5, 96) and layer(x).dtype == torch.float32
    assert relative(layer(x), expected) < MATMUL_RTOL


def test_int4_grid_is_q4_1s_grid():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    grid = int4_grid(weight)
    w = torch.from_numpy(grid.dequantize())
    assert grid.codes.max() <= 15 and relative(w, weight) < 0.1  # 4 bits per weight
    assert relative(Int4Linear(grid).dequantized(), w) < MATMUL_RTOL


def test_a_span_served_from_gguf_holds_the_files_codes_and_computes_like_the_checkpoint(tiny):
    config = load_config(tiny)
    source = GGUFSource(find_gguf(tiny), config)
    reference = load_tensors(tiny, lambda name: ".layers." in name)
    seen = set()
    for name, tensor in source.block_tensors("model.layers.").items():
        rows, type_name = source.read(tensor)
        if type_name in PACKED_TYPES:
            seen.add(type_name)
            dequantized = affine_codes(rows, type_name, int(tensor.shape[0])).dequantize()
            np.testing.assert_array_equal(dequantized, reference[name].numpy())  # q/k rows un-permuted too
    assert seen == set(TYPES)
    served, prints = load_span(tiny, 0, 4, quantization=Quantization.GGUF)
    full, checkpoint_prints = load_span(tiny, 0, 4)
    assert sum(isinstance(m, Int4Linear) for m in served.modules()) == 4 * 7
    assert prints != checkpoint_prints and load_span(tiny, 1, 3, quantization="gguf")[1] == {1: prints[1], 2: prints[2]}
    x = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5)[None]
    with torch.no_grad():
        assert relative(served(x, positions, None), full(x, positions, None)) < SPAN_RTOL


def test_a_directory_without_a_gguf_file_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="needs the model's GGUF file"):
        find_gguf(tmp_path)


def test_gguf_ranks_between_full_precision_and_int8():
    assert Quantization.GGUF.satisfies(parse_min_quality("int8"))
    assert not Quantization.GGUF.satisfies(parse_min_quality("fp32"))
    assert Quantization.GGUF.satisfies(Quantization.GGUF) and not Quantization.INT8.satisfies(Quantization.GGUF)


@pytest.mark.parametrize("model", ["smollm2", "qwen2.5-coder"])
def test_the_known_models_gguf_codes_are_their_fp32_checkpoint_bit_for_bit(model):
    from shoal.checkpoints.fetch import is_fetched, model_cache_dir

    model_dir = model_cache_dir(model)
    if not is_fetched(model) or not list(model_dir.glob("*.gguf")):
        pytest.skip(f"{model} or its GGUF is not fetched (shoal models fetch {model})")
    config = load_config(model_dir)
    source = GGUFSource(find_gguf(model_dir), config)
    block = 11  # qwen2.5-coder's block 11 holds Q4_K and Q5_0 matrices (and q/k rows permuted)
    reference = load_tensors(model_dir, lambda name: name.startswith(f"model.layers.{block}."))
    types = set()
    for name, tensor in source.block_tensors(f"model.layers.{block}.").items():
        rows, type_name = source.read(tensor)
        if type_name in PACKED_TYPES:
            types.add(type_name)
            codes = affine_codes(rows, type_name, int(tensor.shape[0]))
            np.testing.assert_array_equal(codes.dequantize(), reference[name].numpy())
    assert types == ({"Q4_1"} if model == "smollm2" else {"Q4_K", "Q5_0"})
