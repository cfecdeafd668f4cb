"""Write a Hugging Face checkpoint directory with one safetensors shard per block.

Real checkpoints shard by size, so a span's blocks straddle shards; with one shard per block (plus one
for embeddings, final norm and LM head) each party's files are exactly its own, which is what makes
slice loading testable (delete the other shards, the span still loads). transformers loads the
result like any sharded checkpoint.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from shoal.checkpoints.loading import INDEX_FILE
from shoal.models import get_family


def shard_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def _as_saved(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s tensors as ``save_pretrained`` names them: it reverts the load-time conversion."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    state_dict = model.state_dict()
    return revert_weight_conversion(model, state_dict) if isinstance(model, PreTrainedModel) else state_dict


def save_sharded(
    state_dict_or_model: dict[str, torch.Tensor] | nn.Module,
    config,
    out_dir: str | Path,
    tokenizer=None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save tensors (cast to ``dtype`` if given), ``config.json``, the index and the tokenizer files.

    Shard 1 holds the non-block tensors; shard ``i + 2`` holds block ``i``. A tied ``lm_head.weight``
    is dropped, and a model's tensors are named and laid out as ``save_pretrained`` writes them (the
    Hub's layout: e.g. one tensor per MoE expert, where transformers' layers fuse them), as
    transformers does; a state dict is written as given.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = state_dict_or_model if isinstance(state_dict_or_model, nn.Module) else None
    state_dict = _as_saved(model) if model is not None else dict(state_dict_or_model)
    if getattr(config, "tie_word_embeddings", False):
        state_dict.pop("lm_head.weight", None)

    family = get_family(config)
    num_blocks = family.num_blocks(config)
    prefixes = [family.block_tensor_prefix(config, i) for i in range(num_blocks)]
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(num_blocks + 1)]
    for name, tensor in state_dict.items():
        slot = next((i + 1 for i, p in enumerate(prefixes) if name.startswith(p)), 0)
        tensor = tensor.detach().to("cpu", dtype=dtype if dtype is not None and tensor.is_floating_point() else None)
        groups[slot][name] = tensor.contiguous().clone()  # clone: no shared storage (safetensors refuses it)

    weight_map, total_size = {}, 0
    for slot, tensors in enumerate(groups):
        if not tensors:
            raise ValueError(f"no tensors for {'non-block tensors' if slot == 0 else f'block {slot - 1}'}")
        name = shard_name(slot, len(groups))
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        for key, tensor in tensors.items():
            weight_map[key] = name
            total_size += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    if dtype is not None:
        config = copy.deepcopy(config)
        config.dtype = dtype
    config.save_pretrained(str(out_dir))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return out_dir
