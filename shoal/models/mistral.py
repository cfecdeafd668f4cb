"""Mistral family: llama-like with GQA and a sliding window on every layer."""

from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)

from shoal.models.decoder import DecoderFamily

FAMILY = DecoderFamily(("mistral",), MistralDecoderLayer, MistralRotaryEmbedding, MistralRMSNorm)
