"""The training tests' servers: fresh real servers of a tiny random llama for each test
(:func:`serve`), its local blocks (:func:`span`), and a LoRA adapter for it (:func:`adapter_dir`)."""

from __future__ import annotations

import pytest
import torch

from shoal.checkpoints import load_config, load_span
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.models.lora import SpanAdapters, read_adapter
from testkit.tiny import tiny_checkpoint, tiny_model
from tests.server.training.bench import SEED, SPAN


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-training"), "llama", seed=SEED)


@pytest.fixture(scope="module")
def span(model_dir):
    return load_span(model_dir, *SPAN)[0]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A LoRA adapter of the tiny llama made with peft, B matrices non-zero (so it changes outputs)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(7)
    model = get_peft_model(tiny_model("llama", SEED), config)
    out = tmp_path_factory.mktemp("tiny-lora")
    model.save_pretrained(out)
    return out


@pytest.fixture
def serve(model_dir):
    """``serve(span=SPAN, **settings)``: an :class:`InProcessSwarm` of one server, closed after the test."""
    swarms: list[InProcessSwarm] = []

    def make(span=SPAN, **settings) -> InProcessSwarm:
        swarm = InProcessSwarm(model_dir, [], cache_tokens=512)
        swarms.append(swarm)
        swarm.add(BlockRange(*span), **settings)  # any ServerConfig field: dtype, adapters ...
        return swarm

    yield make
    for swarm in swarms:
        swarm.close()


# ---- LoRA adapters -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapted_span(model_dir, adapter_dir):
    """Local blocks 1:3 with the adapter under the name ``tuned``."""
    span = load_span(model_dir, *SPAN)[0]
    adapters = SpanAdapters(span)
    adapters.add("tuned", read_adapter(adapter_dir, load_config(model_dir), *SPAN))
    return span, adapters
