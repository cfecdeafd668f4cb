"""Replay histories are joined without torch.cat (see shoal.client.remote._cat_serial: the client's
event loop thread must not open OpenMP regions). The join must equal torch.cat for every wire dtype,
contiguous or not."""

from __future__ import annotations

import pytest
import torch

from shoal.client.remote import _cat_serial
from shoal.wire.tensors import DTYPES

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_join_equals_torch_cat(name):
    generator = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(2, n, 6, generator=generator) * 50).to(DTYPES[name]) for n in (7, 1, 1, 3)]
    chunks.append(torch.randn(2, 6, 4, generator=generator).to(DTYPES[name]).transpose(1, 2))  # not contiguous
    joined = _cat_serial(chunks, dim=1)
    assert joined.dtype == DTYPES[name] and torch.equal(joined, torch.cat(chunks, dim=1))
