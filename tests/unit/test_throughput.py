"""Throughput measurement and memory sizing (shoal/server/throughput.py) on tiny configs."""

from __future__ import annotations

import json
import time

import pytest
import torch

from shoal.server.throughput import (
    MIN_MARGIN_BYTES,
    PROMPT_TOKENS,
    ComputeMeasurement,
    announced_throughput,
    block_bytes,
    cache_key,
    cached_compute,
    default_num_blocks,
    measure_compute,
    network_tokens_per_s,
)
from testkit.tiny import tiny_config

pytestmark = pytest.mark.timeout(60)


def tiny(model_type: str = "llama", blocks: int = 12):
    return tiny_config(model_type, num_hidden_layers=blocks)


# hidden 64, intermediate 128, 4 heads of 16, 2 kv heads: q, o 64x64; k, v 64x32; mlp 3 x 64x128; 2 norms
PARAMS_PER_BLOCK = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
KV_BYTES_PER_TOKEN = 2 * 2 * 16 * 4  # keys and values, 2 kv heads of 16, float32


def test_block_bytes_count_every_weight_in_the_serving_dtype():
    assert block_bytes(tiny(), torch.float32) == PARAMS_PER_BLOCK * 4
    assert block_bytes(tiny(), torch.bfloat16) == PARAMS_PER_BLOCK * 2
    assert block_bytes(tiny("qwen2"), torch.float32) == (PARAMS_PER_BLOCK + 64 + 32 + 32) * 4  # q/k/v biases


def test_default_num_blocks_is_what_fits_in_free_memory_less_a_margin():
    per_block = PARAMS_PER_BLOCK * 4 + 1000 * KV_BYTES_PER_TOKEN
    free = MIN_MARGIN_BYTES + 5 * per_block + per_block // 2  # margin: 1 GiB (10% of this is less)
    assert default_num_blocks(tiny(), torch.float32, "cpu", 1000, free_bytes=free) == 5
    assert default_num_blocks(tiny(blocks=3), torch.float32, "cpu", 1000, free_bytes=free) == 3  # the model's
    big_free = 100 * 2**30  # the margin is then 10%
    assert default_num_blocks(tiny(blocks=10**6), torch.float32, "cpu", 1000, free_bytes=big_free) == int(
        (big_free - big_free // 10) // per_block
    )
    with pytest.raises(ValueError, match="not enough free memory on cpu for one block"):
        default_num_blocks(tiny(), torch.float32, "cpu", 1000, free_bytes=MIN_MARGIN_BYTES + per_block - 1)
    assert default_num_blocks(tiny(), torch.float32, "cpu", 1000) >= 1  # this machine's free memory


def test_announced_throughput_is_the_slower_of_compute_and_network():
    compute = ComputeMeasurement(step_ms=2.0, prefill_tokens_per_s=5000.0, prompt_tokens=512)
    assert compute.decode_tokens_per_s == 500.0
    assert network_tokens_per_s(64 * 8 * 1000, 64) == 1000.0  # a float32 hidden state in and out per token
    assert announced_throughput(compute, None, 64) == 500.0
    assert announced_throughput(compute, 64 * 8 * 1000, 64) == 500.0
    assert announced_throughput(compute, 64 * 8 * 100, 64) == 100.0


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_measurement_of_a_tiny_model_is_fast_and_plausible(model_type):
    started = time.perf_counter()
    measured = measure_compute(tiny(model_type), torch.float32, "cpu")
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0
    assert 0 < measured.step_ms < 50 and measured.prompt_tokens == PROMPT_TOKENS
    # one 512-token prompt runs faster per token than 512 single steps
    assert measured.prefill_tokens_per_s > measured.decode_tokens_per_s


def test_a_big_block_is_measured_within_the_time_budget():
    config = tiny()
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 1024, 4096, 16
    config.num_key_value_heads, config.head_dim = 4, 64
    started = time.perf_counter()
    measured = measure_compute(config, torch.float32, "cpu", time_budget=0.3)
    assert time.perf_counter() - started < 2.0
    assert 32 <= measured.prompt_tokens <= PROMPT_TOKENS and measured.step_ms > 0


def test_measurements_are_cached_per_config_dtype_and_threads(tmp_path):
    path = tmp_path / "throughput.json"
    first, cached = cached_compute(tiny(), torch.float32, "cpu", path)
    assert not cached
    again, cached = cached_compute(tiny(), torch.float32, "cpu", path)
    assert cached and again == first
    # the model's name and path do not matter, its shape does
    renamed = tiny()
    renamed._name_or_path = "/elsewhere/model"
    assert cached_compute(renamed, torch.float32, "cpu", path) == (first, True)
    _, cached = cached_compute(tiny(blocks=4), torch.float32, "cpu", path)  # another config
    assert not cached
    _, cached = cached_compute(tiny(), torch.bfloat16, "cpu", path)
    assert not cached
    saved = json.loads(path.read_text())
    assert len(saved) == 3
    key = cache_key(tiny(), torch.float32, "cpu", torch.get_num_threads())
    assert saved[key]["step_ms"] == first.step_ms
    assert f"threads={torch.get_num_threads()}" in key and f"torch={torch.__version__}" in key
    # a broken cache file is measured over, not trusted
    path.write_text("{not json")
    _, cached = cached_compute(tiny(), torch.float32, "cpu", path)
    assert not cached and key in json.loads(path.read_text())
