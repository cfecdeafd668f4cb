"""The fault tests' tiny random llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.tiny import save_checkpoint, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = tiny_model("llama", seed=21, num_hidden_layers=3)
    return save_checkpoint(model, tmp_path_factory.mktemp("faults-model"))
