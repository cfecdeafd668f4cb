"""Serve a span straight from a GGUF file (llama.cpp's format, read with gguf-py): only its blocks'
tensors are read, and their quantised matrices stay quantised (:mod:`shoal.quantization.gguf`).

Names and layouts come from transformers' own GGUF loader, which is what turned these files into
the fp32 checkpoints shoal fetches: its GGUF -> Hugging Face name map and its tensor processor
(for llama-family q/k matrices, the reverse of the rope row permutation llama.cpp applies). Row
permutations act on the rows of raw quantised bytes exactly as on dequantised rows, so the codes
served dequantise to the fp32 checkpoint's tensors bit for bit (``tests/unit/test_gguf.py``).

A block's fingerprint is over its tensors as stored in the file (names, GGUF types, bytes), so two
servers of the same file agree, and a server of the dequantised checkpoint differs (it announces
another format as well).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shoal.checkpoints.loading import CheckpointError, block_fingerprint, progress_bar, release_freed_memory
from shoal.models import BlockSpan, get_family
from shoal.quantization.gguf import PACKED_TYPES, Int4Linear, affine_codes

log = logging.getLogger(__name__)

SUFFIX = ".gguf"


class GGUFSource:
    """An open GGUF file and the maps from its tensors to a model's checkpoint names."""

    def __init__(self, path: str | Path, hf_config):
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

        self.path = Path(path)
        reader = GGUFReader(self.path)
        self.architecture = read_field(reader, "general.architecture")[0]
        self.file_type = _file_type(reader)
        self.tensors = {t.name: t for t in reader.tensors}  # views of the file's mapping
        # the reader parsed every field into small numpy arrays (a tokenizer's vocabulary: 166 MB for
        # smollm2's): let them go before any block is built, or the heap keeps their pages between
        # the blocks' tensors (84 MB more unique memory on Qwen's 24 blocks)
        del reader
        gc.collect()
        release_freed_memory()
        self.processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=hf_config.to_dict())
        self.to_hf = _name_map(hf_config, self.processor)

    def block_tensors(self, prefix: str) -> dict[str, Any]:
        """The file's tensors of one block, by checkpoint name (those starting with ``prefix``)."""
        return {hf: self.tensors[g] for g, hf in self.to_hf.items() if hf.startswith(prefix) and g in self.tensors}

    def read(self, tensor) -> tuple[np.ndarray, str]:
        """A tensor's raw rows (``[rows, row_bytes]``, permuted as the processor says) and its type."""
        raw = np.asarray(tensor.data)
        result = self.processor.process(weights=raw, name=tensor.name)
        if result.name != tensor.name or result.weights.shape != raw.shape:
            raise CheckpointError(f"{self.path.name}: {tensor.name}: cannot keep it quantised (its loader reshapes it)")
        return result.weights, tensor.tensor_type.name

    def dequantized(self, tensor) -> torch.Tensor:
        """A tensor in fp32, as transformers' GGUF loader makes it."""
        from gguf import dequantize

        weights = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        weights = self.processor.process(weights=weights, name=tensor.name).weights
        return torch.from_numpy(np.array(weights, dtype=np.float32))  # a copy: never a view of the mapping


def _file_type(reader) -> str:
    """The file's quantisation as llama.cpp names it (``Q4_K_M``), from ``general.file_type``."""
    from gguf import LlamaFileType
    from transformers.modeling_gguf_pytorch_utils import read_field

    value = read_field(reader, "general.file_type")
    try:
        return LlamaFileType(int(value[0])).name.removeprefix("MOSTLY_")
    except (IndexError, ValueError):
        return "unknown"


def _name_map(hf_config, processor) -> dict[str, str]:
    """GGUF tensor name -> checkpoint name, from transformers' map over a model built on meta."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return get_gguf_hf_weights_map(model, processor)


def load_gguf_span(
    path: str | Path,
    start: int,
    end: int,
    dtype: torch.dtype,
    device: str,
    config,
    progress: bool | None = None,
) -> tuple[BlockSpan, dict[int, str], dict[str, str]]:
    """Blocks ``[start, end)`` from the GGUF file ``path``, their fingerprints (of the tensors as
    stored), and how each GGUF type present is served (``int4`` planes, or ``dequantised``). One
    block at a time: the quantised matrices become :class:`Int4Linear` layers, the rest (norms,
    biases, matrices of types without an int4 form such as Q6_K) is dequantised to ``dtype``."""
    if device != "cpu":
        raise CheckpointError(f"GGUF weights are served with torch's CPU int4 kernel; --device {device} cannot")
    source = GGUFSource(path, config)
    family = get_family(config)
    served: dict[str, str] = {}
    prints: dict[int, str] = {}
    blocks = []
    for i in progress_bar(progress, iterable=range(start, end), unit="block", desc="load blocks"):
        prefix = family.block_tensor_prefix(config, i)
        stored = source.block_tensors(prefix)
        if not stored:
            raise CheckpointError(f"{source.path.name}: no tensors for block {i} (prefix {prefix!r})")
        block, kinds, raw = _gguf_block(source, family, config, i, prefix, stored, dtype, device)
        prints[i] = block_fingerprint(raw, prefix)
        served.update(kinds)
        blocks.append(block)
        del raw
        release_freed_memory()
    source.tensors = {}  # drop the file's mapping: nothing served refers to it
    return family.assemble_span(config, start, end, blocks, dtype, device), prints, served


def _gguf_block(source: GGUFSource, family, config, index: int, prefix: str, stored, dtype, device):
    packed, tensors, raw, kinds, dequantised = {}, {}, {}, {}, {}
    for name, tensor in stored.items():
        rows, type_name = source.read(tensor)
        raw[f"{name}@{type_name}"] = torch.from_numpy(np.array(rows).reshape(-1))  # a copy, for the fingerprint
        cols = int(tensor.shape[0])
        if type_name in PACKED_TYPES and len(tensor.shape) == 2 and name.endswith(".weight") and cols % 32 == 0:
            packed[name[len(prefix) :]] = (rows, type_name, cols)
            tensors[name[len(prefix) :]] = torch.empty((rows.shape[0], cols))  # a placeholder, replaced below
        else:
            tensors[name[len(prefix) :]] = source.dequantized(tensor)
            if len(tensor.shape) == 2 and type_name not in ("F32", "F16", "BF16"):
                dequantised[name[len(prefix) :]] = type_name
    block = family.build_block(config, index, tensors, dtype, device)
    del tensors
    for parent, child, qualified in list(_linears(block)):
        entry = packed.pop(f"{qualified}.weight", None)
        layer = getattr(parent, child)
        if entry is None:
            type_name = dequantised.get(f"{qualified}.weight")
            if type_name is not None:
                kinds[type_name] = f"{str(dtype).removeprefix('torch.')} (dequantised)"
            continue
        rows, type_name, cols = entry
        setattr(parent, child, Int4Linear(affine_codes(rows, type_name, cols), layer.bias))
        kinds[type_name] = "int4" if PACKED_TYPES[type_name] == 4 else "int4 x2 (low and high nibbles)"
    if packed:  # a matrix the block does not hold as an nn.Linear of the same name: dequantise it instead
        for name, (_, type_name, _) in packed.items():
            try:
                target = block.get_parameter(name)
            except AttributeError:
                raise CheckpointError(f"{source.path.name}: block {index} has no parameter {name!r}") from None
            with torch.no_grad():
                target.copy_(source.dequantized(stored[prefix + name]).to(target.dtype))
            kinds.setdefault(type_name, "dequantised")
    return block, kinds, raw


def _linears(block: nn.Module):
    for qualified, parent in block.named_modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                yield parent, name, f"{qualified}.{name}" if qualified else name


def describe(served: dict[str, str]) -> str:
    """``Q4_K: int4, Q6_K: dequantised``: how each type of a span's matrices is served."""
    return ", ".join(f"{t}: {how}" for t, how in sorted(served.items()))


def known_model_of(path: str | Path) -> str:
    """The known model whose GGUF file ``path`` is (by its name): ``shoal serve FILE.gguf`` serves
    its blocks in that model's swarm, whose clients read the head from the model's checkpoint."""
    from shoal.checkpoints.fetch import KNOWN_MODELS
    from shoal.errors import UsageError

    path = Path(path).expanduser()
    if not path.is_file():
        raise UsageError(f"{path}: no such GGUF file")
    for name, spec in KNOWN_MODELS.items():
        if spec.gguf_name == path.name:
            return name
    files = ", ".join(f"{spec.gguf_name} ({name})" for name, spec in sorted(KNOWN_MODELS.items()))
    raise UsageError(
        f"{path.name}: `shoal serve FILE.gguf` knows the GGUF files of the known models: {files}; for "
        "another model, put its GGUF file in its Hugging Face checkpoint directory and serve that with --quant gguf"
    )


def find_gguf(model_dir: str | Path) -> Path:
    """The one GGUF file in ``model_dir`` (a known model keeps its file there once fetched)."""
    model_dir = Path(model_dir)
    found = sorted(model_dir.glob(f"*{SUFFIX}"))
    if len(found) == 1:
        return found[0]
    from shoal.checkpoints.fetch import KNOWN_MODELS, known_gguf, model_cache_dir

    name = model_dir.name
    if not found and name in KNOWN_MODELS and model_cache_dir(name).resolve() == model_dir.resolve():
        return known_gguf(name)
    what = "no GGUF file" if not found else f"{len(found)} GGUF files ({', '.join(f.name for f in found)})"
    raise CheckpointError(f"{model_dir}: --quant gguf needs the model's GGUF file beside it, and it has {what}")


__all__ = ["GGUFSource", "describe", "find_gguf", "known_model_of", "load_gguf_span"]
