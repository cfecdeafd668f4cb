"""LoRA adapters on a server's span, selected per request.

Why: a LoRA fine-tune changes a model by a few small matrices per linear layer, so one server can hold
its blocks' base weights once and any number of adapters beside them; each request (an open session, a
forward, a backward) names the adapter it runs with, and switching costs nothing: no merged copy of the
weights per adapter, no reload. :class:`SpanAdapters` wraps the span's targeted ``nn.Linear`` layers once;
:meth:`SpanAdapters.active` selects the adapter for the computation inside it.

Format: peft's saved adapter directory (``adapter_config.json``, ``adapter_model.safetensors``), read
directly, without peft: a server keeps only its blocks' tensors, found through the family's
``block_tensor_prefix`` (so every family works), and computes exactly what peft's ``lora.Linear``
computes (same operations in the same order and dtypes: the LoRA path runs in fp32 on a bf16/fp16 span,
as peft's default ``autocast_adapter_dtype`` does). The digest covers the whole adapter's tensors, not
the file's bytes (a safetensors header's order may vary), so every server that loaded the same adapter
announces the same one, whatever its blocks, and a client can pin it from a local copy.

Refused with a :class:`~shoal.errors.UsageError` naming the option: other peft types than ``LORA``,
LoRA variants (``use_dora`` and the others in :data:`VARIANT_OPTIONS`), ``bias`` other than ``"none"``,
``lora_bias``, ``modules_to_save``, ``fan_in_fan_out``, an init that rewrites the base weights (PiSSA,
OLoRA, LoftQ ...), targets outside the blocks (embeddings, LM head) or not ``nn.Linear`` in them,
tensors for blocks the model lacks, shapes other than the blocks' layers, quantised spans, pickled
``adapter_model.bin`` files.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from shoal.errors import BadRequest, UsageError
from shoal.models.base import BlockSpan
from shoal.wire.schema import AdapterInfo

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "VARIANT_OPTIONS",
    "AdapterWeights",
    "LoraLinear",
    "SpanAdapters",
    "UnknownAdapter",
    "adapter_digest",
    "read_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."  # what peft puts before the transformers model's own module names
#: LoraConfig options that make another computation than plain LoRA (peft's LoRA variants and the
#: like): a truthy value is refused, naming the option.
VARIANT_OPTIONS = (
    "use_dora",
    "use_qalora",
    "use_bdlora",
    "velora_config",
    "alora_invocation_tokens",
    "monteclora_config",
    "arrow_config",
    "kasa_config",
    "lora_bias",
    "modules_to_save",
    "trainable_token_indices",
    "target_parameters",
    "layer_replication",
)
#: ``init_lora_weights`` values that leave the base weights alone (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA
#: rewrite them, so the saved adapter only fits a base the server does not have; MiCA is a variant)
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # shoal.wire.schema.AdapterName
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_SENTINEL = 918273645  # a block index no prefix holds by chance: shows where the index sits in a prefix
_DIGEST_DOMAIN = b"shoal-lora-digest-v2\0"


class UnknownAdapter(BadRequest):
    """A request named an adapter this span does not have; the text lists the ones it has."""

    def __init__(self, name: str, known: Iterable[str]):
        self.adapter, self.known = name, tuple(known)
        have = ", ".join(self.known) if self.known else "none"
        super().__init__(f"unknown LoRA adapter {name!r}: this server has {have}")


@dataclass(frozen=True, eq=False)
class AdapterWeights:
    """One adapter's LoRA tensors for blocks ``[start, end)`` only, keyed by (block index within the
    span, module path inside the block), e.g. ``(0, "self_attn.q_proj") -> (A [r, in], B [out, r])``,
    with each module's scaling and the digest of the whole adapter (:func:`adapter_digest`)."""

    start: int
    end: int
    tensors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    scaling: Mapping[tuple[int, str], float]
    digest: str


def _weights_file(path: str | Path) -> Path:
    """The adapter's safetensors file, refusing a pickled one (loading it would run its code)."""
    directory = Path(path)
    if directory.is_file() and directory.name == ADAPTER_WEIGHTS:
        return directory
    file = directory / ADAPTER_WEIGHTS
    if file.is_file():
        return file
    if (directory / PICKLED_WEIGHTS).is_file():
        raise UsageError(
            f"LoRA adapter {directory}: {PICKLED_WEIGHTS} (a pickle) is not read; save it with peft's "
            f"save_pretrained(safe_serialization=True) or convert it to {ADAPTER_WEIGHTS}"
        )
    raise UsageError(f"no LoRA adapter at {directory}: need a directory with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")


#: the options that change what an adapter computes besides its tensors: part of its digest
SCALING_OPTIONS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern")


class _Digest:
    """sha256 over the adapter's scaling options, then its tensors fed in name order: each name,
    dtype, shape and raw bytes, length-prefixed."""

    def __init__(self, options: dict[str, Any]):
        self._hash = hashlib.sha256(_DIGEST_DOMAIN)
        scaling = json.dumps({k: options.get(k) for k in SCALING_OPTIONS}, sort_keys=True).encode()
        self._hash.update(len(scaling).to_bytes(8, "little") + scaling)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        header = f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{','.join(map(str, tensor.shape))}\0"
        self._hash.update(header.encode())
        self._hash.update(data.nbytes.to_bytes(8, "little"))
        self._hash.update(memoryview(data))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def adapter_digest(path: str | Path) -> str:
    """The sha256 (hex) of the adapter's scaling options and all of its tensors in name order: the same
    on every server that loaded it whatever blocks it serves, and what a client computes from its own
    copy to pin it."""
    weights = _weights_file(path)
    digest = _Digest(_read_options(path))
    with safe_open(str(weights), framework="pt", device="cpu") as handle:
        for name in sorted(handle.keys()):
            digest.add(name, handle.get_tensor(name))
    return digest.hexdigest()


def _read_options(path: str | Path) -> dict[str, Any]:
    """``adapter_config.json``, refusing every option whose computation is not plain LoRA."""
    directory = Path(path).parent if Path(path).is_file() else Path(path)
    file = directory / ADAPTER_CONFIG
    try:
        options = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"LoRA adapter {file.parent}: cannot read {ADAPTER_CONFIG}: {error}") from None
    where = f"LoRA adapter {file.parent}"
    if options.get("peft_type") != "LORA":
        raise UsageError(f"{where}: peft_type {options.get('peft_type')!r} is not supported, only plain LoRA ('LORA')")
    if options.get("bias", "none") != "none":
        raise UsageError(f"{where}: bias={options['bias']!r} (trained base biases) is not supported, only 'none'")
    if options.get("fan_in_fan_out"):
        raise UsageError(f"{where}: fan_in_fan_out=True (Conv1D-style weights) is not supported")
    for option in VARIANT_OPTIONS:
        if options.get(option):
            raise UsageError(f"{where}: {option}={options[option]!r} is not supported, only plain LoRA")
    if options.get("init_lora_weights", True) not in PLAIN_INITS:
        raise UsageError(
            f"{where}: init_lora_weights={options['init_lora_weights']!r} is not supported: it rewrites the base "
            "weights (save with peft's path_initial_model_for_weight_conversion to get a plain LoRA adapter)"
        )
    return options


def _pattern_value(patterns: Mapping[str, Any], module_name: str, default: Any) -> Any:
    """peft's ``get_pattern_key``: the first pattern matching the end of ``module_name``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return value
    return default


def _scaling(options: Mapping[str, Any], module_name: str, rank: int) -> float:
    """peft's ``update_layer``: alpha / r (alpha / sqrt(r) with rsLoRA), per-module r and alpha from the
    rank and alpha patterns, checked against the tensors' rank."""
    r = _pattern_value(options.get("rank_pattern") or {}, module_name, options.get("r", 8))
    alpha = _pattern_value(options.get("alpha_pattern") or {}, module_name, options.get("lora_alpha", 8))
    if r != rank:
        raise UsageError(f"LoRA tensors of {module_name} have rank {rank} where the adapter's config says r={r}")
    return alpha / r**0.5 if options.get("use_rslora") else alpha / r


def _block_key_parser(family, config):
    """A function from a peft tensor name to (global block index, module path in the block, "A" or "B"),
    refusing tensors outside the blocks, of blocks the model lacks, or of no LoRA pair."""
    head, found, tail = family.block_tensor_prefix(config, _SENTINEL).partition(str(_SENTINEL))
    if not found:
        raise ValueError(f"{family!r}: a block prefix without its index")
    block_key = re.compile(rf"^{re.escape(PEFT_PREFIX + head)}(\d+){re.escape(tail)}(.+)$")
    blocks = family.num_blocks(config)

    def parse(name: str) -> tuple[int, str, str]:
        match = block_key.match(name)
        if match is None:
            raise UsageError(
                f"target_modules: LoRA tensor {name!r} is outside the transformer blocks (embeddings, LM head, "
                "...): servers hold only blocks, so only their nn.Linear layers can be targeted"
            )
        index, rest = int(match[1]), match[2]
        if index >= blocks:
            raise UsageError(f"LoRA tensor {name!r} is for block {index}; the model has blocks 0 to {blocks - 1}")
        lora = _LORA_KEY.match(rest)
        if lora is None:
            if ".lora_embedding_" in rest:
                raise UsageError(f"target_modules: {name!r} targets an embedding, not an nn.Linear in the block")
            raise UsageError(f"LoRA tensor {name!r} is not a lora_A/lora_B weight of an nn.Linear (not plain LoRA)")
        return index, lora["module"], lora["part"]

    return parse


def read_adapter(path: str | Path, config, start: int, end: int, *, family=None) -> AdapterWeights:
    """The LoRA tensors of blocks ``[start, end)`` of the peft adapter at ``path`` (a directory), for a
    model of ``config``. Every tensor passes once through the digest, one at a time; only the span's
    blocks' tensors are kept. Blocks the adapter leaves out (``layers_to_transform``) run as base."""
    if family is None:
        from shoal.models import get_family

        family = get_family(config)
    options = _read_options(path)
    if not 0 <= start < end <= family.num_blocks(config):
        raise UsageError(f"bad block range [{start}, {end}) for {family.num_blocks(config)} blocks")
    parse = _block_key_parser(family, config)
    digest = _Digest(options)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(_weights_file(path)), framework="pt", device="cpu") as handle:
        names = sorted(handle.keys())
        if not names:
            raise UsageError(f"LoRA adapter {path} has no tensors")
        located = {name: parse(name) for name in names}  # refuses before reading any tensor
        for name in names:
            tensor = handle.get_tensor(name)
            digest.add(name, tensor)
            index, module, part = located[name]
            if start <= index < end:
                pair = parts.setdefault((index - start, module), {})
                if part in pair:
                    raise UsageError(f"LoRA adapter {path}: two lora_{part} tensors for {module} of block {index}")
                pair[part] = tensor
    tensors, scaling = {}, {}
    for (local, module), pair in sorted(parts.items()):
        module_name = f"{family.block_tensor_prefix(config, start + local)}{module}"
        if set(pair) != {"A", "B"}:
            raise UsageError(f"LoRA adapter {path}: {module_name} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise UsageError(f"LoRA adapter {path}: {module_name} has A {tuple(a.shape)} and B {tuple(b.shape)}")
        tensors[local, module] = (a, b)
        scaling[local, module] = _scaling(options, module_name, a.shape[0])
    return AdapterWeights(start, end, MappingProxyType(tensors), MappingProxyType(scaling), digest.hexdigest())


class _Selection:
    """The adapter the span's wrapped layers apply now (None: the base weights), shared by all of them."""

    __slots__ = ("name",)

    def __init__(self):
        self.name: str | None = None


class LoraLinear(nn.Module):
    """An ``nn.Linear``'s own weight and bias (the same parameters under the same names) plus the LoRA
    pairs of the adapters that target it; applies the selected one as peft's ``lora.Linear`` does."""

    def __init__(self, base: nn.Linear, selection: _Selection):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self._selection = selection
        # not parameters or buffers: code that walks those (fingerprints, byte counts) sees the base alone
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        lora = self.adapters.get(self._selection.name)  # type: ignore[arg-type]
        if lora is None:
            return result
        lora_a, lora_b, scaling = lora
        result_dtype = result.dtype
        if x.dtype != lora_a.dtype:
            x = x.to(lora_a.dtype)
        result = result + F.linear(F.linear(x, lora_a), lora_b) * scaling
        return result.to(result_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={sorted(self.adapters)}"


def _adapter_dtype(span_dtype: torch.dtype) -> torch.dtype:
    """What peft's default ``autocast_adapter_dtype`` keeps LoRA weights in: fp32 for a half-precision base."""
    return torch.float32 if span_dtype in (torch.float16, torch.bfloat16) else span_dtype


def _frozen(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``, without grad, and not an inference tensor (read or cast under
    inference mode), which a backward could not save."""
    with torch.inference_mode(False):
        tensor = tensor.detach().to(device=device, dtype=dtype)
        return tensor.clone() if tensor.is_inference() else tensor


def _refuse_quantised(span: BlockSpan) -> None:
    """A quantised layer (an ``nn.Linear`` subclass such as bitsandbytes', one of shoal's kernel layers,
    which have ``dequantized``, or a weight that is a tensor subclass such as torchao's) has no plain
    matrix for peft's computation to run beside."""
    for name, module in span.layers.named_modules():
        shoal_kernel = callable(getattr(module, "dequantized", None))  # shoal.quantization: Int8Linear, Int4Linear
        quantised_layer = (isinstance(module, nn.Linear) and type(module) is not nn.Linear) or shoal_kernel
        odd = [n for n, p in module.named_parameters(recurse=False) if type(p) not in (torch.Tensor, nn.Parameter)]
        if quantised_layer or odd:
            what = type(module).__name__ if quantised_layer else f"{type(module).__name__}.{odd[0]}"
            raise UsageError(
                f"LoRA adapters on quantised servers are not supported (layers.{name} is {what}): serve the "
                "blocks unquantised (no --quant) to run adapters"
            )


class SpanAdapters:
    """The LoRA adapters of one span, by name. The span's ``nn.Linear`` layers that an added adapter
    targets are replaced by :class:`LoraLinear` (once, on the first :meth:`add` that targets them);
    :meth:`active` picks the adapter that the computation inside it runs with."""

    def __init__(self, span: BlockSpan):
        self.span = span
        self._selection = _Selection()
        self._digests: dict[str, str] = {}  # by name; the tensors live in the wrapped layers only

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._digests))

    def infos(self) -> tuple[AdapterInfo, ...]:
        return tuple(AdapterInfo(name, self._digests[name]) for name in self.names())

    def nbytes(self) -> int:
        """Bytes the adapters' tensors take on the span's device (what a budget should count)."""
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for module in self.span.layers.modules()
            if isinstance(module, LoraLinear)
            for a, b, _ in module.adapters.values()
        )

    def _target(self, local: int, path: str) -> nn.Module:
        layer = self.span.layers[local]
        where = f"module {path!r} of block {self.span.start + local}"
        try:
            module = layer.get_submodule(path)
        except AttributeError:
            raise UsageError(f"target_modules: the model has no {where}") from None
        if not isinstance(module, LoraLinear) and type(module) is not nn.Linear:
            raise UsageError(f"target_modules: {where} is {type(module).__name__}, not nn.Linear")
        return module

    def add(self, name: str, weights: AdapterWeights) -> None:
        """Add adapter ``name`` (read by :func:`read_adapter` for this span's blocks), checking every
        shape before any layer changes; its tensors are frozen, on the span's device."""
        if not NAME_PATTERN.match(name):
            raise UsageError(f"adapter name {name!r}: 1 to 64 of A-Z a-z 0-9 . _ - (starting with a letter or digit)")
        if name in self._digests:
            raise UsageError(f"adapter {name!r} is already loaded on this span")
        if (weights.start, weights.end) != (self.span.start, self.span.end):
            raise UsageError(
                f"adapter {name!r} was read for blocks [{weights.start}, {weights.end}), "
                f"this span is [{self.span.start}, {self.span.end})"
            )
        _refuse_quantised(self.span)
        targets = {}
        for (local, path), (a, b) in weights.tensors.items():
            module = self._target(local, path)
            wanted_a, wanted_b = (a.shape[0], module.in_features), (module.out_features, a.shape[0])
            if tuple(a.shape) != wanted_a or tuple(b.shape) != wanted_b:
                raise UsageError(
                    f"adapter {name!r}: {path} of block {self.span.start + local} is {module.out_features} x "
                    f"{module.in_features}, its LoRA A {tuple(a.shape)} and B {tuple(b.shape)} do not fit"
                )
            targets[local, path] = module
        dtype = _adapter_dtype(self.span.dtype)
        for (local, path), module in targets.items():
            wrapper = module if isinstance(module, LoraLinear) else self._wrap(local, path, module)
            a, b = (_frozen(t, wrapper.weight.device, dtype) for t in weights.tensors[local, path])
            wrapper.adapters[name] = (a, b, weights.scaling[local, path])
        self._digests[name] = weights.digest

    def _wrap(self, local: int, path: str, linear: nn.Linear) -> LoraLinear:
        parent_path, _, attribute = path.rpartition(".")
        parent = self.span.layers[local].get_submodule(parent_path) if parent_path else self.span.layers[local]
        wrapper = LoraLinear(linear, self._selection)
        setattr(parent, attribute, wrapper)
        return wrapper

    @contextmanager
    def active(self, name: str | None) -> Iterator[None]:
        """Run the computation inside with adapter ``name`` (None: the base weights), then restore the
        previous choice, also on an exception. One selection per span: enter it on the thread that
        computes, around the computation (not across an ``await``)."""
        if name is not None and name not in self._digests:
            raise UnknownAdapter(name, self.names())
        previous = self._selection.name
        self._selection.name = name
        try:
            yield
        finally:
            self._selection.name = previous
