"""``shoal serve --quant``: what cannot be had is one ``shoal: error:`` line (exit 2), before the
server binds a port or reads a weight."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testkit.tiny import tiny_checkpoint
from tests.cli.test_errors import USAGE, assert_one_line_error, shoal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("quant-cli") / "llama")


@pytest.fixture
def without_bitsandbytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Child processes find a ``bitsandbytes`` that fails to import, as an absent package does."""
    package = tmp_path / "hidden" / "bitsandbytes"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('No module named bitsandbytes')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(package.parent), os.environ.get("PYTHONPATH")])))


def test_a_missing_library_names_the_package_and_the_extra(llama_dir: Path, without_bitsandbytes: None):
    outcome = shoal("serve", str(llama_dir), "--blocks", "0:2", "--quant", "nf4")
    assert_one_line_error(outcome, USAGE, "--quant nf4 needs the bitsandbytes package", "pip install 'shoal[quant]'")


def test_nf4_refuses_moe_experts_before_reading_a_weight(tmp_path: Path):
    moe = tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    for weights in moe.glob("*.safetensors"):
        weights.write_bytes(b"\xff" * 64)  # nothing could load these: the refusal comes first
    outcome = shoal("serve", str(moe), "--blocks", "0:2", "--quant", "nf4")
    assert_one_line_error(outcome, USAGE, "--quant nf4 cannot hold MoE expert tensors", "use --quant int8")


def test_an_unknown_format_is_refused_by_the_parser(llama_dir: Path):
    outcome = shoal("serve", str(llama_dir), "--blocks", "0:2", "--quant", "int3")
    assert outcome.status == USAGE and "invalid choice: 'int3'" in outcome.stderr
