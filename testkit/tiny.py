"""The one factory of small random models for tests and benchmarks: a config per family, the model,
and its sharded checkpoint on disk (as ``shoal serve`` and the client read it).

Defaults: 4 blocks, hidden 64, GQA 4/2 heads, vocab 256, no eos (generation runs to
``max_new_tokens``), and ``initializer_range`` 0.3 instead of the usual 0.02. The large init spreads
the logits, so the top-2 gap of every greedy choice is far above fp32 noise (~1e-5): two backends
computing the same blocks then choose the same tokens, and exact token equality is a fair test.
Anything else is an override: ``tiny_model("qwen2", seed=3, num_hidden_layers=6)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers is imported when a model is made: the shape alone costs nothing
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

#: Keeps a random tiny model's greedy choices far from ties (see the module docstring).
LARGE_INIT = 0.3
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=LARGE_INIT,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)
#: Shorter than a 64-token generation, so the sliding-window path really runs.
SLIDING_WINDOW = 24


def _llama(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA."""
    from transformers import LlamaConfig

    return LlamaConfig(**shape)


def _mistral(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA, sliding window on every layer."""
    from transformers import MistralConfig

    return MistralConfig(**{"sliding_window": sliding_window, **shape})


def _qwen2(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA, q/k/v biases, sliding window on layers >= 2 only (``max_window_layers``)."""
    from transformers import Qwen2Config

    window = {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 2}
    return Qwen2Config(**{**window, **shape})


#: Not hidden_size / num_attention_heads (16), as in real Qwen3 checkpoints: the projections are not square.
HEAD_DIM = 24
#: Experts of the tiny MoE families (each token picks 2): enough that routing really chooses.
NUM_EXPERTS = 4


def _qwen3(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA, q/k norms, q/k/v/o biases, head_dim apart from hidden size, sliding window on layers >= 2."""
    from transformers import Qwen3Config

    window = {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 2}
    return Qwen3Config(**{"head_dim": HEAD_DIM, "attention_bias": True, **window, **shape})


def _qwen3_moe(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """Qwen3's attention (sliding window on every layer); 4 experts of width 48, top-2 with the top-2
    weights renormalised (``norm_topk_prob``), sparse on layers 1 and 3 only (``decoder_sparse_step``
    2), a dense MLP of width 128 on layers 0 and 2."""
    from transformers import Qwen3MoeConfig

    moe = {
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "decoder_sparse_step": 2,
    }
    window = {"use_sliding_window": True, "sliding_window": sliding_window}
    return Qwen3MoeConfig(**{"head_dim": HEAD_DIM, "attention_bias": True, **moe, **window, **shape})


def _mixtral(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA, sliding window on every layer, 4 experts on every layer, top-2; ``router_jitter_noise``
    set, though transformers applies it in training only."""
    from transformers import MixtralConfig

    moe = {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": 2, "router_jitter_noise": 0.1}
    return MixtralConfig(**{"head_dim": HEAD_DIM, "sliding_window": sliding_window, **moe, **shape})


#: Gemma 3's tiny window at most: shorter than the swarm tests' 12-token prompts, so the prefill slides too.
GEMMA3_WINDOW = 8


def _gemma3(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """Gemma 3 text: sliding and full layers mixed (``layer_types``), a window of at most
    :data:`GEMMA3_WINDOW`, a rotary per layer type (sliding theta 500, full theta 50k with linear scaling 2),
    ``query_pre_attn_scalar`` 24 (not head_dim 16), final logit soft-capping (on the client, as are
    the embeddings' sqrt(hidden_size) scale), q/k/v/o biases. ``attn_logit_softcapping`` is set too,
    though transformers' Gemma 3 layer (5.24) does not apply it."""
    from transformers import Gemma3TextConfig

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50_000.0},
    }
    layers = shape["num_hidden_layers"]
    gemma = {
        "head_dim": 16,
        "sliding_window": min(sliding_window, GEMMA3_WINDOW),
        # 4 blocks: sliding, full, sliding, sliding (the 2- and 3-hop routes get mixed and single-type spans)
        "layer_types": ["full_attention" if i % 4 == 1 else "sliding_attention" for i in range(layers)],
        "rope_parameters": rope,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 10.0,
        "attn_logit_softcapping": 20.0,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
    }
    return Gemma3TextConfig(**{**gemma, **shape})


def _phi3(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA, fused q/k/v and gate/up projections, rotary on half of each head
    (``partial_rotary_factor`` 0.5, theta 500), sliding window on every layer."""
    from transformers import Phi3Config

    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    return Phi3Config(**{"sliding_window": sliding_window, "rope_parameters": rope, **shape})


def _falcon_shape(shape: dict[str, Any]) -> dict[str, Any]:
    """:data:`TINY_SHAPE` in FalconConfig's names (it would keep the others as stray attributes)."""
    shape = dict(shape)
    shape["ffn_hidden_size"] = shape.pop("intermediate_size")
    shape["num_kv_heads"] = shape.pop("num_key_value_heads")
    return shape


def _falcon(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """Falcon-7B's layout, FalconConfig's defaults: multi-query (one kv head), rotary, attention and
    MLP in parallel after one shared LayerNorm."""
    from transformers import FalconConfig

    return FalconConfig(**_falcon_shape(shape))


def _falcon_alibi(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """Falcon-RW's layout: alibi instead of rotary, multi-head (not multi-query), attention then MLP
    (not in parallel), biases on every linear layer."""
    from transformers import FalconConfig

    shape = _falcon_shape(shape)
    shape["num_kv_heads"] = shape["num_attention_heads"]  # the old architecture caches one kv head per head
    return FalconConfig(**{"alibi": True, "multi_query": False, "parallel_attn": False, "bias": True, **shape})


def _falcon_new_arch(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """Falcon-40B's layout: the new decoder architecture (grouped kv heads, separate ``ln_attn`` and
    ``ln_mlp``, attention and MLP in parallel), rotary with theta 500."""
    from transformers import FalconConfig

    arch = {"new_decoder_architecture": True, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
    return FalconConfig(**{**arch, **_falcon_shape(shape)})


# --- families without an adapter, served by the generic path (shoal.models.generic) ---------------


def _olmo2(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA, q/k RMS norms over all heads, norms after attention and MLP instead of before."""
    from transformers import Olmo2Config

    return Olmo2Config(**shape)


def _granite(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA, every multiplier off its default of 1: embeddings and logits scaled on the client
    (``embedding_multiplier``, ``logits_scaling``), residual and attention scaled in the layers."""
    from transformers import GraniteConfig

    scalars = {"embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.5}
    return GraniteConfig(**{**scalars, "attention_multiplier": 0.1, **shape})


def _helium(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA, head_dim given (16), RMS norm epsilon 1e-8."""
    from transformers import HeliumConfig

    return HeliumConfig(**{"head_dim": 16, **shape})


def _glm(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """GQA, q/k/v biases, fused gate/up projection, rotary on half of each head (interleaved)."""
    from transformers import GlmConfig

    return GlmConfig(**{"head_dim": 16, **shape})


def _olmo3(shape: dict[str, Any], sliding_window: int) -> PretrainedConfig:
    """Olmo 2's layers with sliding and full layers mixed (``layer_types``: 3 sliding, 1 full), the
    window shorter than a generation, and a rotary per layer type (theta 500 and 50k)."""
    from transformers import Olmo3Config

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        "full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
    }
    return Olmo3Config(**{"sliding_window": sliding_window, "rope_parameters": rope, **shape})


#: Families served by the generic path, not by an adapter: shoal names none of them (tested).
GENERIC_FAMILIES = ("glm", "granite", "helium", "olmo2", "olmo3")


#: The tiny config builder of each family: ``builder(shape, sliding_window)``, where ``shape`` is
#: :data:`TINY_SHAPE` with the caller's overrides applied. One entry per family; the docstring of a
#: builder says which family-specific features its config switches on.
_BUILDERS: dict[str, Callable[[dict[str, Any], int], PretrainedConfig]] = {
    "falcon": _falcon,
    "falcon_alibi": _falcon_alibi,
    "falcon_new_arch": _falcon_new_arch,
    "gemma3": _gemma3,
    "glm": _glm,
    "granite": _granite,
    "helium": _helium,
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "olmo2": _olmo2,
    "olmo3": _olmo3,
    "phi3": _phi3,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
}
FAMILIES = tuple(_BUILDERS)


def tiny_config(family: str = "llama", *, sliding_window: int = SLIDING_WINDOW, **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``family`` (one of :data:`FAMILIES`), with ``overrides`` set on it;
    ``sliding_window`` applies to the families that have one."""
    builder = _BUILDERS.get(family)
    if builder is None:
        raise ValueError(f"no tiny config for {family!r}: choose one of {', '.join(FAMILIES)}")
    return builder({**TINY_SHAPE, **overrides}, sliding_window)


def tiny_model(
    family: str = "llama",
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **overrides: Any,
) -> PreTrainedModel:
    """A random model of :func:`tiny_config` in eval mode; the same ``seed`` gives the same weights
    (torch's global RNG is seeded with it)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def save_checkpoint(model: PreTrainedModel, out_dir: str | Path, tokenizer=None) -> Path:
    """``model`` as shoal's sharded checkpoint (one shard per block) with its generation config."""
    from shoal.checkpoints import save_sharded

    return save_sharded(model, model.config, out_dir, tokenizer=tokenizer)


def tiny_checkpoint(
    out_dir: str | Path, family: str = "llama", seed: int = 0, *, tokenizer=None, **overrides: Any
) -> Path:
    """:func:`tiny_model` written to ``out_dir`` by :func:`save_checkpoint`; returns ``out_dir``."""
    return save_checkpoint(tiny_model(family, seed, **overrides), out_dir, tokenizer=tokenizer)


def char_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """One character per token, for tiny random models: printable ASCII, then CJK ideographs up to
    ``vocab_size`` (id 0, ``!``, is the pad token). Any id sequence decodes, so stop strings and
    streamers work on random tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(0x21, 0x7F)]
    chars += [chr(0x4E00 + i) for i in range(vocab_size - len(chars))]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="!"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="!")


#: Byte pairs :func:`byte_tokenizer` merges: the lead bytes of :func:`char_tokenizer`'s ideographs, and "th".
BYTE_MERGES = ((0xE4, 0xB8), (0xE4, 0xB9), (0xE4, 0xBA), (ord("t"), ord("h")))


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Another tokenizer for the texts of :func:`char_tokenizer`, for a draft model of another
    tokenizer: UTF-8 bytes (GPT-2's byte-level alphabet, ids 0-255) and :data:`BYTE_MERGES` (ids
    256-259), so a character is 1 to 3 tokens: the two tokenizations of a text differ in length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # GPT-2's bytes_to_unicode
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {char[b]: b for b in range(256)}
    merges = [(char[a], char[b]) for a, b in BYTE_MERGES]
    vocab |= {a + b: 256 + i for i, (a, b) in enumerate(merges)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def inputs(
    hidden_size: int, n: int, start: int = 0, batch: int = 1, seed: int = 0, mask: bool = False
) -> list[torch.Tensor]:
    """What a block span takes for ``n`` new tokens at positions ``start...``: ``[hidden,
    position_ids(, attention_mask)]``, the hidden states seeded by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, n, hidden_size, generator=generator)
    position_ids = torch.arange(start, start + n).expand(batch, n).contiguous()
    tensors = [hidden, position_ids]
    if mask:
        tensors.append(torch.ones(batch, start + n, dtype=torch.bool))
    return tensors


__all__ = [
    "FAMILIES",
    "GENERIC_FAMILIES",
    "LARGE_INIT",
    "SLIDING_WINDOW",
    "TINY_SHAPE",
    "byte_tokenizer",
    "char_tokenizer",
    "inputs",
    "save_checkpoint",
    "tiny_checkpoint",
    "tiny_config",
    "tiny_model",
]
