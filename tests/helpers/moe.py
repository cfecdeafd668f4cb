"""Router margins of transformers' MoE models: how far each token's top-k expert choice is from a tie.

When the k-th and (k+1)-th router logits of a token are closer than fp32 noise, two backends computing
the same blocks may send it to different experts, and their outputs then differ by far more than
1e-4: a fair parity test needs every margin well above the noise (~1e-5).
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def min_router_margin(reference, input_ids: Tensor, attention_mask: Tensor | None = None) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit (k = ``num_experts_per_tok``) over
    every sparse layer and every real (unpadded) token of ``input_ids``, from the reference's own
    forward (``output_router_logits``)."""
    out = reference(input_ids, attention_mask=attention_mask, output_router_logits=True)
    if not out.router_logits:
        raise ValueError(f"{type(reference).__name__} reported no router logits: no sparse layer ran")
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    k = reference.config.num_experts_per_tok
    margins = []
    for logits in out.router_logits:  # [batch * seq, experts] per sparse layer
        top = logits.float().topk(k + 1, dim=-1).values
        margins.append((top[:, k - 1] - top[:, k])[real.reshape(-1)])
    return float(torch.cat(margins).min())
