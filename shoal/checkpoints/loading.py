"""Read only the tensors a party needs from a Hugging Face safetensors checkpoint.

A server hosting blocks ``[start, end)`` opens only the shards holding them (``safe_open`` reads one
tensor at a time), so it never needs, or even has, the whole checkpoint. Fingerprints let parties
check that they run the same weights without exchanging them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shoal.errors import ShoalError
from shoal.models import BlockSpan, ClientHead, get_family
from shoal.quantization import Quantization, parse_quantization
from shoal.quantization.weights import block_quantizer

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

Wanted = Iterable[str] | Callable[[str], bool]


class CheckpointError(ShoalError):
    """A checkpoint lacks tensors or shard files a party needs, or is not a safetensors checkpoint."""


def weight_map(model_dir: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index (sharded) or the single file's header."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).is_file():
        return dict(json.loads((model_dir / INDEX_FILE).read_text())["weight_map"])
    if (model_dir / SINGLE_FILE).is_file():
        with safe_open(model_dir / SINGLE_FILE, framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise CheckpointError(f"{model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE}")


def select(names: Iterable[str], wanted: Wanted) -> list[str]:
    """The names ``wanted`` picks (a collection of names, or a predicate) among ``names``."""
    return [n for n in names if wanted(n)] if callable(wanted) else list(dict.fromkeys(wanted))


def progress_bar(progress: bool | None, **kwargs):
    """A tqdm bar on stderr, shown only on a terminal, never with ``progress=False``, and only once
    the work has taken half a second (quick loads print nothing)."""
    from tqdm import tqdm

    return tqdm(disable=True if progress is False else None, delay=0.5, leave=False, **kwargs)


def load_tensors(
    model_dir: str | Path, wanted: Wanted, device: str = "cpu", progress: bool | None = None
) -> dict[str, torch.Tensor]:
    """Load the ``wanted`` tensors (names, or a predicate on names) as stored, opening only their
    shards. ``progress``: a bar on a terminal (None: the default, shown there; False: never)."""
    model_dir = Path(model_dir)
    where = weight_map(model_dir)
    names = select(where, wanted)
    unknown = [n for n in names if n not in where]
    if unknown:
        raise CheckpointError(f"{model_dir}: no tensors named {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    by_shard: dict[str, list[str]] = {}
    for name in names:
        by_shard.setdefault(where[name], []).append(name)
    absent = {shard: held for shard, held in by_shard.items() if not (model_dir / shard).is_file()}
    if absent:
        detail = "; ".join(f"{shard} (holds {held[:3]}{' ...' * (len(held) > 3)})" for shard, held in absent.items())
        raise CheckpointError(f"{model_dir}: missing shard files: {detail}")
    out: dict[str, torch.Tensor] = {}
    with progress_bar(progress, total=len(names), unit="tensor", desc="load weights") as bar:
        for shard, held in by_shard.items():
            with safe_open(model_dir / shard, framework="pt", device=device) as f:
                for name in held:
                    out[name] = f.get_tensor(name)
                    bar.update()
    return out


def load_config(model_dir: str | Path):
    """The transformers config of a local checkpoint directory."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def span_tensor_filter(config, start: int, end: int) -> Callable[[str], bool]:
    """Predicate picking the checkpoint tensors of blocks ``[start, end)``."""
    family = get_family(config)
    prefixes = tuple(family.block_tensor_prefix(config, i) for i in range(start, end))
    return lambda name: name.startswith(prefixes)


def block_fingerprint(tensors: dict[str, torch.Tensor], prefix: str = "") -> str:
    """sha256 over sorted (name without ``prefix``, dtype, shape, raw bytes) of one block's tensors as
    stored, so every party computes the same value from its own copy (cast *after* fingerprinting)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        if not name.startswith(prefix):
            raise ValueError(f"tensor {name!r} lacks block prefix {prefix!r}")
        tensor = tensors[name].detach().to("cpu").contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        dtype = str(tensor.dtype).removeprefix("torch.")
        header = f"{name[len(prefix) :]}\0{dtype}\0{tuple(tensor.shape)}\0{len(raw)}\0"
        digest.update(header.encode())
        digest.update(raw)
    return digest.hexdigest()


def span_fingerprints(config, start: int, end: int, tensors: dict[str, torch.Tensor]) -> dict[int, str]:
    """Fingerprint of each block in ``[start, end)`` from (at least) its checkpoint tensors."""
    family = get_family(config)
    prints = {}
    for i in range(start, end):
        prefix = family.block_tensor_prefix(config, i)
        block = {k: v for k, v in tensors.items() if k.startswith(prefix)}
        if not block:
            raise CheckpointError(f"no tensors for block {i} (prefix {prefix!r})")
        prints[i] = block_fingerprint(block, prefix)
    return prints


def load_span(
    model_dir: str | Path,
    start: int,
    end: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    quantization: Quantization | str = Quantization.NONE,
    progress: bool | None = None,
    config: Any = None,
    gguf: str | Path | None = None,
) -> tuple[BlockSpan, dict[int, str]]:
    """Build blocks ``[start, end)`` from their shards only; also return their fingerprints (of the
    checkpoint's tensors, whatever ``quantization``). One block at a time: read, fingerprint, build
    in ``dtype`` on ``device``, quantise (:mod:`shoal.quantization.weights`), drop the tensors read;
    so loading holds the span as served plus one block in full precision, never the whole span.
    ``progress``: a bar on a terminal (as :func:`load_tensors`). ``config``: the model's transformers
    config if the caller read it already (else read here). With ``quantization`` gguf, the blocks come
    from the GGUF file ``gguf`` (None: the one beside the checkpoint), their fingerprints of its
    tensors as stored (:mod:`shoal.checkpoints.gguf`)."""
    quantization = parse_quantization(quantization)
    quantize = block_quantizer(quantization)  # a missing library fails before any read
    config = config if config is not None else load_config(model_dir)
    if quantization is Quantization.GGUF:  # the file's own quantised tensors, as they are
        from shoal.checkpoints.gguf import describe, find_gguf, load_gguf_span

        path = gguf if gguf is not None else find_gguf(model_dir)
        span, prints, served = load_gguf_span(path, start, end, dtype, device, config, progress)
        log.info("GGUF tensors of blocks %d:%d served as: %s", start, end, describe(served))
        return span, prints
    family = get_family(config)
    if not 0 <= start < end <= family.num_blocks(config):
        raise ValueError(f"bad block range [{start}, {end}) for {family.num_blocks(config)} blocks")
    prints: dict[int, str] = {}
    blocks = []
    for i in progress_bar(progress, iterable=range(start, end), unit="block", desc="load blocks"):
        prefix = family.block_tensor_prefix(config, i)
        tensors = load_tensors(model_dir, lambda name, p=prefix: name.startswith(p), progress=False)
        if not tensors:
            raise CheckpointError(f"no tensors for block {i} (prefix {prefix!r})")
        prints[i] = block_fingerprint(tensors, prefix)
        block = family.build_block(config, i, {k[len(prefix) :]: v for k, v in tensors.items()}, dtype, device)
        del tensors
        if quantization is not Quantization.NONE:
            block = _owning_storage(quantize(block))
            release_freed_memory()
        blocks.append(block)
    return family.assemble_span(config, start, end, blocks, dtype, device), prints


def release_freed_memory() -> None:
    """Hand memory freed inside the heap back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Quantising frees a full-precision block while the quantised tensors made meanwhile
    stay, scattered over the heap; glibc would keep the freed pages between them resident and grow
    the heap for the next block instead."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc():
    import ctypes

    return ctypes.CDLL(None)


def _owning_storage(block: torch.nn.Module) -> torch.nn.Module:
    """``block`` with its plain tensors (norms, biases: what quantisation leaves) copied out of the
    checkpoint. safetensors maps shard files into memory, and a tensor kept in the stored dtype is a
    view of that mapping: it would keep every page of its shard that fingerprinting read resident,
    the full-precision block that quantisation just replaced included."""
    for module in block.modules():
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None and type(tensor) in (torch.Tensor, torch.nn.Parameter):
                    tensor.data = tensor.data.clone()
    return block


def load_client_head(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> ClientHead:
    """Build the client's embeddings, final norm and LM head from their shard only."""
    config = load_config(model_dir)
    family = get_family(config)
    tensors = load_tensors(model_dir, family.client_tensor_names(config))
    return family.build_client_head(config, tensors, dtype, device)


def holds_every_block(config, where: dict[str, str]) -> bool:
    """Whether the tensor names of ``where`` (a weight map) include some of every block's: a directory
    of weights fetched from peers indexes only the blocks it holds."""
    family = get_family(config)
    prefixes = {family.block_tensor_prefix(config, i) for i in range(family.num_blocks(config))}
    found = {p for name in where for p in prefixes if name.startswith(p)}
    return found == prefixes


def model_fingerprints(model_dir: str | Path, config: Any = None) -> list[str] | None:
    """Fingerprints of every block, or None when some block's shard is absent here (a party
    holding only its slice cannot vouch for the whole model). Computed one block at a time and
    cached beside the checkpoint when it is writable, keyed by the shards' sizes and times.
    ``config``: the model's transformers config if the caller read it already."""
    model_dir = Path(model_dir)
    config = config if config is not None else load_config(model_dir)
    family = get_family(config)
    where = weight_map(model_dir)
    shards = sorted(set(where.values()))
    if not all((model_dir / s).is_file() for s in shards) or not holds_every_block(config, where):
        return None
    stamp = [[s, (model_dir / s).stat().st_size, int((model_dir / s).stat().st_mtime)] for s in shards]
    cache = model_dir / ".shoal-fingerprints.json"
    if cache.is_file():
        try:
            saved = json.loads(cache.read_text())
            if saved.get("stamp") == stamp:
                return list(saved["fingerprints"])
        except (OSError, ValueError, KeyError):
            pass
    prints = []
    for i in progress_bar(None, iterable=range(family.num_blocks(config)), unit="block", desc="fingerprint"):
        prefix = family.block_tensor_prefix(config, i)
        block = load_tensors(model_dir, lambda n, p=prefix: n.startswith(p), progress=False)
        prints.append(block_fingerprint(block, prefix))
    try:
        cache.write_text(json.dumps({"stamp": stamp, "fingerprints": prints}))
    except OSError:
        pass
    return prints


def model_name(model: str) -> str:
    """The name a model goes by in a swarm: a local directory's name, or the id as given."""
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model
