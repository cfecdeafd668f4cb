"""``generate`` that survives a lie: when an audit (:mod:`shoal.client.verification.audit`) proves a server wrong, the
session has been rolled back to the first wrong position ``p`` and the liar replaced; generation goes
on from there, as if the lie had never been told.

The token at ``p`` was chosen from the logits at ``p - 1``, which were honest; the logits from ``p``
on were not. So the consumed ids ``[0, p]`` stand (or the prompt, when ``p`` lies inside it), and
transformers' ``generate`` is called again from them, with the same generation config, the same
session (it holds ``[0, p)`` and takes only what follows) and the remaining budget: lengths count
from the ORIGINAL prompt. Repeated until an attempt ends with every position audited (at most
:data:`MAX_REPAIRS` repairs). Greedy answers then equal an honest run; sampled ones do when the
sampler seeds each draw by position (:class:`~shoal.client.generation.sampling.PositionSeededSampler`), since
transformers' own sampling draws from the global generator.

Streaming: ``generate(..., streamer=s, hold_back=True)`` gives ``s`` each token only once every hop
is audited past it (a hop nobody can check aside: no replica of its span exists), so it never sees a
token the answer replaces, nor one past a dispute no third replica settled (the session rolls back
there, or fails with :class:`~shoal.client.verification.audit.UnsettledDispute`, and ``s`` is left
with the clean tokens before it, without ``end()``); the lag is up to ``audit_every``
tokens (plus a step's window with speculation), and the last ones come when the final audit passes.
In redundant mode every step is checked before the next one, so a token comes one step late.
Without ``hold_back``, ``s`` gets tokens as they are generated: after a repair it has seen the tokens
from the first wrong (or disputed) position to where it was caught (up to ``audit_every`` of them), then gets
the regenerated tokens from that position on, after them (a streamer cannot take tokens back). It is
told ``end()`` once. With ``return_dict_in_generate``, scores and logits cover the last attempt only.

The model hands each attempt's :class:`GenerationContext` (its session's cache, generation config and
prompt mask) to this loop through its :class:`GenerationSlot`, one per model and thread, filled when
transformers prepares the cache; the session answers audits as an
:class:`~shoal.client.blocks.AuditedSession`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import GenerationConfig

from shoal.client.blocks import AuditedSession
from shoal.client.verification.audit import LieDetected
from shoal.errors import ShoalError, UsageError

if TYPE_CHECKING:
    from shoal.client.generation.cache import SessionCache
    from shoal.client.model import DistributedModelForCausalLM

log = logging.getLogger(__name__)

MAX_REPAIRS = 8

__all__ = ["MAX_REPAIRS", "GenerationContext", "GenerationSlot", "HeldStreamer", "generate_repaired", "resume_length"]


@dataclass(frozen=True)
class GenerationContext:
    """One ``generate`` attempt as the model prepared it, what a repair resumes from: the session's
    ``cache``, the ``generation_config`` transformers resolved (its lengths) and the
    ``attention_mask`` it made of the prompt (None where it made none)."""

    cache: SessionCache
    generation_config: GenerationConfig
    attention_mask: Tensor | None


class GenerationSlot:
    """Where a model hands :func:`generate_repaired` the :class:`GenerationContext` of its attempt
    under way: one context per thread, since threads sharing a model (a gateway's) each generate in
    their own session. Emptied before each attempt, filled when transformers prepares the cache."""

    def __init__(self) -> None:
        self._per_thread = threading.local()

    @property
    def context(self) -> GenerationContext | None:
        """This thread's attempt under way (None before the model prepared its cache)."""
        return getattr(self._per_thread, "context", None)

    def hand_over(self, context: GenerationContext | None) -> None:
        self._per_thread.context = context


def resume_length(lie_position: int, prefix: int, prompt_length: int) -> int:
    """How many token ids a repaired generation resumes from after a lie at session position
    ``lie_position`` (``prefix``: trained prompt positions before the tokens): those at ``[0, p]``
    (token space), or the whole prompt when the lie is inside it (its tokens are given, not made)."""
    return max(lie_position - prefix + 1, prompt_length)


class HeldStreamer:
    """Stands between ``generate`` and the caller's streamer in audit mode: passes the prompt once,
    ``end()`` once, and with ``hold_back`` only tokens at positions every hop is audited past
    (``frontier()``: the session's audited position in token space, None before a session exists)."""

    def __init__(self, inner, hold_back: bool, frontier: Callable[[], int | None]):
        self.inner = inner
        self.hold_back = hold_back
        self.frontier = frontier
        self._length: int | None = None  # token ids put so far (prompt included) in this attempt
        self._held: list[tuple[int, Tensor]] = []  # (position after the put's last token, its tokens)
        self._batch = 1

    def put(self, value: Tensor) -> None:
        if self._length is None:  # the first attempt's prompt
            self._batch = value.shape[0] if value.dim() == 2 else 1
            self._length = value.shape[-1]
            self.inner.put(value)
            return
        if self._length < 0:  # a repaired attempt's prompt: the ids the caller has seen or held
            self._length = value.shape[-1]
            return
        n = value.shape[-1] if value.dim() == 2 or self._batch == 1 else 1
        self._length += n
        if not self.hold_back:
            self.inner.put(value)
            return
        self._held.append((self._length, value))
        self.release()

    def release(self, everything: bool = False) -> None:
        """Pass on the held tokens the audits have confirmed (all of them: ``everything``)."""
        frontier = self.frontier()
        while self._held and (everything or (frontier is not None and self._held[0][0] - 1 <= frontier)):
            self.inner.put(self._held.pop(0)[1])

    def restart(self, length: int) -> None:
        """A repair resumes from ``length`` ids: held tokens after them are dropped."""
        self._held = [(end, tokens) for end, tokens in self._held if end <= length]
        self._length = -1

    def end(self) -> None:
        """``generate``'s own ``end()`` (of each attempt): deferred until the answer is final."""

    def finish(self) -> None:
        self.release(everything=True)
        self.inner.end()


def generate_repaired(
    model: DistributedModelForCausalLM, slot: GenerationSlot, generate: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    """``generate(*args, **kwargs)``, then the final audit; on :class:`LieDetected`, again from the
    honest prefix (see the module docstring). ``slot``: where ``model`` hands over each attempt's context."""
    hold_back = bool(kwargs.pop("hold_back", False))
    if not model.verification.auditing:
        if hold_back:
            raise UsageError(
                "hold_back holds tokens until they are checked: load the model with verify='audit' "
                "or verify='redundant'"
            )
        return generate(*args, **kwargs)
    args, kwargs = list(args), dict(kwargs)
    prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    streamer, prompt_mask = None, kwargs.get("attention_mask")
    if kwargs.get("streamer") is not None:
        streamer = kwargs["streamer"] = HeldStreamer(kwargs["streamer"], hold_back, lambda: _frontier(slot))
    for repairs in range(MAX_REPAIRS + 1):
        slot.hand_over(None)
        try:
            out = generate(*args, **kwargs)
            context = slot.context
            session = context.cache.session if context is not None else None
            if isinstance(session, AuditedSession):
                session.audit()  # what the last audit round did not cover: may raise LieDetected
        except LieDetected as lie:
            context = slot.context
            if context is None or not isinstance(prompt, Tensor) or repairs == MAX_REPAIRS:
                raise ShoalError(f"cannot repair generate after {repairs} repairs: {lie}") from lie
            log.warning("%s; regenerating from there", lie)
            if repairs == 0 and prompt_mask is None:  # the mask generate made of the prompt (pad tokens masked)
                inferred = context.attention_mask
                prompt_mask = torch.ones_like(prompt, dtype=torch.long) if inferred is None else inferred
            args, kwargs = _resumed(prompt, prompt_mask, lie, context, args, kwargs)
            if streamer is not None:
                streamer.restart(_ids_of(args, kwargs).shape[1])
            continue
        if streamer is not None:
            streamer.finish()
        return _as_one_run(out, prompt, model.generation_config) if repairs else out
    raise AssertionError("unreachable")


def _frontier(slot: GenerationSlot) -> int | None:
    """Tokens ``[0, result)`` every audited hop of this thread's generation is checked for."""
    context = slot.context
    if context is None:
        return None
    cache = context.cache
    session = cache.session
    audited = session.audited_position if isinstance(session, AuditedSession) else session.position
    return audited - cache.prefix


def _ids_of(args: list, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))


def _resumed(
    prompt: Tensor, prompt_mask: Tensor, lie: LieDetected, context: GenerationContext, args: list, kwargs: dict
) -> tuple[list, dict]:
    """The arguments of the attempt after ``lie``: the honest ids, their mask (the prompt's, then
    ones: a generated token that happens to be the pad id is no padding), the original total
    length, the same session."""
    from shoal.client.generation.cache import CACHE_KEY

    cache, config = context.cache, context.generation_config
    length = resume_length(lie.position, cache.prefix, prompt.shape[1])
    if lie.position < cache.prefix:
        cache.rollback(0)  # the trained prompts themselves were answered wrongly: send them again
    ids = prompt if length == prompt.shape[1] else cache.consumed_ids(length).to(prompt.device)
    kwargs = dict(kwargs)
    mask = prompt_mask
    grown = torch.ones(mask.shape[0], max(length - mask.shape[1], 0), dtype=mask.dtype, device=mask.device)
    kwargs["attention_mask"] = torch.cat([mask, grown], dim=1)[:, :length]
    kwargs.update(max_length=config.max_length, max_new_tokens=None, min_length=config.min_length,
                  min_new_tokens=None, **{CACHE_KEY: cache})  # fmt: skip
    kwargs.pop("input_ids", None)
    kwargs.pop("inputs", None)
    return [ids, *args[1:]], kwargs


def _as_one_run(out: Any, prompt: Tensor, config) -> Any:
    """A batch's rows that ended (EOS) before a repair's resume point went on generating in the
    repaired attempt, where one run pads them: pad after each row's first EOS, and end the answer
    where the last row ended, as one run would."""
    sequences = out if isinstance(out, Tensor) else getattr(out, "sequences", None)
    eos, pad = config.eos_token_id, config.pad_token_id
    if sequences is None or sequences.shape[0] == 1 or eos is None:
        return out
    eos_ids = torch.tensor(eos if isinstance(eos, list) else [eos], device=sequences.device)
    generated = sequences[:, prompt.shape[1] :]
    ended = torch.isin(generated, eos_ids)
    if not bool(ended.any(dim=1).all()):
        return out
    first = ended.long().argmax(dim=1)
    after = torch.arange(generated.shape[1], device=sequences.device)[None] > first[:, None]
    if pad is not None:
        generated.masked_fill_(after, pad if not isinstance(pad, list) else pad[0])
    end = prompt.shape[1] + int(first.max()) + 1
    if isinstance(out, Tensor):
        return out[:, :end]
    out.sequences = sequences[:, :end]
    return out
