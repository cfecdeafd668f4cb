"""Shared pieces of the gateway tests: the tiny chat model, one 3-server swarm with metrics, and one
gateway (``shoal api``) over it. Package-scoped: they stop when the last test of tests/gateway ends,
not at the end of the whole run. The browser test starts its own swarm (it stops a server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.gateway.support import MetricsSwarm, build_chat_model, gateway

API_KEY = "test-key-4b1d"
MODEL_ID = "tinychat"  # the model directory's name: what the swarm and the gateway call it


@pytest.fixture(scope="package")
def smollm2_tokenizer_dir(smollm2_dir) -> Path:
    """SmolLM2's directory: the tiny chat model borrows its tokenizer and chat template."""
    return smollm2_dir


@pytest.fixture(scope="package")
def chat_model(tmp_path_factory, smollm2_tokenizer_dir):
    """(model_dir, reference transformers model, tokenizer)."""
    model_dir = tmp_path_factory.mktemp("models") / MODEL_ID
    reference = build_chat_model(model_dir, smollm2_tokenizer_dir)
    return model_dir, reference, AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="package")
def swarm(chat_model):
    swarm = MetricsSwarm(chat_model[0]).start()
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture(scope="package")
def api(chat_model, swarm):
    """The running gateway (``.url``), requiring :data:`API_KEY`."""
    with gateway(chat_model[0], swarm.ticket, "--api-key", API_KEY) as process:
        yield process
