"""The benchmarks' models: ``smollm2`` (fetched) and random ones written once under
``$SHOAL_HOME/bench`` (``llama270m``: hidden 1024, 16 layers, 16 heads, intermediate 2816, 32k
vocab, untied, ~271M parameters), and each one's prompt."""

from __future__ import annotations

from pathlib import Path

import torch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Once upon a time,"
PROMPT_TOKENS_RANDOM = 24


def llama270m_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def ensure_random_model(name: str, make_config, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write a random-weight checkpoint once (sharded, one shard per block); return its directory."""
    from transformers import LlamaForCausalLM

    from shoal.checkpoints import save_sharded
    from shoal.checkpoints.fetch import shoal_home

    out = shoal_home() / "bench" / name
    marker = out / ".bench-complete"
    if marker.is_file():
        return out
    config = make_config()
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).eval()
    save_sharded(model, config, out, dtype=dtype)
    marker.write_text("ok\n")
    del model
    return out


def model_dir(name: str) -> Path:
    if name == "smollm2":
        from shoal.checkpoints import fetch_model

        return fetch_model("smollm2")
    if name == "llama270m":
        return ensure_random_model("llama270m", llama270m_config)
    raise SystemExit(f"unknown model {name!r}: choose smollm2, llama270m")


def prompt_ids(name: str, path: Path, vocab_size: int) -> torch.Tensor:
    if name == "smollm2":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))(PROMPT, return_tensors="pt").input_ids
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab_size, (1, PROMPT_TOKENS_RANDOM), generator=generator)
