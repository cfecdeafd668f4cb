"""The generic path (:mod:`shoal.models.generic`): model types without an adapter whose transformers model
has the common layout are served from transformers' own classes, with their client-side scalars; the
others are refused with an error naming what does not fit.

The families proven here are testkit's :data:`~testkit.tiny.GENERIC_FAMILIES` (``olmo2`` and ``granite``
also run through real swarms in ``tests/integration/test_swarm_generation.py``); no shoal file names them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
)

import shoal
from shoal.cli.failures import USAGE, explain
from shoal.errors import UsageError
from shoal.models import UnsupportedModelError, get_family, supported_model_types
from shoal.models.decoder import DecoderFamily, HeadScalars
from shoal.models.generic import generic_family
from testkit.tiny import GENERIC_FAMILIES, TINY_SHAPE, tiny_config, tiny_model

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

USUAL_INIT = 0.02  # transformers' own init: logits ~0.1, so an absolute 1e-4 is a tight check
ATOL = 1e-4


def test_generic_families_have_no_adapter_and_no_mention_in_shoal():
    """They reach the generic path: not in the adapter registry, and named by no file in the package."""
    assert not set(GENERIC_FAMILIES) & set(supported_model_types())
    word = re.compile(rf"\b({'|'.join(GENERIC_FAMILIES)})\b", re.IGNORECASE)
    sources = sorted(Path(shoal.__file__).parent.rglob("*.py"))
    named = [f"{path.name}: {m.group(0)}" for path in sources for m in word.finditer(path.read_text())]
    assert sources and not named


@pytest.mark.parametrize("name", GENERIC_FAMILIES)
def test_classes_resolve_from_transformers(name):
    """The family wraps the very classes transformers builds for the model type."""
    config = tiny_config(name)
    family = get_family(config)
    assert isinstance(family, DecoderFamily) and family.model_types == (config.model_type,)
    assert get_family(config) is family  # checked once per config
    base = AutoModelForCausalLM.from_config(config).model
    assert family.layer_cls is type(base.layers[0])
    assert family.rotary_cls is type(base.rotary_emb)
    assert family.norm_cls is type(base.norm)
    assert family.rotary_per_layer_type == (name == "olmo3")  # its rotary takes the layer type


@pytest.mark.parametrize("name", GENERIC_FAMILIES)
def test_spans_and_head_equal_transformers(name):
    """Spans [0:1] [1:3] [3:4] with their caches (a 6-token prefill, then 4 single steps) and the client
    head give transformers' logits on a left-padded batch, within 1e-4 (fp32)."""
    model = tiny_model(name, seed=3, initializer_range=USUAL_INIT, sliding_window=6)  # olmo3's window slides
    config, state = model.config, model.state_dict()
    family = get_family(config)
    spans = [family.build_span(config, a, b, state, torch.float32, "cpu") for a, b in ((0, 1), (1, 3), (3, 4))]
    head = family.build_client_head(config, state, torch.float32, "cpu")
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
    caches = [span.allocate_cache(2, 10) for span in spans]
    chunks = []
    for start, end in ((0, 6), (6, 7), (7, 8), (8, 9), (9, 10)):
        hidden = head.embed(ids[:, start:end])
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, positions[:, start:end], mask[:, :end].bool(), cache, start)
        chunks.append(head.logits(hidden))
    got = torch.cat(chunks, dim=1)
    valid = mask.bool()
    assert (got[valid] - expected[valid]).abs().max().item() <= ATOL


def test_config_scalars_reach_the_client_head():
    """A config's ``embedding_multiplier`` and ``logits_scaling`` become the head's scalars; a config
    without them gets none."""
    config = tiny_config("granite")
    assert (config.embedding_multiplier, config.logits_scaling) == (3.0, 2.0)
    assert (config.residual_multiplier, config.attention_multiplier) == (0.5, 0.1)  # in the layers
    head = get_family(config).build_client_head(config, tiny_model("granite").state_dict(), torch.float32, "cpu")
    assert head.scalars == HeadScalars(embed_scale=3.0, logits_divisor=2.0)
    assert get_family(tiny_config("olmo2")).head_scalars(tiny_config("olmo2")) == HeadScalars()


# --- refusals -------------------------------------------------------------------------------------


class _EmbeddingScaledModel(LlamaModel):
    """Scales the embeddings in its forward: a client-side op no config attribute names."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * 2.0
        return super().forward(inputs_embeds=inputs_embeds, **kwargs)


class _EmbeddingScaledConfig(LlamaConfig):
    model_type = "shoal_test_embedding_scaled"


class _EmbeddingScaledForCausalLM(LlamaForCausalLM):
    config_class = _EmbeddingScaledConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = _EmbeddingScaledModel(config)


class _LogitScaledConfig(LlamaConfig):
    model_type = "shoal_test_logit_scaled"


class _LogitScaledForCausalLM(LlamaForCausalLM):
    """Multiplies the logits in its forward, as no config attribute says."""

    config_class = _LogitScaledConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out


for _config_cls, _model_cls in (
    (_EmbeddingScaledConfig, _EmbeddingScaledForCausalLM),
    (_LogitScaledConfig, _LogitScaledForCausalLM),
):  # registered with transformers as any custom model is: the generic path finds them by model_type
    AutoConfig.register(_config_cls.model_type, _config_cls, exist_ok=True)
    AutoModelForCausalLM.register(_config_cls, _model_cls, exist_ok=True)

SMALL = {k: TINY_SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")}
REFUSALS = [
    pytest.param(
        lambda: AutoConfig.for_model("gpt2"),
        ["its config has no num_key_value_heads, rms_norm_eps", "its modules are lm_head + transformer, not model"],
        id="gpt2-layout",
    ),
    pytest.param(
        lambda: AutoConfig.for_model("bloom"),
        ["its modules are lm_head + transformer, not model + lm_head"],
        id="bloom-layout",
    ),
    pytest.param(
        lambda: AutoConfig.for_model("cohere"),
        ["its config sets logit_scale=0.0625 (multiplies the logits), a client-side scalar shoal does not apply"],
        id="cohere-logit-scale",
    ),
    pytest.param(
        lambda: AutoConfig.for_model("gemma2"),
        [
            "its embed_tokens is Gemma2TextScaledWordEmbedding, not nn.Embedding",
            "Gemma2DecoderLayer.forward takes no use_cache (not the standard layer call)",
        ],
        id="gemma2-scaled-embedding-and-layer-call",
    ),
    pytest.param(
        lambda: AutoConfig.for_model("stablelm"),
        ["its config has no rms_norm_eps", "tensors outside the layers, embeddings, final norm weight and lm_head"],
        id="stablelm-layernorm",
    ),
    pytest.param(
        lambda: AutoConfig.for_model("qwen2_moe"),
        ["transformers converts its checkpoint tensors when loading (WeightConverter), shoal does not"],
        id="qwen2_moe-checkpoint-conversion",
    ),
    pytest.param(
        lambda: AutoConfig.for_model("vit"),
        ["transformers has no causal language model for model_type 'vit'"],
        id="vit-no-causal-lm",
    ),
    pytest.param(
        lambda: _EmbeddingScaledConfig(num_hidden_layers=2, **SMALL),
        ["the model changes the embeddings in a way shoal does not: on a shrunk copy with random weights, shoal's"],
        id="probe-embeddings",
    ),
    pytest.param(
        lambda: _LogitScaledConfig(num_hidden_layers=2, **SMALL),
        ["the model changes the logits in a way shoal does not: on a shrunk copy with random weights, shoal's"],
        id="probe-logits",
    ),
    pytest.param(
        lambda: type("Config", (), {"model_type": "gpt2"})(),
        ["the generic path needs a transformers config, not Config"],
        id="not-a-transformers-config",
    ),
]


@pytest.mark.parametrize(("make_config", "reasons"), REFUSALS)
def test_refusal_names_what_does_not_fit(make_config, reasons):
    """One line: the model type, the adapters there are, and every reason the generic path found; the
    CLI reports it as a usage error (exit status 2) with that text."""
    config = make_config()
    with pytest.raises(UnsupportedModelError) as info:
        get_family(config)
    message = str(info.value)
    assert isinstance(info.value, UsageError) and isinstance(info.value, ValueError)
    assert message.startswith(
        f"unsupported model_type {config.model_type!r}: no family adapter "
        f"(supported: {', '.join(supported_model_types())}) and the generic path does not fit: "
    )
    for reason in reasons:
        assert reason in message
    assert "\n" not in message
    assert explain(info.value).status == USAGE and explain(info.value).message == message


def test_refusal_is_remembered_per_config():
    """A refused config is checked once: asking again gives the same reason without building anything."""
    config = _LogitScaledConfig(num_hidden_layers=2, **SMALL)
    with pytest.raises(ValueError, match="changes the logits") as first:
        generic_family(config)
    with pytest.raises(ValueError, match="changes the logits") as again:
        generic_family(config)
    assert str(first.value) == str(again.value)


def test_the_check_leaves_torch_random_state_alone():
    """The check builds a random model; the caller's seeded stream is the same as without it."""
    torch.manual_seed(5)
    generic_family(tiny_config("helium", num_hidden_layers=3))  # a config not checked before
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))
