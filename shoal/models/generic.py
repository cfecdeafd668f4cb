"""The generic path: a decoder-only model transformers knows, served without a family of its own.

A model fits when its causal LM is ``model.{embed_tokens, layers, norm, rotary_emb}`` plus a bias-free
``lm_head``, its layers take the standard call, and everything its forward does around the layers is
what :class:`~shoal.models.decoder.DecoderClientHead` does (with the :class:`HeadScalars` named by
config attributes in :data:`HEAD_SCALAR_ATTRIBUTES`).

Classes are read off a model that transformers itself builds (through its causal-LM auto mapping) from
a shrunk copy of the config (2 layers, hidden size 64, vocab 128): the built modules are what
``from_pretrained`` would build, where guessing class names from the modeling module would miss every
model that names its classes otherwise. The same small model, with random weights, then checks the
fit by behaviour: transformers' logits must equal those of shoal's spans (one per layer, without and
with the KV cache) and client head, stage by stage, so a refusal can say where the two part. The
check runs in milliseconds on the CPU, once per config per process; each refusal is an
:class:`UnfitModel` naming what does not fit.
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shoal.errors import ShoalError
from shoal.models.decoder import DecoderFamily, HeadScalars

__all__ = ["HEAD_SCALAR_ATTRIBUTES", "UNAPPLIED_ATTRIBUTES", "UnfitModel", "config_head_scalars", "generic_family"]

#: Config attributes of the client-side scalars shoal applies (transformers' models apply them outside
#: the layers), and the :class:`HeadScalars` field each becomes; an attribute the config lacks is off.
HEAD_SCALAR_ATTRIBUTES: dict[str, str] = {
    "embedding_multiplier": "embed_scale",  # embeddings *= it
    "logits_scaling": "logits_divisor",  # logits /= it
    "final_logit_softcapping": "logit_softcap",  # logits = cap * tanh(logits / cap)
}
#: Config attributes of client-side scalars shoal does not apply, with their neutral value; a config
#: that sets one otherwise is refused (the behavioural check catches the ones not listed).
UNAPPLIED_ATTRIBUTES: dict[str, tuple[Any, str]] = {
    "logit_scale": (1.0, "multiplies the logits"),
    "lm_head_multiplier": (1.0, "multiplies the logits"),
    "logits_mup_width_multiplier": (1.0, "divides the final hidden states"),
    "scale_emb": (1.0, "multiplies the embeddings"),
    "scale_embedding": (False, "scales the embeddings by sqrt(hidden_size)"),
}
_CONFIG_ATTRIBUTES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
)
_BASE_MODULES = ("embed_tokens", "layers", "norm", "rotary_emb")
_LAYER_KEYWORDS = ("attention_mask", "position_ids", "position_embeddings", "use_cache")
_CACHE_KEYWORDS = ("cache", "past_key_values")
_PROBE_LAYERS, _PROBE_HIDDEN, _PROBE_HEADS, _PROBE_HEAD_DIM, _PROBE_VOCAB = 2, 64, 4, 16, 128
_PROBE_WINDOW = 4  # shorter than the probe's 8 tokens, so a sliding window really slides
_PROBE_MAX_PARAMETERS = 8_000_000  # the common layout shrunk has ~0.1M; more: its sizes go by other names
_PROBE_INIT = 0.3  # weights ~N(0, 0.3): every op moves the logits far more than float noise
_PROBE_RTOL = 1e-4  # of the largest |value| (at least 1): fp32, chunked vs full passes


class UnfitModel(ShoalError, ValueError):
    """The model does not fit the generic path; the message says what does not fit."""


def config_head_scalars(config) -> HeadScalars:
    """The :class:`HeadScalars` named by ``config``'s attributes (see :data:`HEAD_SCALAR_ATTRIBUTES`)."""
    values = {field: getattr(config, name, None) for name, field in HEAD_SCALAR_ATTRIBUTES.items()}
    return HeadScalars(**{field: float(value) for field, value in values.items() if value is not None})


_checked: dict[tuple[type, str], DecoderFamily | str] = {}  # config -> its family, or why it does not fit
_checking = threading.Lock()  # one check at a time: each builds a model with torch's global RNG set aside


def generic_family(config) -> DecoderFamily:
    """The family of a model that fits the generic path, built from transformers' classes for
    ``config.model_type``; raises :class:`UnfitModel` otherwise. Checked once per distinct config."""
    from transformers import PreTrainedConfig

    if not isinstance(config, PreTrainedConfig):
        raise UnfitModel(f"the generic path needs a transformers config, not {type(config).__name__}")
    key = (type(config), config.to_json_string(use_diff=False))
    with _checking:
        if key not in _checked:
            try:
                _checked[key] = _check(config)
            except UnfitModel as unfit:
                _checked[key] = str(unfit)
        found = _checked[key]
    if isinstance(found, str):
        raise UnfitModel(found)
    return found


def _check(config) -> DecoderFamily:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "is_encoder_decoder", False):
        raise UnfitModel("it is an encoder-decoder model")
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnfitModel(f"transformers has no causal language model for model_type {config.model_type!r}")
    problems = _config_problems(config)
    try:
        small = _shrunk(config)
        with torch.device("meta"):  # no memory: the layout, before anything runs
            skeleton = _build(small)
    except Exception as exc:  # any failure to build says the model is not the common layout
        raise UnfitModel("; ".join([*problems, f"a shrunk copy of it does not build ({_brief(exc)})"])) from exc
    size = sum(p.numel() for p in skeleton.parameters())
    if size > _PROBE_MAX_PARAMETERS:
        problems.append(f"a copy shrunk to {_PROBE_LAYERS} layers of width {_PROBE_HIDDEN} still has {size:,} weights")
    else:
        problems += _layout_problems(skeleton)
    if problems:
        raise UnfitModel("; ".join(problems))
    base = skeleton.model
    family = DecoderFamily(
        (config.model_type,),
        layer_cls=type(base.layers[0]),
        rotary_cls=type(base.rotary_emb),
        norm_cls=type(base.norm),
        head_scalars=config_head_scalars,
        rotary_per_layer_type=_rotary_per_layer_type(type(base.rotary_emb), config),
    )
    _probe(family, small)
    return family


def _config_problems(config) -> list[str]:
    problems = []
    missing = [name for name in _CONFIG_ATTRIBUTES if _attribute(config, name) is None]
    if missing:
        problems.append(f"its config has no {', '.join(missing)}")
    if _attribute(config, "use_bidirectional_attention"):
        problems.append("its config asks for bidirectional attention, where shoal's spans mask causally")
    for name, (neutral, effect) in UNAPPLIED_ATTRIBUTES.items():
        value = _attribute(config, name, neutral)
        if value is not None and value != neutral:
            problems.append(f"its config sets {name}={value!r} ({effect}), a client-side scalar shoal does not apply")
    return problems


def _attribute(config, name: str, default: Any = None) -> Any:
    """``config.name``, or ``default`` where reading it fails in any way (some configs raise their
    own errors for attributes they keep per layer)."""
    try:
        return getattr(config, name, default)
    except Exception:
        return default


def _shrunk(config):
    """A copy of ``config`` small enough to build and run in milliseconds, keeping its kinds of
    attention (MHA, GQA or MQA; per-layer types; a sliding window) and all its scalars."""
    values = config.to_dict()
    kv_heads = values.get("num_key_value_heads")
    shape: dict[str, Any] = {
        "num_hidden_layers": _PROBE_LAYERS,
        "hidden_size": _PROBE_HIDDEN,
        "num_attention_heads": _PROBE_HEADS,
        "vocab_size": _PROBE_VOCAB,
    }
    if kv_heads is not None:
        shape["num_key_value_heads"] = _PROBE_HEADS if kv_heads == config.num_attention_heads else min(kv_heads, 2)
    for width in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if values.get(width) is not None:
            shape[width] = 2 * _PROBE_HIDDEN if width == "intermediate_size" else _PROBE_HIDDEN // 2
    if values.get("head_dim") is not None:
        shape["head_dim"] = _PROBE_HEAD_DIM
    if values.get("layer_types"):
        kinds = list(dict.fromkeys(values["layer_types"]))  # one layer of each of the first two kinds
        shape["layer_types"] = (kinds * _PROBE_LAYERS)[:_PROBE_LAYERS]
    if values.get("sliding_window"):
        shape["sliding_window"] = min(values["sliding_window"], _PROBE_WINDOW)
    for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the forward reads none of them,
        if values.get(special) is not None:  # but some configs insist they lie within the vocabulary
            shape[special] = _within_vocabulary(values[special])
    return type(config).from_dict({**values, **shape})


def _within_vocabulary(token_ids: int | list[int]) -> int | list[int]:
    if isinstance(token_ids, list):
        return [min(i, _PROBE_VOCAB - 1) for i in token_ids]
    return min(token_ids, _PROBE_VOCAB - 1)


def _build(config) -> nn.Module:
    """transformers' causal LM for (a copy of) ``config``, attention kernel included, in fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)


def _random_model(config) -> nn.Module:
    """:func:`_build` on the CPU with seeded random weights, leaving torch's global random state as it was."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        model = _build(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * _PROBE_INIT)
    return model.eval()


def _layout_problems(model: nn.Module) -> list[str]:
    top = dict(model.named_children())
    if set(top) != {"model", "lm_head"}:
        return [f"its modules are {' + '.join(sorted(top))}, not model + lm_head"]
    base = dict(model.model.named_children())
    if set(base) != set(_BASE_MODULES):
        extra, absent = sorted(set(base) - set(_BASE_MODULES)), sorted(set(_BASE_MODULES) - set(base))
        detail = ", ".join([*(f"extra model.{n}" for n in extra), *(f"no model.{n}" for n in absent)])
        return [f"its base model is not model.{{{', '.join(_BASE_MODULES)}}} ({detail})"]
    problems = []
    lm_head, embed, norm = model.lm_head, model.model.embed_tokens, model.model.norm
    if type(lm_head) is not nn.Linear or lm_head.bias is not None:
        problems.append(f"its lm_head is {_describe(lm_head)}, not a bias-free nn.Linear")
    if type(embed) is not nn.Embedding:
        problems.append(f"its embed_tokens is {type(embed).__name__}, not nn.Embedding (the client builds a plain one)")
    layer_classes = sorted({type(layer).__name__ for layer in model.model.layers})
    if len(layer_classes) > 1:
        problems.append(f"its layers are of several classes ({', '.join(layer_classes)})")
    problems += _layer_problems(type(model.model.layers[0]), model.config)
    problems += _rotary_problems(type(model.model.rotary_emb), model.config)
    problems += _norm_problems(norm, model.config)
    stray = [n for n in model.state_dict() if not n.startswith(("model.layers.", "model.embed_tokens.", "lm_head."))]
    stray = [n for n in stray if n != "model.norm.weight"]
    if stray:
        problems.append(f"it has tensors outside the layers, embeddings, final norm weight and lm_head: {stray[:4]}")
    conversions = _checkpoint_conversions(model)
    if conversions:
        problems.append(f"transformers converts its checkpoint tensors when loading ({conversions}), shoal does not")
    return problems


def _checkpoint_conversions(model: nn.Module) -> str:
    """The tensor conversions transformers applies to this model's checkpoints at load time (it fuses
    per-expert tensors of MoE models, for one), which the generic path's tensor names skip."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return ", ".join(sorted({type(t).__name__ for t in get_model_conversion_mapping(model, add_legacy=False)}))


def _layer_problems(layer_cls: type, config) -> list[str]:
    name = layer_cls.__name__
    if not _binds(layer_cls, config, 0):
        return [f"its layer {name} is not built as {name}(config, layer_idx)"]
    params = inspect.signature(layer_cls.forward).parameters
    names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)][1:]
    problems = []
    if not names or names[0] != "hidden_states":
        problems.append(f"{name}.forward does not take hidden_states first")
    missing = [kw for kw in _LAYER_KEYWORDS if kw not in params]
    if not any(kw in params for kw in _CACHE_KEYWORDS):
        missing.append("cache")
    if missing:
        problems.append(f"{name}.forward takes no {', '.join(missing)} (not the standard layer call)")
    known = {"hidden_states", *_LAYER_KEYWORDS, *_CACHE_KEYWORDS}
    required = [n for n in names if n not in known and params[n].default is inspect.Parameter.empty]
    if required:
        problems.append(f"{name}.forward requires {', '.join(required)} (not the standard layer call)")
    return problems


def _rotary_problems(rotary_cls: type, config) -> list[str]:
    name = rotary_cls.__name__
    if not _binds(rotary_cls, config=config):
        return [f"its rotary embedding {name} is not built as {name}(config=config)"]
    positions_only = _binds(rotary_cls.forward, None, torch.zeros(1), torch.zeros(1, 1))
    if not positions_only and not _rotary_per_layer_type(rotary_cls, config):
        return [f"{name}.forward is not called as (hidden, position_ids) or (hidden, position_ids, layer_type)"]
    return []


def _rotary_per_layer_type(rotary_cls: type, config) -> bool:
    """Whether the model keeps one rotary per entry of ``config.layer_types``, called with it."""
    if not getattr(config, "layer_types", None):
        return False
    positions_only = _binds(rotary_cls.forward, None, torch.zeros(1), torch.zeros(1, 1))
    return not positions_only and _binds(rotary_cls.forward, None, torch.zeros(1), torch.zeros(1, 1), "layer_type")


def _norm_problems(norm: nn.Module, config) -> list[str]:
    """The client builds the final norm as ``norm_cls(hidden_size, eps=rms_norm_eps)`` and gives it
    ``weight`` only: the model's norm must be that, down to its plain attributes (its epsilon)."""
    name = type(norm).__name__
    if getattr(config, "rms_norm_eps", None) is None:
        return []  # named among the config's missing attributes
    if set(norm.state_dict()) != {"weight"}:
        return [f"its final norm {name} has tensors {sorted(norm.state_dict())}, not weight alone"]
    try:
        rebuilt = type(norm)(config.hidden_size, eps=config.rms_norm_eps)
    except Exception as exc:
        return [f"its final norm {name} is not built as {name}(hidden_size, eps=rms_norm_eps) ({_brief(exc)})"]
    if _plain_attributes(rebuilt) != _plain_attributes(norm):
        return [f"its final norm {name} is built otherwise than {name}(hidden_size, eps=rms_norm_eps)"]
    return []


def _probe(family: DecoderFamily, config) -> None:
    """Run the shrunk model and shoal's spans and head, built from its ``config`` as a server and a
    client would, on the same weights and inputs; refuse where their values part."""
    ids, mask, positions = _probe_inputs(config.vocab_size)
    seen: dict[str, torch.Tensor] = {}
    try:
        model = _random_model(config)
        hooks = [
            model.model.layers[0].register_forward_pre_hook(_recorder(seen, "embeddings"), with_kwargs=True),
            model.model.norm.register_forward_pre_hook(_recorder(seen, "hidden"), with_kwargs=True),
        ]
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for hook in hooks:
            hook.remove()
    except Exception as exc:  # transformers' own model fails on the shrunk config
        raise UnfitModel(f"a shrunk copy of it does not run in transformers ({_brief(exc)})") from exc
    state = model.state_dict()
    if not torch.isfinite(expected).all():
        raise UnfitModel("its shrunk copy gives non-finite logits on random weights, so the fit cannot be checked")
    valid = mask.bool()  # compared positions (pads aside); also the spans' attention mask
    try:
        spans = [family.build_span(config, i, i + 1, state, torch.float32, "cpu") for i in range(_PROBE_LAYERS)]
        head = family.build_client_head(config, state, torch.float32, "cpu")
        embeddings = head.embed(ids)
        hidden = embeddings
        for span in spans:
            hidden = span(hidden, positions, valid)
        logits = head.logits(hidden)
        cached = _cached_logits(spans, head, ids, positions, valid)
    except Exception as exc:  # the layers do not run as shoal calls them
        raise UnfitModel(f"its layers fail when run as shoal spans ({_brief(exc)})") from exc
    stages = [
        ("embeddings", embeddings, seen["embeddings"], "the model changes the embeddings in a way shoal does not"),
        ("hidden", hidden, seen["hidden"], "the model does something around its layers that shoal does not"),
        ("logits", logits, expected, "the model changes the logits in a way shoal does not"),
        ("cached", cached, expected, "its layers use the KV cache in a way shoal's span cache does not"),
    ]
    for what, got, want, cause in stages:
        err, scale = (got[valid] - want[valid]).abs().max().item(), max(1.0, want[valid].abs().max().item())
        if not err <= _PROBE_RTOL * scale:
            raise UnfitModel(f"{cause}: on a shrunk copy with random weights, shoal's {what} differ by {err:.3g}")


def _probe_inputs(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2 rows of 8 random tokens, the first left-padded by 3, and their positions."""
    ids = torch.randint(0, vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def _cached_logits(spans, head, ids, positions, mask) -> torch.Tensor:
    """The logits of ``ids`` computed in two chunks (5 tokens, then 3) through each span's KV cache."""
    caches = [span.allocate_cache(ids.shape[0], ids.shape[1]) for span in spans]
    chunks = []
    for start, end in ((0, 5), (5, ids.shape[1])):
        hidden = head.embed(ids[:, start:end])
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, positions[:, start:end], mask[:, :end], cache, start)
        chunks.append(head.logits(hidden))
    return torch.cat(chunks, dim=1)


def _recorder(seen: dict[str, torch.Tensor], key: str) -> Callable:
    def record(module, args, kwargs):
        seen[key] = args[0] if args else kwargs["hidden_states"]

    return record


def _binds(fn: Callable, *args: Any, **kwargs: Any) -> bool:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    plain = {k: v for k, v in vars(module).items() if isinstance(v, int | float | str) and not k.startswith("_")}
    plain.pop("training", None)
    return plain


def _describe(module: nn.Module) -> str:
    bias = getattr(module, "bias", None)
    return f"{type(module).__name__}{' with a bias' if isinstance(bias, torch.Tensor) else ''}"


def _brief(exc: BaseException) -> str:
    """The exception's type and first line: refusals stay one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
