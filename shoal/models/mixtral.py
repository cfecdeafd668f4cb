"""Mixtral family: Mistral's attention (sliding window on every layer) and a sparse block on every
layer, stored as ``block_sparse_moe.gate`` (router) and ``block_sparse_moe.experts.{e}.w1/w3/w2``
(gate, up, down) in checkpoints, where transformers' layer has ``mlp.gate`` and fused experts."""

from transformers.models.mixtral.modeling_mixtral import (
    MixtralDecoderLayer,
    MixtralRMSNorm,
    MixtralRotaryEmbedding,
)

from shoal.models.decoder import DecoderFamily
from shoal.models.experts import ExpertLayout

FAMILY = DecoderFamily(
    ("mixtral",),
    MixtralDecoderLayer,
    MixtralRotaryEmbedding,
    MixtralRMSNorm,
    convert_block_tensors=ExpertLayout("block_sparse_moe.", gate="w1", up="w3", down="w2"),
)
