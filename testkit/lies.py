"""Targeted lies on hidden states ``[batch, n, hidden]`` that the per-position bf16 rules let through (issue
#34), for the window rule's and channel view's tests and calibration (:mod:`shoal.verify.compare`)."""

from __future__ import annotations

import torch


def alternate_noise(out: torch.Tensor, first: int, relative: float, generator: torch.Generator) -> torch.Tensor:
    """``out`` with Gaussian noise of norm ``relative`` x each row's norm at positions first, first+2, ..."""
    lied = out.float().clone()
    for j in range(first, out.shape[1], 2):
        noise = torch.randn(out.shape[0], out.shape[-1], generator=generator)
        lied[:, j] += noise / noise.norm(dim=-1, keepdim=True) * relative * lied[:, j].norm(dim=-1, keepdim=True)
    return lied


def channel_push(
    out: torch.Tensor, at: int, relative: float, channels: int, generator: torch.Generator
) -> torch.Tensor:  # fmt: skip
    """``out`` with ``relative`` x the row's norm split evenly over ``channels`` random channels (random
    signs) at position ``at`` of every row."""
    lied = out.float().clone()
    picked = torch.randperm(out.shape[-1], generator=generator)[:channels]
    signs = (torch.randint(0, 2, (channels,), generator=generator) * 2 - 1).float()
    lied[:, at, picked] += signs * relative / channels**0.5 * lied[:, at].norm(dim=-1, keepdim=True)
    return lied
