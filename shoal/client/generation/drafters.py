"""Keeps each of transformers' drafters in step with the sequence, whatever rounds it sat out.

A draft model keeps a KV cache (and, with another tokenizer, its own token ids of the text so far)
between rounds, and transformers updates both assuming the drafter ran in the previous round: it
crops by what it last drafted. Shoal's planner skips rounds (window 0) and a failed round is skipped
too, so before every round a :class:`DraftView` lines the drafter up with the sequence itself:

- it computes the ids the draft model should hold (the target's ids with the same tokenizer; the
  text re-encoded with the draft's tokenizer otherwise, as transformers does in a first round),
- crops the draft's cache to the longest prefix it holds of those ids (what it holds is recorded
  after each round), and
- resets transformers' incremental state, so the round runs as a first round over a warm cache.

Transformers 5.18 to 5.25 compute the draft's crop from ``_last_ids_length``, which
:class:`~transformers.generation.candidate_generator.AssistedCandidateGeneratorDifferentTokenizers`
sets in target tokens and compares with draft tokens: a draft tokenizer that needs more tokens for
the same text is never cropped, its cache fills with stale positions until it holds more than the
input, and the draft model's forward gets 0 tokens (issue #40). The view's own crop replaces it.

With the draft's LM head pruned (universal speculative decoding), transformers 5.17 to 5.25 place
the pruned logits at the target ids taken in the draft's id order, while the pruned head's columns
follow the order of the draft tokenizer's vocabulary dict: the drafts' probabilities land on other
tokens, speculative sampling's acceptance test reads the wrong ones (a sampling run loses its
distribution) and, where the target's and the misplaced draft's top tokens meet, its residual is
all zeros and ``torch.multinomial`` fails. :class:`UniversalView` maps each column to its own token.

Prompt lookup keeps no state: its view does nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.generation.candidate_generator import (
    AssistedCandidateGenerator,
    AssistedCandidateGeneratorDifferentTokenizers,
    CandidateGenerator,
    UniversalSpeculativeDecodingGenerator,
)

from shoal.client.generation.cache import common_prefix

__all__ = ["DraftModelView", "DraftView", "OtherTokenizerView", "UniversalView", "view_of"]

#: The names transformers gives the draft's cache in ``assistant_kwargs`` (``cache`` from 5.24 on).
CACHE_KEYS = ("cache", "past_key_values")
#: Inputs sized to the sequence at the draft's last run: ``generate`` makes them afresh when absent.
SIZED_KEYS = ("attention_mask", "position_ids", "token_type_ids")


class DraftView:
    """A drafter without state between rounds (prompt lookup): nothing to line up."""

    def before(self, input_ids: Tensor) -> bool:
        """Line the drafter up with ``input_ids`` (the whole sequence); True if it starts from nothing
        (its round includes a prefill)."""
        return False

    def after(self, input_ids: Tensor, candidates: Tensor) -> None:
        """Record what the drafter holds after a round that ran."""

    def reset(self) -> None:
        """Forget everything (after a failed round: its cache may be half written)."""


class DraftModelView(DraftView):
    """A draft model of the target's tokenizer: its cache holds ``held``, ids of the sequence."""

    def __init__(self, inner: AssistedCandidateGenerator):
        self.inner = inner
        self.held: Tensor | None = None  # [1, cached]: the draft ids at the positions its cache holds

    def _cache(self):
        kwargs = self.inner.assistant_kwargs
        return next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)

    def draft_ids(self, input_ids: Tensor) -> Tensor:
        """The ids the draft model should have consumed: here the target's own."""
        return input_ids

    def before(self, input_ids: Tensor) -> bool:
        ids = self.draft_ids(input_ids)
        cache = self._cache()
        if cache is None or self.held is None:
            self.reset()  # a first run: generate builds the cache, mask and positions for the whole sequence
            return True
        cached = cache.get_seq_length()
        keep = min(common_prefix(self.held[:, :cached], ids), ids.shape[1] - 1)  # at least one id to feed
        if keep < cached:
            cache.crop(keep - cached)  # a negative count: remove that many positions (every version)
        self.held = self.held[:, :keep]
        if hasattr(self.inner, "_last_ids_length"):  # 5.18+: crop by what was last drafted; the crop above stands
            self.inner._last_ids_length = 0
        return keep == 0

    def drafted_ids(self, candidates: Tensor) -> Tensor | None:
        """The draft-token sequence of the round that just ran (its input and its drafts; the input
        alone if the draft model did not run), None if there was none."""
        return candidates

    def after(self, input_ids: Tensor, candidates: Tensor) -> None:
        drafted = self.drafted_ids(candidates)
        if drafted is None:
            return  # the draft model did not run: it holds what ``before`` left
        cache = self._cache()
        cached = cache.get_seq_length() if cache is not None else 0
        self.held = drafted[:, :cached].clone() if cache is not None and drafted.shape[1] >= cached else None

    def reset(self) -> None:
        for key in (*CACHE_KEYS, *SIZED_KEYS):
            self.inner.assistant_kwargs.pop(key, None)
        self.held = None


class OtherTokenizerView(DraftModelView):
    """A draft model of another tokenizer, greedy (transformers' universal assisted decoding): every
    round re-encodes the whole text, as transformers' first round does."""

    inner: AssistedCandidateGeneratorDifferentTokenizers

    def draft_ids(self, input_ids: Tensor) -> Tensor:
        inner = self.inner
        inner.prev_assistant_ids, inner.prev_target_ids_len = None, None  # the first-round path: all of the text
        return inner.convert_source_tokens_to_target_tokens(
            input_ids, source_tokenizer=inner.target_tokenizer, destination_tokenizer=inner.assistant_tokenizer
        )

    def drafted_ids(self, candidates: Tensor) -> Tensor | None:
        return self.inner.prev_assistant_ids  # the draft's sequence: its input and its drafts

    def reset(self) -> None:
        super().reset()
        self.inner.prev_assistant_ids, self.inner.prev_target_ids_len = None, None


class UniversalView(DraftModelView):
    """A draft model of another tokenizer, sampling (transformers' universal speculative decoding):
    drafts only tokens both vocabularies share; with the draft's LM head pruned to those, its drafts
    come out as indices into the shared list (mapped back here to the draft's ids)."""

    inner: UniversalSpeculativeDecodingGenerator

    def __init__(self, inner: UniversalSpeculativeDecodingGenerator):
        super().__init__(inner)
        _place_pruned_logits_by_column(inner._atm_translator)

    def draft_ids(self, input_ids: Tensor) -> Tensor:
        inner = self.inner
        inner._prev_assistant_ids, inner._target_seq_len_with_candidates = None, 0  # the first-round path
        text = inner.target_tokenizer.decode(input_ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
        ids = inner.assistant_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        self._input_length = ids.shape[1]
        return ids

    def drafted_ids(self, candidates: Tensor) -> Tensor | None:
        sequence = self.inner._prev_assistant_ids
        translator = self.inner._atm_translator
        if sequence is None or not getattr(translator, "assistant_prune_lm_head", False):
            return sequence
        overlap = getattr(translator, "assistant_overlap_token_ids", None)
        if overlap is None:  # nothing was pruned: the draft's ids are its own
            return sequence
        n = self._input_length
        return torch.cat([sequence[:, :n], overlap[sequence[:, n:]].to(sequence.dtype)], dim=1)

    def reset(self) -> None:
        super().reset()
        self.inner._prev_assistant_ids, self.inner._target_seq_len_with_candidates = None, 0


def _place_pruned_logits_by_column(translator) -> None:
    """Make ``translator`` put the pruned head's column ``j`` at the target id of the draft token
    ``assistant_overlap_token_ids[j]`` (the token the drafts' ids map to), whatever transformers does."""
    overlap = getattr(translator, "assistant_overlap_token_ids", None)
    if overlap is None or not getattr(translator, "assistant_prune_lm_head", False):
        return  # nothing was pruned: the logits keep the draft's own columns, which transformers maps right
    target_ids = translator._assistant_to_target_input_ids.to(overlap.device)[overlap]
    filler, vocab_size = translator.FILTER_VALUE, translator.target_vocab_size

    def get_target_logits(assistant_logits: Tensor) -> Tensor:
        shape = (*assistant_logits.shape[:-1], vocab_size)
        target = assistant_logits.new_full(shape, filler)
        target[..., target_ids.to(target.device)] = assistant_logits
        return target

    translator.get_target_logits = get_target_logits


def view_of(inner: CandidateGenerator) -> DraftView:
    """The view that keeps ``inner`` in step (the most specific of transformers' classes first)."""
    if isinstance(inner, UniversalSpeculativeDecodingGenerator):
        return UniversalView(inner)
    if isinstance(inner, AssistedCandidateGeneratorDifferentTokenizers):
        return OtherTokenizerView(inner)
    if isinstance(inner, AssistedCandidateGenerator):
        return DraftModelView(inner)
    return DraftView()
