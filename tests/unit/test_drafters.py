"""Speculative decoding whatever windows the planner picks, and whatever a drafter does (issue #40).

Every drafter kind shoal wraps, driven through scripted window sequences with 0s (rounds that draft
nothing) between non-zero windows, and from a first round of 0, gives exactly plain greedy tokens;
no round fails; and every round's drafts are what the draft model drafts from the sequence itself,
computed afresh without a cache (a stale cache, left by skipped rounds or by transformers' crop in the
wrong tokens, gives other drafts). Kinds: a draft model of the target's tokenizer (the target with
2% noise on every block: it agrees often), one of another tokenizer (:func:`testkit.tiny.byte_tokenizer`,
which needs 1 to 3 tokens per character of :func:`testkit.tiny.char_tokenizer`'s texts) greedy
(universal assisted decoding) and sampling with ``top_k=1`` (universal speculative decoding, whose
tokens are greedy's then too), and prompt lookup.

A drafter that raises costs its rounds their drafts only: the tokens stay greedy's, the failure is
logged once, the drafter starts over in its next round, and a call stops asking it after
``MAX_DRAFT_FAILURES``.

The target runs on in-process spans (:class:`~shoal.client.local.LocalBlockSequence`); the
reference is the same tiny llama run locally in fp32.
"""

from __future__ import annotations

import copy
import itertools
import logging
from typing import Any

import pytest
import torch
from torch import Tensor
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from shoal.client.generation import speculation
from shoal.client.generation.drafters import DraftModelView, OtherTokenizerView, UniversalView
from shoal.client.generation.speculation import MAX_DRAFT_FAILURES, PlannedDrafts
from shoal.client.local import LocalBlockSequence
from shoal.client.model import DistributedModelForCausalLM
from shoal.models import get_family
from testkit.faulty import perturbed_copy
from testkit.tiny import byte_tokenizer, char_tokenizer, tiny_model
from tests.helpers.parity import greedy_with_gap

pytestmark = pytest.mark.timeout(240)

NEW_TOKENS = 48
MIN_GAP = 1e-3  # smallest top-2 logit gap of a greedy run compared exactly: far above fp32 noise (~1e-5)
#: Windows in turn, repeated until the generation ends.
SCRIPTS = {"3-0-0-5-0-1-8": [3, 0, 0, 5, 0, 1, 8], "plain-first": [0, 2, 0, 0, 0, 4, 1, 0, 8, 0]}
KINDS = ("same-tokenizer", "other-tokenizer", "other-tokenizer-sampling", "lookup")


@pytest.fixture(scope="module")
def reference():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def model(reference) -> DistributedModelForCausalLM:
    config, state = reference.config, reference.state_dict()
    head = get_family(config).build_client_head(config, state, torch.float32, "cpu")
    blocks = LocalBlockSequence.from_state_dict(config, state, boundaries=(2,), dtype=torch.float32)
    return DistributedModelForCausalLM(config, head, blocks)


@pytest.fixture(scope="module")
def prompt() -> Tensor:
    """12 ids, a repeated 4-gram among them (prompt lookup finds a match at once)."""
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    return torch.cat([ids, ids[:, :4]], dim=1)


@pytest.fixture(scope="module")
def expected(reference, prompt) -> Tensor:
    tokens, gap = greedy_with_gap(reference, prompt, max_new_tokens=NEW_TOKENS)
    assert gap > MIN_GAP, f"the reference's greedy run has a near-tie (top-2 gap {gap:.2e}): choose another prompt"
    return tokens


def other_draft():
    """A tiny llama of :func:`byte_tokenizer`'s 260 ids (a fresh one per use: universal speculative
    decoding prunes its LM head in place)."""
    return tiny_model("llama", seed=5, num_hidden_layers=2, vocab_size=260)


def drafting(kind: str, reference) -> tuple[dict[str, Any], Any]:
    """``generate`` arguments for ``kind``, and its draft model (None for prompt lookup)."""
    if kind == "same-tokenizer":
        draft = copy.deepcopy(reference)
        draft.model.layers = perturbed_copy(draft.model.layers, 0.02, seed=1)
        return {"assistant_model": draft, "do_sample": False}, draft
    if kind == "lookup":
        return {"prompt_lookup_num_tokens": 8, "do_sample": False}, None
    draft = other_draft()
    other = {"assistant_model": draft, "tokenizer": char_tokenizer(), "assistant_tokenizer": byte_tokenizer()}
    sampling = {"do_sample": True, "top_k": 1} if kind.endswith("sampling") else {"do_sample": False}
    return other | sampling, draft


def scripted(monkeypatch, windows: list[int]) -> None:
    """Every planner chooses ``windows`` in turn, over and over."""
    script = itertools.cycle(windows)
    monkeypatch.setattr(speculation.WindowPlanner, "choose", lambda self: next(script))


class Rounds:
    """Records every round that drafted: the window, the draft model's input ids and its whole
    sequence after the round (input and drafts, in its own tokens)."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[int, Tensor, Tensor]] = []
        self.view: DraftModelView | None = None
        original = PlannedDrafts._draft

        def draft(planned: PlannedDrafts, input_ids, window, kwargs):
            out = original(planned, input_ids, window, kwargs)
            view = planned.view
            if window > 0 and isinstance(view, DraftModelView) and out[0].shape[1] > input_ids.shape[1]:
                self.view = view
                self.seen.append((window, *self.draft_sequence(view, input_ids, out[0])))
            return out

        monkeypatch.setattr(PlannedDrafts, "_draft", draft)

    @staticmethod
    def draft_sequence(view: DraftModelView, input_ids: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
        """(the draft model's input, its sequence after the round) in its own ids, the input as
        transformers converts the whole text in a first round."""
        sequence = view.drafted_ids(candidates).clone()
        inner = view.inner
        if isinstance(view, UniversalView):
            text = inner.target_tokenizer.decode(input_ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
            return inner.assistant_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"], sequence
        if isinstance(view, OtherTokenizerView):
            pair = {"source_tokenizer": inner.target_tokenizer, "destination_tokenizer": inner.assistant_tokenizer}
            return inner.convert_source_tokens_to_target_tokens(input_ids, **pair), sequence
        return input_ids.clone(), sequence


def fresh_drafts(view: DraftModelView, draft, ids: Tensor, new: int) -> tuple[Tensor, float]:
    """The draft model's greedy run of ``new`` tokens from ``ids`` without a cache (with its LM head
    pruned to the shared vocabulary, its ids mapped back), and its smallest top-2 logit gap."""
    translator = getattr(view.inner, "_atm_translator", None)
    if translator is not None:
        translator.unmap_input_ids()  # the first forward takes the draft's own ids
    sequence, gap = greedy_with_gap(draft, ids, max_new_tokens=new, min_new_tokens=new)
    overlap = getattr(translator, "assistant_overlap_token_ids", None)
    if overlap is not None:
        sequence = torch.cat([ids, overlap[sequence[:, ids.shape[1] :]]], dim=1)
    return sequence, gap


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("script", SCRIPTS)
def test_any_window_sequence_gives_plain_greedy_tokens(model, reference, prompt, expected, kind, script, monkeypatch):
    """Scripted windows with 0s between them: greedy's tokens, the script's windows, no failure, and
    (draft models) each round's drafts equal the draft model's own greedy run from its input, uncached."""
    scripted(monkeypatch, SCRIPTS[script])
    rounds = Rounds(monkeypatch)
    kwargs, draft = drafting(kind, reference)
    got = model.generate(prompt, max_new_tokens=NEW_TOKENS, **kwargs)
    stats = model.last_speculation
    assert stats.failures == 0
    assert torch.equal(got, expected), f"first mismatch at {(got != expected).nonzero()[0].tolist()}"
    windows = [r.window for r in stats.rounds]
    cycle = itertools.cycle(SCRIPTS[script])
    want = [next(cycle) for _ in windows]
    if kind == "lookup":  # prompt lookup's window is capped by max_length near the end
        end = prompt.shape[1] + NEW_TOKENS - 1
        want = [min(w, end - n) for w, n in zip(want, _lengths(stats, prompt), strict=True)]
    assert windows == want
    assert stats.drafted > 0 and 0 in windows[1:]
    if draft is None:
        return
    assert len(rounds.seen) == sum(1 for r in stats.rounds if r.drafted > 0) > 3
    for window, ids, sequence in rounds.seen:
        new = sequence.shape[1] - ids.shape[1]
        assert torch.equal(sequence[:, : ids.shape[1]], ids), "the draft model's input is not the sequence so far"
        assert 0 < new <= window
        fresh, gap = fresh_drafts(rounds.view, draft, ids, new)
        assert gap > MIN_GAP, f"the draft's greedy run has a near-tie (top-2 gap {gap:.2e})"
        assert torch.equal(sequence, fresh), f"stale drafts at length {ids.shape[1]}: {sequence} != {fresh}"
    if kind == "same-tokenizer":
        assert 0 < stats.accepted < stats.drafted  # rejected drafts that a skipped round must not leave cached


def _lengths(stats, prompt: Tensor) -> list[int]:
    """The sequence's length before each round."""
    out, length = [], prompt.shape[1]
    for r in stats.rounds:
        out.append(length)
        length += r.accepted + 1
    return out


def failing_from(monkeypatch, fail: set[int]) -> list[int]:
    """Draft models raise in their drafting calls numbered in ``fail`` (from 0, counted per test);
    returns the list of call numbers made."""
    calls: list[int] = []
    original = AssistedCandidateGenerator.get_candidates

    def get_candidates(self, input_ids, **kwargs):
        calls.append(len(calls))
        if calls[-1] in fail:
            raise RuntimeError("a drafter that fails")
        return original(self, input_ids, **kwargs)

    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", get_candidates)
    return calls


def test_a_failing_round_decodes_plainly_and_logs_once(model, reference, prompt, expected, monkeypatch, caplog):
    """The draft model raises in its 2nd and 4th rounds: those rounds draft nothing, the tokens are
    greedy's, one warning is logged, and the rounds after a failure draft again (from nothing)."""
    scripted(monkeypatch, [3])
    calls = failing_from(monkeypatch, {1, 3})
    kwargs, _ = drafting("same-tokenizer", reference)
    with caplog.at_level(logging.WARNING, logger="shoal.client.generation.speculation"):
        got = model.generate(prompt, max_new_tokens=NEW_TOKENS, **kwargs)
    stats = model.last_speculation
    assert torch.equal(got, expected)
    assert stats.failures == 2
    assert [r.drafted for r in stats.rounds[:5]] == [3, 0, 3, 0, 3]
    assert len(calls) == len(stats.rounds)
    warnings = [r for r in caplog.records if r.name == "shoal.client.generation.speculation"]
    assert len(warnings) == 1 and "a drafter that fails" in warnings[0].getMessage()


def test_a_drafter_that_keeps_failing_is_dropped_for_the_call(model, reference, prompt, expected, monkeypatch, caplog):
    """A draft model that raises every time is asked ``MAX_DRAFT_FAILURES`` times, then the call
    decodes plainly to the end with greedy's tokens; the next call asks it again."""
    scripted(monkeypatch, [2])
    calls = failing_from(monkeypatch, set(range(1000)))
    kwargs, _ = drafting("same-tokenizer", reference)
    with caplog.at_level(logging.WARNING, logger="shoal.client.generation.speculation"):
        got = model.generate(prompt, max_new_tokens=NEW_TOKENS, **kwargs)
    stats = model.last_speculation
    assert torch.equal(got, expected)
    assert stats.failures == len(calls) == MAX_DRAFT_FAILURES
    assert stats.drafted == 0 and len(stats.rounds) == NEW_TOKENS
    assert len([r for r in caplog.records if r.name == "shoal.client.generation.speculation"]) == 1
    model.generate(prompt, max_new_tokens=4, **kwargs)
    assert model.last_speculation.failures > 0


@pytest.mark.parametrize("seed", [1, 9])
def test_sampled_drafts_weigh_their_own_tokens(model, reference, prompt, expected, seed, monkeypatch):
    """Universal speculative decoding with the draft's LM head pruned: every drafted token is the top
    of its own logits in target ids (transformers placed them by another order, and seeds 1 and 9 then
    crashed ``torch.multinomial`` on an all-zero residual); the tokens stay greedy's."""
    torch.manual_seed(seed)
    scripted(monkeypatch, SCRIPTS["plain-first"])
    drafted: list[tuple[Tensor, Tensor]] = []
    original = PlannedDrafts._draft

    def draft(planned: PlannedDrafts, input_ids, window, kwargs):
        candidates, logits, prefill = original(planned, input_ids, window, kwargs)
        if logits is not None:
            drafted.append((candidates[:, input_ids.shape[1] :], logits))
        return candidates, logits, prefill

    monkeypatch.setattr(PlannedDrafts, "_draft", draft)
    kwargs, _ = drafting("other-tokenizer-sampling", reference)
    got = model.generate(prompt, max_new_tokens=NEW_TOKENS, **kwargs)
    assert torch.equal(got, expected)
    assert len(drafted) > 3
    for ids, logits in drafted:
        assert torch.equal(logits.argmax(-1), ids)
