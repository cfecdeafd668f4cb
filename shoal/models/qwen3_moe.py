"""Qwen3-MoE family: Qwen3's attention; a sparse block (router ``mlp.gate``, experts
``mlp.experts.{e}.{gate,up,down}_proj`` in checkpoints) on the layers ``decoder_sparse_step`` and
``mlp_only_layers`` pick, a dense MLP on the others."""

from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
)

from shoal.models.decoder import DecoderFamily
from shoal.models.experts import ExpertLayout

FAMILY = DecoderFamily(
    ("qwen3_moe",),
    Qwen3MoeDecoderLayer,
    Qwen3MoeRotaryEmbedding,
    Qwen3MoeRMSNorm,
    convert_block_tensors=ExpertLayout("mlp.", gate="gate_proj", up="up_proj", down="down_proj"),
)
