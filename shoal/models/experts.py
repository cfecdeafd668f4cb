"""Per-expert checkpoint tensors -> the fused expert parameters of transformers' MoE layers.

Checkpoints on the Hub, and what transformers' ``save_pretrained`` writes, hold one matrix per expert
and projection (``experts.{e}.{gate,up,down}.weight``); transformers 5's MoE layers hold each
projection of all experts in one 3-D parameter and merge them while loading (its
``conversion_mapping``: ``MergeModulelist(dim=0)`` stacks the experts, ``Concatenate(dim=1)`` puts
gate above up). A span does the same for its own blocks. A block already in the fused layout
(``save_pretrained(save_original_format=False)``) or without experts (a dense layer) passes unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shoal.models.decoder import BlockTensors

#: where transformers' MoE decoder layers keep their sparse block
MOE_MODULE = "mlp."
_PER_EXPERT = re.compile(rf"{re.escape(MOE_MODULE)}experts\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class ExpertLayout:
    """How a family's checkpoint names its sparse block, relative to a block's prefix."""

    stored_module: str  # the sparse block's name in checkpoints: "block_sparse_moe." (Mixtral), "mlp."
    gate: str  # per-expert projection names: Mixtral "w1", "w3", "w2"; Qwen "gate_proj", ...
    up: str
    down: str

    def __call__(self, config, tensors: BlockTensors) -> BlockTensors:
        """One block's tensors with its per-expert ones fused (router and the rest only renamed)."""
        out: BlockTensors = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if name.startswith(self.stored_module):
                name = MOE_MODULE + name[len(self.stored_module) :]
            match = _PER_EXPERT.fullmatch(name)
            if match is None:
                out[name] = tensor
            else:
                experts.setdefault(match[2], {})[int(match[1])] = tensor
        if experts:
            out.update(self._fuse(experts))
        return out

    def _fuse(self, experts: dict[str, dict[int, torch.Tensor]]) -> BlockTensors:
        projections = (self.gate, self.up, self.down)
        if set(experts) != set(projections):
            raise ValueError(f"per-expert projections {sorted(experts)}, expected {sorted(projections)}")
        count = 1 + max(max(by_expert) for by_expert in experts.values())
        for projection in projections:
            if sorted(experts[projection]) != list(range(count)):
                held = sorted(experts[projection])
                raise ValueError(f"{projection} tensors for experts {held}, expected all of 0..{count - 1}")

        def stacked(projection: str) -> torch.Tensor:  # [experts, out, in]
            return torch.stack([experts[projection][e] for e in range(count)])

        return {
            f"{MOE_MODULE}experts.gate_up_proj": torch.cat([stacked(self.gate), stacked(self.up)], dim=1),
            f"{MOE_MODULE}experts.down_proj": stacked(self.down),
        }
