"""Phi-3 family: llama-like with fused q/k/v and gate/up projections (inside transformers' own layer),
partial rotary embeddings and an optional sliding window on every layer."""

from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RMSNorm, Phi3RotaryEmbedding

from shoal.models.decoder import DecoderFamily

FAMILY = DecoderFamily(("phi3",), Phi3DecoderLayer, Phi3RotaryEmbedding, Phi3RMSNorm)
