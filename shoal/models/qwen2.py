"""Qwen2 family: llama-like with q/k/v biases and per-layer sliding windows (``config.layer_types``)."""

from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

from shoal.models.decoder import DecoderFamily

FAMILY = DecoderFamily(("qwen2",), Qwen2DecoderLayer, Qwen2RotaryEmbedding, Qwen2RMSNorm)
