"""A judge's recompute (:meth:`shoal.server.backend.BlockBackend.recompute`): chunks of positions
through a KV cache, one task each, equal to one pass within fp32 noise, in the span's dtype
between blocks and cast once."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import Tensor

from shoal.checkpoints import load_span
from shoal.server import backend as backend_module
from shoal.server.backend import SpanBackend, compute_thread
from shoal.server.scheduler import Priority
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.server.judge.bench import HIDDEN

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]


@pytest.fixture(scope="module")
def spans(tmp_path_factory):
    model_dir = save_checkpoint(tiny_model("llama", seed=5), tmp_path_factory.mktemp("tiny-recompute"))
    return {torch.float32: load_span(model_dir, 0, 3)[0]}


def recompute(span, hidden, positions, mask, chunk: int, monkeypatch) -> tuple[Tensor, int]:
    """(blocks 0:3 recomputed with ``chunk`` positions a task, how many tasks)."""
    monkeypatch.setattr(backend_module, "RECOMPUTE_CHUNK_POSITIONS", chunk)
    backend = SpanBackend(span, HIDDEN, executor=compute_thread(1))
    try:
        out = asyncio.run(backend.recompute(hidden, positions, mask, 0, 3))
        return out, backend.compute_counts().ran[Priority.TRAINING]
    finally:
        backend.shutdown()


def test_the_recompute_in_chunks_equals_one_pass_within_fp32_noise(spans, monkeypatch):
    generator = torch.Generator().manual_seed(12)
    hidden = torch.randn(3, 50, HIDDEN, generator=generator)
    positions = torch.arange(50).repeat(3, 1)
    mask = torch.ones(3, 50, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded row
    span = spans[torch.float32]
    with torch.inference_mode():
        whole = span(hidden, positions, mask)
    out, tasks = recompute(span, hidden, positions, mask, 48, monkeypatch)  # 16 positions of 3 rows a task
    assert tasks == 3 * 4  # 3 blocks x ceil(50 / 16) chunks
    assert out.dtype == torch.float32 and out.shape == whole.shape
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-4 * float(whole.abs().max()))
    single, tasks = recompute(span, hidden, positions, mask, 1000, monkeypatch)  # one chunk: one task per block
    assert tasks == 3
    torch.testing.assert_close(single, whole, rtol=0, atol=1e-4 * float(whole.abs().max()))


def test_the_recompute_keeps_the_spans_dtype_between_blocks_and_casts_once(spans, monkeypatch):
    """bf16 inputs through an fp32 span: as a step computes (fp32 throughout, one rounding at the end),
    not rounded to bf16 after every block."""
    span = spans[torch.float32]
    hidden = torch.randn(1, 20, HIDDEN, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    positions = torch.arange(20)[None]
    with torch.inference_mode():
        once = span(hidden, positions, None)
    out, _ = recompute(span, hidden, positions, None, 8, monkeypatch)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), once.to(torch.bfloat16).float(), rtol=0,
                               atol=2**-7 * float(once.abs().max()))  # fmt: skip
    exact = (out == once.to(torch.bfloat16)).float().mean()
    assert exact > 0.95, exact  # rounding per block would leave far fewer bits equal
