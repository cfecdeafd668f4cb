"""The local reference for training through shoal: a plain ``transformers`` causal LM with the same
prompts placed as :mod:`shoal.client.training.prompts` places them (ptune: before the input embeddings, the
mask extended with ones; deep_ptune: each decoder layer's input gets its block's prompt added at
sequence positions ``[0, N)``, through forward pre-hooks), and the gradient tolerance of issue 20."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import PreTrainedModel

from shoal.client.training.prompts import PromptTuning
from shoal.models.base import add_deep_prompt


def grad_close(got: Tensor, want: Tensor) -> tuple[bool, float]:
    """max|got - want| <= 1e-4 * max|want| + 1e-7 (fp32 autograd through different code paths)."""
    diff = float((got - want).abs().max())
    return diff <= 1e-4 * float(want.abs().max()) + 1e-7, diff


def assert_grads_close(got: Tensor | None, want: Tensor | None, what: str) -> None:
    assert got is not None and want is not None, f"{what}: no gradient (got {got is not None}, want {want is not None})"
    assert got.shape == want.shape, f"{what}: gradient shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert float(want.abs().max()) > 0, f"{what}: the reference gradient is zero (a vacuous check)"
    ok, diff = grad_close(got, want)
    assert ok, f"{what}: max|diff| {diff:.3g} > 1e-4 * {float(want.abs().max()):.3g} + 1e-7"


@contextmanager
def deep_prompt_hooks(reference: PreTrainedModel, deep: Tensor | None) -> Iterator[None]:
    """While active, decoder layer ``i`` of ``reference`` adds ``deep[i]`` (``[1 or B, N, H]``) to
    its input at positions ``[0, N)`` (its cache's length says where a call's positions start)."""
    if deep is None:
        yield
        return

    def hook_for(index: int):
        def hook(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            past = cache.get_seq_length(index) if cache is not None else 0
            if args:
                return (add_deep_prompt(args[0], deep[index], past), *args[1:]), kwargs
            kwargs["hidden_states"] = add_deep_prompt(kwargs["hidden_states"], deep[index], past)
            return args, kwargs

        return hook

    handles = [
        layer.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(reference.model.layers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def prompted_inputs(
    reference: PreTrainedModel, embeds: Tensor, mask: Tensor | None, prompts: PromptTuning | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(inputs_embeds, attention_mask, position_ids) of ``reference`` for ``embeds`` behind the
    ptune prompts: positions count the attended positions of the extended mask."""
    batch, n = embeds.shape[:2]
    mask = torch.ones(batch, n, dtype=torch.long) if mask is None else mask.long()
    if prompts is not None:
        embeds = torch.cat([prompts.input_prompts(batch, embeds.dtype), embeds], dim=1)
        mask = torch.cat([torch.ones(batch, prompts.pre_seq_len, dtype=torch.long), mask], dim=1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return embeds, mask, positions


def reference_logits(
    reference: PreTrainedModel, embeds: Tensor, mask: Tensor | None = None, prompts: PromptTuning | None = None
) -> Tensor:
    """The logits of ``reference`` at the token positions (the prompts' dropped), differentiable."""
    inputs, full_mask, positions = prompted_inputs(reference, embeds, mask, prompts)
    deep = prompts.deep_prompts() if prompts is not None else None
    with deep_prompt_hooks(reference, deep):
        logits = reference(inputs_embeds=inputs, attention_mask=full_mask, position_ids=positions).logits
    return logits[:, inputs.shape[1] - embeds.shape[1] :].contiguous()


@torch.no_grad()
def reference_generate(
    reference: PreTrainedModel, input_ids: Tensor, prompts: PromptTuning | None, max_new_tokens: int
) -> Tensor:
    """Greedy tokens of ``reference`` after ``input_ids`` behind the prompts (new tokens only)."""
    embeds = reference.get_input_embeddings()(input_ids)
    inputs, mask, _ = prompted_inputs(reference, embeds, None, prompts)
    deep = prompts.deep_prompts() if prompts is not None else None
    with deep_prompt_hooks(reference, deep):
        return reference.generate(
            inputs_embeds=inputs, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False
        )


__all__ = ["assert_grads_close", "deep_prompt_hooks", "grad_close", "prompted_inputs", "reference_generate",
           "reference_logits"]  # fmt: skip
