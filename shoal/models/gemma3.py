"""Gemma 3 text family (``gemma3_text``, e.g. Gemma-3-270M): sliding and full layers, each type with
its own rotary; embeddings scaled by sqrt(hidden_size) and optional final logit soft-capping on the
client. ``query_pre_attn_scalar``, the q/k norms and the sandwich norms live inside transformers'
layer, so the span needs nothing for them."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RMSNorm, Gemma3RotaryEmbedding

from shoal.models.decoder import BlockTensors, DecoderFamily, HeadScalars


def gemma3_head_scalars(config) -> HeadScalars:
    """What ``Gemma3TextModel`` / ``Gemma3ForCausalLM`` apply around the layers."""
    return HeadScalars(
        embed_scale=config.hidden_size**0.5, embed_scale_in_dtype=True, logit_softcap=config.final_logit_softcapping
    )


@dataclass(frozen=True)
class Gemma3Family(DecoderFamily):
    """Refuses bidirectional configs (EmbeddingGemma shares the ``gemma3_text`` type): their masks
    are not causal, and a span builds causal ones."""

    def build_block(self, config, index: int, tensors: BlockTensors, dtype, device) -> nn.Module:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("gemma3_text with use_bidirectional_attention (an embedding model) is not a causal LM")
        return super().build_block(config, index, tensors, dtype, device)


FAMILY = Gemma3Family(
    ("gemma3_text",),
    Gemma3DecoderLayer,
    Gemma3RotaryEmbedding,
    Gemma3RMSNorm,
    head_scalars=gemma3_head_scalars,
    rotary_per_layer_type=True,
)
