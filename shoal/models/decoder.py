"""Llama-like decoder families (Llama, Mistral, Qwen2, ...) built from transformers' own layers.

transformers' *model* builds rotary embeddings and the causal mask once and owns the KV cache; a span
of layers must rebuild all three. Masks come from transformers' own ``create_causal_mask`` /
``create_sliding_window_causal_mask`` (fed a tiny object that reports our cache geometry), so a span
feeds its layers exactly what the full model would, including ``None`` on the sdpa ``is_causal`` path.
A family is then just four classes: see :class:`DecoderFamily`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import masking_utils

from shoal.models.base import BlockSpan, CacheGeometry, ClientHead, add_deep_prompt
from shoal.models.kv import CachedStep, PackedSteps, PagedCache, PagePool, private_cache


def _cache_kwarg(fn) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x); use whichever ``fn`` takes."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


MASK_CACHE_KW = _cache_kwarg(masking_utils.create_causal_mask)


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The sliding window of global layer ``layer_idx``, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def _kv_offset(past_length: int, window: int | None) -> int:
    """First cached position a layer attends to, as transformers' DynamicSlidingWindowLayer keeps
    only the last ``window - 1`` past positions (so results match it bitwise past the window)."""
    return 0 if window is None else max(past_length - window + 1, 0)


class MaskSizes:
    """Stands in for a transformers ``Cache`` in mask creation: only reports the query offset and
    the key/value length and offset the layers will see."""

    is_compileable = False

    def __init__(self, past_length: int, window: int | None):
        self.past, self.window = past_length, window

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        offset = _kv_offset(self.past, self.window)
        return self.past + query_length - offset, offset


def checked_step(
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: PagedCache | None,
    past_length: int,
    prompts: torch.Tensor | None = None,
    num_blocks: int = 0,
) -> torch.Tensor | None:
    """Refuse a step that does not fit ``cache``, whose mask does not cover ``past_length + n`` or
    whose deep ``prompts`` are not ``[num_blocks, batch or 1, N, hidden]``; returns the mask as bool
    on ``hidden``'s device (a span's first act, whatever its family)."""
    batch, n = hidden.shape[:2]
    if prompts is not None:
        if prompts.dim() != 4 or prompts.shape[0] != num_blocks or prompts.shape[1] not in (1, batch):
            raise ValueError(f"deep prompts {tuple(prompts.shape)} != [{num_blocks}, 1 or {batch}, N, hidden]")
        if prompts.shape[3] != hidden.shape[2] or not prompts.is_floating_point():
            raise ValueError(f"deep prompts {tuple(prompts.shape)} {prompts.dtype}: need float, {hidden.shape[2]} wide")
    if cache is None and past_length:
        raise ValueError("past_length > 0 needs a cache")
    if cache is not None:
        if batch != cache.batch_size:
            raise ValueError(f"batch {batch} != cache batch {cache.batch_size}")
        if not 0 <= past_length <= cache.length:
            raise ValueError(f"past_length {past_length} outside the cached [0, {cache.length}]")
        if past_length + n > cache.max_length:
            raise ValueError(f"{past_length} + {n} positions exceed the cache's {cache.max_length}")
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (batch, past_length + n):
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != {(batch, past_length + n)}")
    return attention_mask.to(device=hidden.device, dtype=torch.bool)


def packed_steps(steps: list[CachedStep]) -> PackedSteps:
    """``steps`` checked (:func:`checked_step`, the mask as bool) and laid out as one batch."""
    checked = [
        CachedStep(s.hidden, s.position_ids, checked_step(s.hidden, s.attention_mask, s.cache, s.past_length),
                   s.cache, s.past_length)
        for s in steps
    ]  # fmt: skip
    return PackedSteps(checked, steps[0].hidden.device)


class DecoderSpan(BlockSpan):
    """Blocks ``[start, end)`` of a llama-like model with their rotary embedding and masks."""

    def __init__(
        self,
        config,
        start: int,
        end: int,
        layers: nn.ModuleList,
        rotary: nn.Module,
        geometry,
        rotary_keys: list[str | None] | None = None,
    ):
        super().__init__()
        self.config, self.start, self.end = config, start, end
        self.layers, self.rotary_emb, self.geometry = layers, rotary, geometry
        self.dtype = geometry.dtype
        self.windows = [sliding_window_of(config, i) for i in range(start, end)]
        # per layer, the argument the rotary takes besides (hidden, positions): None for the model's
        # single rotary, a layer type where the model builds one per type (see DecoderFamily)
        self.rotary_keys = rotary_keys if rotary_keys is not None else [None] * len(layers)
        self._cache_kw = _cache_kwarg(type(layers[0]).forward)

    def allocate_pool(self, num_pages: int, page_size: int) -> PagePool:
        return PagePool(len(self.layers), self.geometry, page_size, num_pages, next(self.layers.parameters()).device)

    def allocate_cache(self, batch_size: int, max_length: int) -> PagedCache:
        return private_cache(self, batch_size, max_length)

    def sub_span(self, first: int, last: int) -> DecoderSpan:
        if not 0 <= first < last <= len(self.layers):
            raise ValueError(f"sub-span [{first}, {last}) of a span of {len(self.layers)} blocks")
        layers = nn.ModuleList(self.layers[first:last])
        return DecoderSpan(
            self.config, self.start + first, self.start + last, layers, self.rotary_emb, self.geometry,
            self.rotary_keys[first:last],
        )  # fmt: skip

    def _mask(self, window, hidden, attention_mask, position_ids, past_length):
        create = masking_utils.create_causal_mask
        if window is not None:
            create = masking_utils.create_sliding_window_causal_mask
        return create(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            layer_idx=0,
            **{MASK_CACHE_KW: MaskSizes(past_length, window)},
        )

    def _position_embeddings(self, hidden, position_ids, key: str | None):
        """(cos, sin) [batch, n, head_dim] of the rotary for ``key`` (None: the model's only one)."""
        if key is None:
            return self.rotary_emb(hidden, position_ids)
        return self.rotary_emb(hidden, position_ids, key)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: PagedCache | None = None,
        past_length: int = 0,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attention_mask = checked_step(hidden, attention_mask, cache, past_length, prompts, len(self.layers))
        if cache is not None:
            return self._run(PackedSteps([CachedStep(hidden, position_ids, attention_mask, cache, past_length)],
                                         hidden.device), prompts)[0]  # fmt: skip
        hidden = hidden.to(self.dtype)
        rotations = {key: self._position_embeddings(hidden, position_ids, key) for key in set(self.rotary_keys)}
        masks = {w: self._mask(w, hidden, attention_mask, position_ids, 0) for w in set(self.windows)}
        return self._layers(hidden, position_ids, masks, rotations, None, prompts, 0)

    def forward_steps(self, steps: list[CachedStep]) -> list[torch.Tensor]:
        """One batched forward of several sessions' cached steps (see :mod:`shoal.models.kv`)."""
        return self._run(packed_steps(steps), None)

    def _run(self, batch: PackedSteps, prompts: torch.Tensor | None) -> list[torch.Tensor]:
        hidden = batch.hidden.to(self.dtype)
        rotations = {key: self._position_embeddings(hidden, batch.position_ids, key) for key in set(self.rotary_keys)}
        additive = self.dtype if self.config._attn_implementation == "eager" else None
        masks = {w: batch.mask(w, additive) for w in set(self.windows)}
        past = batch.uniform_past if prompts is not None else 0
        out = self._layers(hidden, batch.position_ids, masks, rotations, batch.cache_step(self.start), prompts, past)
        return batch.split(out)

    def _layers(self, hidden, position_ids, masks, rotations, step, prompts, past_length) -> torch.Tensor:
        for i, (layer, window, key) in enumerate(zip(self.layers, self.windows, self.rotary_keys, strict=True)):
            hidden = add_deep_prompt(hidden, None if prompts is None else prompts[i], past_length)
            hidden = layer(
                hidden,
                attention_mask=masks[window],
                position_ids=position_ids,
                use_cache=step is not None,
                position_embeddings=rotations[key],
                **{self._cache_kw: step},
            )
        return hidden


@dataclass(frozen=True)
class HeadScalars:
    """Scalars some families' models apply on the client side of the blocks (all off by default).

    transformers applies them in the model, not the layers, so a family whose config has them says so
    through :attr:`DecoderFamily.head_scalars`; the client head then applies them as the model would.
    """

    embed_scale: float = 1.0  # embeddings *= this (Gemma: sqrt(hidden_size); a config's embedding_multiplier)
    embed_scale_in_dtype: bool = False  # round the scale to the embeddings' dtype first, as Gemma does
    logits_divisor: float = 1.0  # logits /= this (a config's ``logits_scaling``)
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma's final soft-capping)


def no_head_scalars(config) -> HeadScalars:
    return HeadScalars()


BlockTensors = dict[str, torch.Tensor]  # one block's tensors, named relative to its block prefix


def tensors_as_stored(config, tensors: BlockTensors) -> BlockTensors:
    return tensors


class DecoderClientHead(ClientHead):
    """Token embeddings, final norm and LM head (sharing the embedding matrix when tied), with the
    family's :class:`HeadScalars`. Runs under the caller's grad mode: gradients flow through the norm
    and LM head to the hidden states (training through the swarm); its own weights are frozen as
    loaded (``requires_grad`` False), so inference builds no graph."""

    def __init__(
        self,
        embed_tokens: nn.Embedding,
        norm: nn.Module,
        lm_head: nn.Linear,
        dtype: torch.dtype,
        scalars: HeadScalars = HeadScalars(),
    ):
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head, self.dtype = embed_tokens, norm, lm_head, dtype
        self.scalars = scalars

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        scale = self.scalars.embed_scale
        if scale != 1.0:  # in bf16 the two differ: a rounded scale (Gemma) or a float one (the others)
            hidden = hidden * (torch.tensor(scale).to(hidden.dtype) if self.scalars.embed_scale_in_dtype else scale)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden.to(self.dtype)))
        if self.scalars.logits_divisor != 1.0:
            logits = logits / self.scalars.logits_divisor
        cap = self.scalars.logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def block_tensors(state_dict: dict[str, torch.Tensor], prefix: str) -> BlockTensors:
    """The tensors of ``state_dict`` under ``prefix`` (one block's), named relative to it."""
    return {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}


def check_range(family, config, start: int, end: int, built: int | None = None) -> None:
    """Refuse a block range outside the model (or one that does not match the ``built`` blocks)."""
    if not 0 <= start < end <= family.num_blocks(config):
        raise ValueError(f"bad block range [{start}, {end}) for {family.num_blocks(config)} blocks")
    if built is not None and built != end - start:
        raise ValueError(f"blocks [{start}, {end}) need {end - start} built blocks, got {built}")


def assign_tensors(module: nn.Module, tensors: dict[str, torch.Tensor], what: str, dtype, device) -> nn.Module:
    """Give a meta-device ``module`` its checkpoint tensors, then cast and move it."""
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{what}: missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}")
    module.load_state_dict(tensors, strict=True, assign=True)
    module.to(device=device, dtype=dtype).requires_grad_(False).eval()
    stray = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if stray:
        raise ValueError(f"{what}: no weights for {stray[:8]}")
    return module


def prepare_config(config):
    """A private copy of ``config`` with an attention implementation set (``sdpa`` unless given):
    a config read from config.json has none, and then transformers would build no causal mask."""
    config = copy.deepcopy(config)
    if getattr(config, "_attn_implementation", None) is None:
        config._attn_implementation = "sdpa"
    if getattr(config, "_experts_implementation", None) is None:
        # what PreTrainedModel.get_correct_experts_implementation picks for MoE layers (others ignore it)
        config._experts_implementation = "grouped_mm"
    return config


def span_from_blocks(family, config, start: int, end: int, state_dict, dtype, device):
    """A family's span of blocks ``[start, end)`` from a state dict holding them: each block built by
    ``family.build_block``, then joined by ``family.assemble_span`` (what a server loading block by
    block does, with everything in hand)."""
    check_range(family, config, start, end)
    blocks = [
        family.build_block(config, i, block_tensors(state_dict, family.block_tensor_prefix(config, i)), dtype, device)
        for i in range(start, end)
    ]
    return family.assemble_span(config, start, end, blocks, dtype, device)


@dataclass(frozen=True)
class DecoderFamily:
    """A llama-like family: which transformers classes to wrap, and where its tensors live."""

    model_types: tuple[str, ...]
    layer_cls: type[nn.Module]  # called as layer_cls(config, global_layer_idx)
    rotary_cls: type[nn.Module]  # called as rotary_cls(config=config)
    norm_cls: type[nn.Module]  # called as norm_cls(hidden_size, eps=config.rms_norm_eps)
    prefix: str = "model."
    head_scalars: Callable[[Any], HeadScalars] = no_head_scalars  # the config's client-side scalars
    # one block's checkpoint tensors -> the names and layout its layer_cls expects (e.g. fusing experts)
    convert_block_tensors: Callable[[Any, BlockTensors], BlockTensors] = tensors_as_stored
    # the model builds one rotary per entry of config.layer_types, called rotary(x, positions, layer_type)
    # (Gemma 3: sliding and full layers have their own theta and scaling)
    rotary_per_layer_type: bool = False

    def num_blocks(self, config) -> int:
        return config.num_hidden_layers

    def block_tensor_prefix(self, config, index: int) -> str:
        return f"{self.prefix}layers.{index}."

    def client_tensor_names(self, config) -> list[str]:
        names = [f"{self.prefix}embed_tokens.weight", f"{self.prefix}norm.weight"]
        if not getattr(config, "tie_word_embeddings", False):
            names.append("lm_head.weight")
        return names

    def cache_geometry(self, config, dtype: torch.dtype) -> CacheGeometry:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return CacheGeometry(config.num_key_value_heads, head_dim, dtype)

    def build_span(self, config, start, end, state_dict, dtype, device) -> DecoderSpan:
        return span_from_blocks(self, config, start, end, state_dict, dtype, device)

    def build_block(self, config, index: int, tensors: BlockTensors, dtype, device) -> nn.Module:
        """Block ``index`` from its checkpoint tensors (named relative to its block prefix), cast and
        moved: a server builds its span one block at a time, quantising each as it comes."""
        config = prepare_config(config)
        with torch.device("meta"):
            layer = self.layer_cls(config, index)
        return assign_tensors(layer, self.convert_block_tensors(config, tensors), f"block {index}", dtype, device)

    def assemble_span(self, config, start, end, blocks: list[nn.Module], dtype, device) -> DecoderSpan:
        """The span of blocks ``[start, end)`` built by :meth:`build_block`."""
        check_range(self, config, start, end, len(blocks))
        config = prepare_config(config)
        rotary = self.rotary_cls(config=config).to(device)  # inv_freq stays fp32, as it is computed
        keys = [config.layer_types[i] for i in range(start, end)] if self.rotary_per_layer_type else None
        return DecoderSpan(config, start, end, nn.ModuleList(blocks), rotary, self.cache_geometry(config, dtype), keys)

    def build_client_head(self, config, state_dict, dtype, device) -> DecoderClientHead:
        tied = getattr(config, "tie_word_embeddings", False)
        with torch.device("meta"):
            embed = nn.Embedding(config.vocab_size, config.hidden_size)
            norm = self.norm_cls(config.hidden_size, eps=config.rms_norm_eps)
            lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        missing = [name for name in self.client_tensor_names(config) if name not in state_dict]
        if missing:
            raise ValueError(f"client head: missing tensors {missing}")
        embed_name, norm_name = self.client_tensor_names(config)[:2]
        assign_tensors(embed, {"weight": state_dict[embed_name]}, "embeddings", dtype, device)
        assign_tensors(norm, {"weight": state_dict[norm_name]}, "final norm", dtype, device)
        if tied:
            lm_head.weight = embed.weight
        else:
            assign_tensors(lm_head, {"weight": state_dict["lm_head.weight"]}, "lm_head", dtype, device)
        return DecoderClientHead(embed, norm, lm_head, dtype, self.head_scalars(config))
