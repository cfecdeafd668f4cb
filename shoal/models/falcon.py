"""Falcon family: its own layout and layer signature around transformers' ``FalconDecoderLayer``.

Layout: blocks ``transformer.h.N.``, embeddings ``transformer.word_embeddings``, a LayerNorm with bias
``transformer.ln_f``, an LM head tied to the embeddings unless the config says otherwise. The layer
takes ``alibi`` and ``layer_past`` and returns a tuple. The config picks the variant, all inside the
layer: rotary or alibi position bias, multi-query (one kv head), the new decoder architecture (grouped
kv heads, ``ln_attn``/``ln_mlp``) or plain multi-head, parallel or sequential attention and MLP.

As ``FalconModel`` does, a span always materialises the causal mask and, with alibi, adds the bias to
it: alibi counts the non-padded positions of each row's attention mask (past and new), so left padding
and a KV cache shift it exactly as in the full model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import masking_utils
from transformers.models.falcon.modeling_falcon import FalconDecoderLayer, FalconRotaryEmbedding, build_alibi_tensor

from shoal.models.base import BlockSpan, CacheGeometry, add_deep_prompt
from shoal.models.decoder import (
    MASK_CACHE_KW,
    BlockTensors,
    DecoderClientHead,
    MaskSizes,
    assign_tensors,
    check_range,
    checked_step,
    packed_steps,
    prepare_config,
    span_from_blocks,
)
from shoal.models.kv import CachedStep, PackedSteps, PagedCache, PagePool, private_cache

PREFIX = "transformer."


def kv_heads(config) -> int:
    """Key/value heads a block's cache stores: one per group in the new decoder architecture, one with
    multi-query, else one per query head (the config's ``num_key_value_heads`` in newer transformers).

    In the new architecture transformers 5.17's layer broadcasts each group's key to its query heads
    before caching, 5.25's hands over one per group and repeats them itself; :class:`~shoal.models.kv.PagedStep`
    stores one per group either way and hands back as many as it was given."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconSpan(BlockSpan):
    """Blocks ``[start, end)`` of a Falcon model with its rotary embedding or alibi bias and mask."""

    def __init__(self, config, start: int, end: int, layers: nn.ModuleList, rotary: nn.Module | None, geometry):
        super().__init__()
        self.config, self.start, self.end = config, start, end
        self.layers, self.rotary_emb, self.geometry = layers, rotary, geometry
        self.dtype = geometry.dtype

    def allocate_pool(self, num_pages: int, page_size: int) -> PagePool:
        return PagePool(len(self.layers), self.geometry, page_size, num_pages, next(self.layers.parameters()).device)

    def allocate_cache(self, batch_size: int, max_length: int) -> PagedCache:
        return private_cache(self, batch_size, max_length)

    def sub_span(self, first: int, last: int) -> FalconSpan:
        if not 0 <= first < last <= len(self.layers):
            raise ValueError(f"sub-span [{first}, {last}) of a span of {len(self.layers)} blocks")
        layers = nn.ModuleList(self.layers[first:last])
        return FalconSpan(self.config, self.start + first, self.start + last, layers, self.rotary_emb, self.geometry)

    def _mask_and_alibi(self, hidden, attention_mask, position_ids, past_length):
        """FalconModel's mask, always materialised, and with alibi its bias [batch, heads, 1, kv], which
        the mask then carries too (masked positions stay at the dtype's lowest value)."""
        mask = masking_utils.create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            allow_is_causal_skip=False,
            **{MASK_CACHE_KW: MaskSizes(past_length, None)},
        )
        if not self.config.alibi:
            return mask, None
        batch, n = hidden.shape[:2]
        keys = attention_mask if attention_mask is not None else torch.ones(batch, past_length + n, dtype=torch.bool)
        heads = self.config.num_attention_heads
        alibi = build_alibi_tensor(keys.to(device=hidden.device, dtype=torch.long), heads, hidden.dtype)
        alibi = alibi.reshape(batch, heads, 1, past_length + n)
        if mask is None or mask.ndim != 4:
            return mask, alibi
        lowest = torch.finfo(hidden.dtype).min
        if mask.dtype == torch.bool:
            mask = torch.where(mask, torch.full((), 0.0, device=mask.device, dtype=hidden.dtype), lowest)
        return torch.masked_fill(alibi / math.sqrt(self.config.hidden_size // heads), mask < -1, lowest), alibi

    def _batch_mask_and_alibi(self, batch: PackedSteps, dtype: torch.dtype):
        """:meth:`_mask_and_alibi` for a packed batch: each row's alibi counts its own visible keys."""
        if not self.config.alibi:
            return batch.mask(None, dtype if self.config._attn_implementation == "eager" else None), None
        mask = batch.mask(None)
        heads, rows = self.config.num_attention_heads, batch.rows
        alibi = build_alibi_tensor(batch.visible_keys.to(torch.long), heads, dtype)
        alibi = alibi.reshape(rows, heads, 1, batch.kv_length)
        scaled = alibi / math.sqrt(self.config.hidden_size // heads)
        return torch.where(mask, scaled, torch.finfo(dtype).min), alibi

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
            step = CachedStep(hidden, position_ids, attention_mask, cache, past_length)
            return self._run(PackedSteps([step], hidden.device), prompts)[0]
        hidden = hidden.to(self.dtype)
        mask, alibi = self._mask_and_alibi(hidden, attention_mask, position_ids, 0)
        return self._layers(hidden, position_ids, mask, alibi, None, prompts, 0)

    def forward_steps(self, steps: list[CachedStep]) -> list[torch.Tensor]:
        """One batched forward of several sessions' cached steps (see :mod:`shoal.models.kv`)."""
        return self._run(packed_steps(steps), None)

    def _run(self, batch: PackedSteps, prompts: torch.Tensor | None) -> list[torch.Tensor]:
        hidden = batch.hidden.to(self.dtype)
        mask, alibi = self._batch_mask_and_alibi(batch, hidden.dtype)
        past = batch.uniform_past if prompts is not None else 0
        out = self._layers(hidden, batch.position_ids, mask, alibi, batch.cache_step(self.start), prompts, past)
        return batch.split(out)

    def _layers(self, hidden, position_ids, mask, alibi, step, prompts, past_length) -> torch.Tensor:
        rotation = None if self.rotary_emb is None else self.rotary_emb(hidden, position_ids)
        for i, layer in enumerate(self.layers):
            hidden = add_deep_prompt(hidden, None if prompts is None else prompts[i], past_length)
            hidden, _ = layer(
                hidden,
                alibi=alibi,
                attention_mask=mask,
                position_ids=position_ids,
                layer_past=step,
                use_cache=step is not None,
                position_embeddings=rotation,
            )
        return hidden


@dataclass(frozen=True)
class FalconFamily:
    """Falcon's checkpoint layout and span; ``layer_cls`` lets the server size a block."""

    model_types: tuple[str, ...] = ("falcon",)
    layer_cls: type[nn.Module] = FalconDecoderLayer  # called as layer_cls(config, global_layer_idx)

    def num_blocks(self, config) -> int:
        return config.num_hidden_layers

    def block_tensor_prefix(self, config, index: int) -> str:
        return f"{PREFIX}h.{index}."

    def client_tensor_names(self, config) -> list[str]:
        names = [f"{PREFIX}word_embeddings.weight", f"{PREFIX}ln_f.weight", f"{PREFIX}ln_f.bias"]
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def cache_geometry(self, config, dtype: torch.dtype) -> CacheGeometry:
        return CacheGeometry(kv_heads(config), config.hidden_size // config.num_attention_heads, dtype)

    def build_span(self, config, start, end, state_dict, dtype, device) -> FalconSpan:
        return span_from_blocks(self, config, start, end, state_dict, dtype, device)

    def build_block(self, config, index: int, tensors: BlockTensors, dtype, device) -> nn.Module:
        """Block ``index`` from its checkpoint tensors (named relative to its block prefix)."""
        config = prepare_config(config)
        with torch.device("meta"):
            layer = self.layer_cls(config, index)
        return assign_tensors(layer, tensors, f"block {index}", dtype, device)

    def assemble_span(self, config, start, end, blocks: list[nn.Module], dtype, device) -> FalconSpan:
        check_range(self, config, start, end, len(blocks))
        config = prepare_config(config)
        rotary = None if config.alibi else FalconRotaryEmbedding(config=config).to(device)  # inv_freq stays fp32
        return FalconSpan(config, start, end, nn.ModuleList(blocks), rotary, self.cache_geometry(config, dtype))

    def build_client_head(self, config, state_dict, dtype, device) -> DecoderClientHead:
        missing = [name for name in self.client_tensor_names(config) if name not in state_dict]
        if missing:
            raise ValueError(f"client head: missing tensors {missing}")
        with torch.device("meta"):
            embed = nn.Embedding(config.vocab_size, config.hidden_size)
            norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
            lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        embeddings = {"weight": state_dict[f"{PREFIX}word_embeddings.weight"]}
        assign_tensors(embed, embeddings, "embeddings", dtype, device)
        final_norm = {k: state_dict[f"{PREFIX}ln_f.{k}"] for k in ("weight", "bias")}
        assign_tensors(norm, final_norm, "final norm", dtype, device)
        if config.tie_word_embeddings:
            lm_head.weight = embed.weight
        else:
            assign_tensors(lm_head, {"weight": state_dict["lm_head.weight"]}, "lm_head", dtype, device)
        return DecoderClientHead(embed, norm, lm_head, dtype)


FAMILY = FalconFamily()
