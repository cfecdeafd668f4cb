"""A tiny random llama as a GGUF file beside its checkpoint, as the known models are fetched.

Each block matrix is quantised by gguf-py to a GGUF type (cycling through ``types``), rows of q/k
permuted for rope as llama.cpp's converter does, and the checkpoint saved beside it holds what
transformers' GGUF loader dequantises the file to: so ``--quant gguf`` over the directory serves
the file's codes, and the checkpoint is their exact fp32 reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from testkit.tiny import save_checkpoint, tiny_model

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
FILE_NAME = "tiny.gguf"


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rope permutation of q/k rows (``convert_hf_to_gguf.py``'s ``permute``)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@torch.no_grad()
def tiny_gguf_checkpoint(out_dir: str | Path, types: tuple[str, ...] = TYPES, seed: int = 0) -> Path:
    """The tiny llama's checkpoint in ``out_dir`` with ``tiny.gguf`` of its blocks beside it."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = tiny_model("llama", seed)
    config = model.config
    processor = LlamaTensorProcessor(config=config.to_dict())
    to_gguf = {hf: g for g, hf in get_gguf_hf_weights_map(model, processor).items()}
    writer = GGUFWriter(out_dir / FILE_NAME, "llama")
    matrices = 0
    for name, tensor in model.state_dict().items():
        if ".layers." not in name:
            continue
        gguf_name = to_gguf[name]
        weights = tensor.float().numpy()
        if weights.ndim != 2:
            writer.add_tensor(gguf_name, weights)
            continue
        kind = GGMLQuantizationType[types[matrices % len(types)]]
        matrices += 1
        heads = {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
        head = next((n for key, n in heads.items() if key in gguf_name), None)
        stored = _permute(weights, head) if head is not None else weights
        packed = quantize(stored, kind)
        writer.add_tensor(gguf_name, packed, raw_dtype=kind)
        dequantized = processor.process(weights=dequantize(packed, kind), name=gguf_name).weights
        tensor.copy_(torch.from_numpy(np.ascontiguousarray(dequantized)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return save_checkpoint(model, out_dir)
