"""Qwen3 family: Qwen2's layout plus RMS norms on each head's queries and keys (inside transformers'
attention), biases where ``attention_bias`` says, and per-layer sliding windows (``config.layer_types``)."""

from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from shoal.models.decoder import DecoderFamily

FAMILY = DecoderFamily(("qwen3",), Qwen3DecoderLayer, Qwen3RotaryEmbedding, Qwen3RMSNorm)
