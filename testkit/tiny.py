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


#: The tiny config builder of each family: ``builder(shape, sliding_window)``, where ``shape`` is
#: :data:`TINY_SHAPE` with the caller's overrides applied. One entry per family; the docstring of a
#: builder says which family-specific features its config switches on.
_BUILDERS: dict[str, Callable[[dict[str, Any], int], PretrainedConfig]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
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


__all__ = [
    "FAMILIES",
    "LARGE_INIT",
    "SLIDING_WINDOW",
    "TINY_SHAPE",
    "char_tokenizer",
    "save_checkpoint",
    "tiny_checkpoint",
    "tiny_config",
    "tiny_model",
]
