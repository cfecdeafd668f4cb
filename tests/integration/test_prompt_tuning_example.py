"""``examples/prompt_tuning.py``, shortened: the soft prompt it trains through a SmolLM2 swarm halves the loss."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "prompt_tuning.py"


def load_example():
    spec = importlib.util.spec_from_file_location("prompt_tuning_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_the_example_halves_its_loss_and_saves_prompts_that_load(smollm2_dir, tmp_path, capsys):
    example = load_example()
    saved = tmp_path / "prompts.safetensors"
    summary = example.main(["--steps", "12", "--save", str(saved)])
    out = capsys.readouterr().out
    assert sum(line.startswith("step ") for line in out.splitlines()) == 12 and "held-out reviews labelled right" in out
    assert summary["last_5_mean_loss"] <= 0.5 * summary["first_5_mean_loss"], summary
    assert saved.is_file() and saved.stat().st_size > 0
