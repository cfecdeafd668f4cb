"""Llama family (also SmolLM2 and other ``model_type: llama`` checkpoints)."""

from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from shoal.models.decoder import DecoderFamily

FAMILY = DecoderFamily(("llama",), LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaRMSNorm)
