"""oneDNN's packed linear layers (:mod:`shoal.models.packed`): a batch of one-token rows equals
``nn.Linear`` within fp32 rounding; everything else (one row, several tokens, recorded gradients,
other dtypes) is ``nn.Linear``'s own call, bitwise; the copy follows in-place changes and deep
copies; a span whose layers are packed steps a batch of decode steps as the plain one does; the
packed copy serves batches from the rows where calibration found it quicker, the plain call below."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shoal.checkpoints import load_span
from shoal.models.kv import CachedStep, PagedCache
from shoal.models.packed import (
    PackedLinear,
    calibrate,
    pack_linears,
    packed_bytes,
    packed_threshold,
    packing_available,
)
from testkit.tiny import tiny_checkpoint

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")
ATOL = 1e-4  # of the outputs' scale (at least 1): the issue's fp32 tolerance


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    scale = max(1.0, float(expected.abs().max()))
    assert float((got - expected).abs().max()) <= ATOL * scale


@pytest.mark.parametrize("rows", [2, 3, 8, 16, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_a_batch_of_one_token_rows_equals_the_plain_layer(rows, bias):
    torch.manual_seed(rows)
    plain = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear.of(plain)
    assert packed.weight is plain.weight and packed.bias is plain.bias
    x = torch.randn(rows, 1, 96)
    with torch.inference_mode():
        assert_close(packed(x), plain(x))
        assert_close(packed(x[::2] if rows > 3 else x), plain(x[::2] if rows > 3 else x))  # a strided view


def test_everything_else_is_the_plain_call_bitwise():
    """One row, several tokens, a 2D input, recorded gradients: what transformers computes."""
    torch.manual_seed(0)
    plain = nn.Linear(32, 48)
    packed = PackedLinear.of(plain)
    with torch.inference_mode():
        for x in (torch.randn(1, 1, 32), torch.randn(3, 5, 32), torch.randn(1, 7, 32), torch.randn(4, 32)):
            assert torch.equal(packed(x), plain(x))
    x = torch.randn(4, 1, 32, requires_grad=True)
    packed(x).square().sum().backward()  # oneDNN's op records no gradient: the plain call must run
    expected = x.detach().clone().requires_grad_()
    plain(expected).square().sum().backward()
    assert x.grad is not None and torch.equal(x.grad, expected.grad)
    assert set(packed.state_dict()) == {"weight", "bias"}  # no packed copy in state dicts
    mixed = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    assert pack_linears(mixed) == 1 and type(mixed[1]) is nn.Linear  # bf16 stays plain


def test_the_packed_copy_follows_the_weight():
    """A weight changed in place is packed again before its next use; a deep copy is a layer of its
    own (changing it leaves the original as it was)."""
    torch.manual_seed(1)
    plain = nn.Linear(32, 48)
    packed = PackedLinear.of(plain)
    x = torch.randn(4, 1, 32)
    twin = copy.deepcopy(packed)
    assert isinstance(twin, PackedLinear) and twin.weight is not packed.weight
    with torch.no_grad():
        packed.weight.mul_(2.0)
    with torch.inference_mode():
        assert_close(packed(x), plain(x))  # the doubled weight
        before = twin(x)
        with torch.no_grad():
            twin.weight.add_(1.0)
        assert not torch.allclose(twin(x), before)
        assert_close(packed(x), plain(x))


def test_a_packed_span_steps_a_batch_of_decode_steps_as_the_plain_one(tmp_path):
    """Every plain linear of a tiny llama span is packed (none twice); three sessions' prefills,
    then their decode steps as one batch, give the plain span's outputs; ``packed_bytes`` counts
    one more fp32 copy of each weight."""
    checkpoint = tiny_checkpoint(tmp_path)
    plain, _ = load_span(checkpoint, 0, 4)
    packed, _ = load_span(checkpoint, 0, 4)
    linears = [m for m in plain.modules() if type(m) is nn.Linear]
    assert packed_bytes(packed) == sum(m.weight.numel() * 4 for m in linears)
    assert pack_linears(packed) == len(linears) > 0
    assert pack_linears(packed) == 0  # already packed
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == len(linears)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randn(1, n, 64, generator=generator) * 0.3 for n in (5, 1, 9)]
    decode = [torch.randn(1, 1, 64, generator=generator) * 0.3 for _ in prompts]
    outputs = []
    for span in (plain, packed):
        pool = span.allocate_pool(8, 16)
        caches = [PagedCache(pool, 1, 16) for _ in prompts]
        with torch.inference_mode():
            for h, cache in zip(prompts, caches, strict=True):
                span.forward_steps([CachedStep(h, torch.arange(h.shape[1])[None], None, cache, 0)])
            steps = [CachedStep(h, torch.tensor([[p.shape[1]]]), None, c, p.shape[1])
                     for h, p, c in zip(decode, prompts, caches, strict=True)]  # fmt: skip
            outputs.append(span.forward_steps(steps))
    for got, expected in zip(outputs[1], outputs[0], strict=True):
        assert_close(got, expected)


def test_the_packed_copy_serves_batches_from_the_rows_where_it_is_quicker():
    """Calibration sets every layer's threshold; below it the plain call runs, bitwise."""
    assert packed_threshold((2, 3, 4, 8, 16), (False, False, True, True, True)) == 4
    assert packed_threshold((2, 3, 4, 8, 16), (True, False, True, True, True)) == 4  # quicker at every size after
    assert packed_threshold((2, 3, 4, 8, 16), (True,) * 5) == 2
    assert packed_threshold((2, 3, 4, 8, 16), (True, True, True, True, False)) == 17  # never
    torch.manual_seed(2)
    module = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    plain = copy.deepcopy(module)
    pack_linears(module)
    threshold = calibrate(module, repeats=1)
    assert threshold in (2, 3, 4) and {m.packed_from for m in module} == {threshold}
    assert copy.deepcopy(module)[0].packed_from == threshold
    module[0].packed_from = module[1].packed_from = 4
    with torch.inference_mode():
        x = torch.randn(3, 1, 64)
        assert torch.equal(module(x), plain(x))  # 3 rows: below the threshold, MKL's own call
        x = torch.randn(4, 1, 64)
        assert_close(module(x), plain(x))  # 4: the packed copy
    assert calibrate(plain) is None  # nothing packed
