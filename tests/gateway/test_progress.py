"""Progress bars of long loads: shown on a terminal, never when output is not a terminal or with
``progress=False``, and only for work that takes a while."""

from __future__ import annotations

import io
import sys
import time

import pytest

from shoal.checkpoints import fetch, loading, save_sharded
from testkit.tiny import tiny_model

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_model("llama", 1)
    return save_sharded(model, model.config, tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def slow_reads(monkeypatch):
    """Every tensor read takes 40 ms: a load of the whole checkpoint outlasts the bars' delay."""
    real = loading.safe_open

    class Slow:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_tensor(self, name):
            time.sleep(0.04)
            return self.file.get_tensor(name)

    monkeypatch.setattr(loading, "safe_open", Slow)


def load_with_stderr(monkeypatch, checkpoint, stderr, progress) -> dict:
    monkeypatch.setattr(sys, "stderr", stderr)
    return loading.load_tensors(checkpoint, lambda name: True, progress=progress)


class Terminal(io.StringIO):
    """Stands in for stderr on a terminal."""

    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_only(monkeypatch, checkpoint, slow_reads):
    terminal = Terminal()
    tensors = load_with_stderr(monkeypatch, checkpoint, terminal, None)
    shown = terminal.getvalue()
    assert "load weights" in shown and f"/{len(tensors)}" in shown


@pytest.mark.parametrize("progress", [None, True, False])
def test_no_bar_off_a_terminal(monkeypatch, checkpoint, slow_reads, progress):
    captured = io.StringIO()
    load_with_stderr(monkeypatch, checkpoint, captured, progress)
    assert captured.getvalue() == ""


def test_no_bar_on_a_terminal_with_progress_false(monkeypatch, checkpoint, slow_reads):
    terminal = Terminal()
    load_with_stderr(monkeypatch, checkpoint, terminal, False)
    assert terminal.getvalue() == ""


def test_the_gguf_conversion_bar_follows_progress():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    with fetch._gguf_progress(False):
        assert gguf_utils.tqdm(range(3)).disable
    with fetch._gguf_progress(True):
        captured = io.StringIO()
        assert gguf_utils.tqdm(range(3), file=captured).disable  # not a terminal
    assert gguf_utils.tqdm is original
