"""Generation behind the gateway: prompts, sampling, stop strings, streaming and cancellation.

One :class:`Engine` wraps the client model created once at startup. :meth:`Engine.complete` is
blocking and runs in a worker thread; every call is its own ``generate`` with its own server-side
session (the model keeps per-thread state), so concurrent requests never share a cache.

Text is produced by :class:`TextStream` from the generated token ids, the same way whether the
request streams or not: a streamed answer's deltas join to exactly the non-streamed text.

The engine keeps the sessions of the generations running now, so the dashboard can show which
servers they run on (:meth:`Engine.routes`), and running totals of what it generated and what
speculative decoding did (:class:`Totals`, the gateway's ``/metrics``).

With verification on (a model loaded with ``verify="audit"`` or ``"redundant"``), a lie an audit
finds rolls the session back and the answer is regenerated from there (:mod:`shoal.client.verification.repair`).
Text is then released only for tokens every hop is audited past (``generate(..., hold_back=True)``),
so no delta ever holds a token the answer later replaces. That lag is up to ``audit_every``
positions (plus a step's window with speculation; one step in redundant mode) while generating, and
the last tokens come after one more audit round once generation ends. Stop strings and cancellation
still act on the unaudited tokens: a stop in a lie ends the attempt, the final audit catches it and
the repair generates on. Each answer's :class:`Completion` says what verification did meanwhile
(:func:`checked`).

Speculative decoding (:class:`Speculation`: ``--draft MODEL`` or ``--prompt-lookup N``) is
transformers' assisted decoding over the distributed model, with shoal choosing each round's window
(:mod:`shoal.client.generation.speculation`). Greedy answers are the same tokens as without it; sampled ones
keep their distribution (the target's sampled tokens are compared with the drafts).
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from shoal.client.generation.cache import SessionCache
from shoal.client.generation.sampling import PositionSeededSampler
from shoal.client.remote.session import RemoteSession
from shoal.errors import ShoalError, UsageError

__all__ = [
    "VERIFY_COUNTERS",
    "ChatPrompt",
    "Completion",
    "Engine",
    "GatewayError",
    "Sampling",
    "Speculation",
    "TextStream",
    "Totals",
    "checked",
    "load_draft",
]

DEFAULT_MAX_TOKENS = 512  # when a request names no max_tokens (and the context leaves room)
#: The client's verification counters (:class:`~shoal.client.verification.audit.Verification`) an answer reports.
VERIFY_COUNTERS = ("audits", "audited_positions", "disagreements", "settled", "unsettled", "bans", "rollbacks")


class ChatPrompt(list):
    """A chat's token ids, and how many of the first its system prompt covers (``shared``: what
    :meth:`Engine.complete` lets servers reuse across peers, see :mod:`shoal.server.prefix`)."""

    def __init__(self, ids: Sequence[int], shared: int = 0):
        super().__init__(ids)
        self.shared = shared


class GatewayError(ShoalError):
    """A request the gateway refuses, in OpenAI's terms: HTTP status, error type, param, code."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" (eos or a stop string), "length", or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    speculation: dict[str, float | int] | None = None  # SpeculationStats.summary() when speculation ran
    verification: dict[str, Any] | None = None  # checked(...) when the model verifies (None: verify off)


@dataclass(frozen=True)
class Speculation:
    """How the engine drafts: a local ``draft`` model or, with ``prompt_lookup`` tokens per round,
    n-grams of the prompt. ``draft_tokenizer`` is set only when the draft's vocabulary differs from
    the target's: then transformers maps between the two (universal assisted decoding)."""

    draft: Any = None  # a transformers causal LM in eval mode
    draft_tokenizer: Any = None
    prompt_lookup: int | None = None

    def generate_kwargs(self, target_tokenizer) -> dict[str, Any]:
        """What ``generate`` takes for this speculation."""
        if self.draft is None:
            return {} if self.prompt_lookup is None else {"prompt_lookup_num_tokens": self.prompt_lookup}
        kwargs: dict[str, Any] = {"assistant_model": self.draft}
        if self.draft_tokenizer is not None:
            kwargs |= {"tokenizer": target_tokenizer, "assistant_tokenizer": self.draft_tokenizer}
        return kwargs


def load_draft(model_dir: Path, target_tokenizer, dtype: torch.dtype = torch.float32) -> Speculation:
    """Load the draft model in ``model_dir`` (see :func:`shoal.gateway.serve.check_draft`) for
    speculative decoding with a target whose tokenizer is ``target_tokenizer``; the draft's own
    tokenizer is kept only if its vocabulary differs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--draft: {model_dir} has no tokenizer files; speculative decoding needs them") from exc
    draft = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    same = target_tokenizer is not None and draft_tokenizer.get_vocab() == target_tokenizer.get_vocab()
    return Speculation(draft=draft, draft_tokenizer=None if same else draft_tokenizer)


class Totals:
    """What the engine generated since it started, for ``/metrics``: completion tokens, and the
    rounds, drafted and accepted tokens of speculative decoding. Thread-safe (one per engine)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.completion_tokens = 0
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0

    def add(self, done: Completion) -> None:
        with self._lock:
            self.completion_tokens += done.completion_tokens
            if done.speculation is not None:
                self.rounds += int(done.speculation["rounds"])
                self.drafted += int(done.speculation["drafted_tokens"])
                self.accepted += int(done.speculation["accepted_tokens"])

    def snapshot(self) -> dict[str, float | int]:
        """The counters, plus acceptance (accepted / drafted) and mean window (drafted / rounds)
        over everything so far (0 before the first round)."""
        with self._lock:
            return {
                "completion_tokens": self.completion_tokens,
                "rounds": self.rounds,
                "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_window": self.drafted / self.rounds if self.rounds else 0.0,
            }


class TextStream:
    """Generated ids -> text deltas, ending at the first stop string (which is not part of the text).

    Holds back what may still change: a trailing incomplete character (decoded as U+FFFD) and a
    suffix that could be the start of a stop string. :meth:`final` is the whole text."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False  # a stop string appeared

    def _text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        return text

    def push(self, ids: Sequence[int]) -> str:
        """Take the newly generated ``ids``; return the text that became certain."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self._text()
        if not self.stopped:
            text = text.rstrip("\ufffd")
            hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            text = text[: len(text) - hold]
        return self._advance(text)

    def final(self) -> str:
        return self._text()

    def stops_in(self, ids: Sequence[int]) -> bool:
        """Whether the text of ``ids`` holds a stop string (the stream's own ids are not looked at)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.stops else ""
        return any(s in text for s in self.stops)

    def finish(self) -> str:
        """The rest of the text (what was held back)."""
        return self._advance(self.final())

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""  # decoding changed text already sent (rare with byte-level BPE): wait for more
        delta, self.sent = text[len(self.sent) :], text
        return delta


class _Watch(StoppingCriteria):
    """Stops on a stop string or a cancel request. ``feeds``: also feeds each new token to the text
    stream (else :class:`_Released` does, with audited tokens only, and this one just looks)."""

    def __init__(self, stream: TextStream, prompt_length: int, on_text, cancel: threading.Event, feeds: bool = True):
        self.stream, self.prompt_length, self.on_text, self.cancel = stream, prompt_length, on_text, cancel
        self.feeds = feeds

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.feeds:
            new = input_ids[0, self.prompt_length + len(self.stream.ids) :].tolist()
            delta = self.stream.push(new)
            if delta and self.on_text is not None:
                self.on_text(delta)
            stopped = self.stream.stopped
        else:  # the ids of this attempt, audited or not: a repair may still replace them
            stopped = self.stream.stops_in(input_ids[0, self.prompt_length :].tolist())
        done = stopped or self.cancel.is_set()
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class _Released:
    """The streamer ``generate(..., hold_back=True)`` hands audited tokens to: they go to the text
    stream (and its deltas to ``on_text``). The first ``put`` is the prompt, not text."""

    def __init__(self, stream: TextStream, on_text: Callable[[str], None] | None):
        self.stream, self.on_text = stream, on_text
        self.prompted = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompted:
            self.prompted = True
            return
        delta = self.stream.push(value.reshape(-1).tolist())  # one row: a token, or a speculative round's
        if delta and self.on_text is not None:
            self.on_text(delta)

    def end(self) -> None:
        """Nothing: :meth:`Engine.complete` takes what is left from the final ids."""


def checked(verification, before: dict[str, int], session) -> dict[str, Any]:
    """What verification did for one answer: the mode, the blocks of its session's chain no auditor
    checks (``unverified_blocks``), and how much each of :data:`VERIFY_COUNTERS` grew while it ran
    (``before``: the counters then). The counters are the client's: answers running at the same time
    count each other's audits too."""
    spans = session.verified() if hasattr(session, "verified") else {}
    unverified = sum(end - start for (start, end), ok in spans.items() if not ok)
    grown = {name: getattr(verification, name) - before[name] for name in VERIFY_COUNTERS}
    return {"mode": verification.mode, "audit_every": verification.audit_every, "unverified_blocks": unverified,
            **grown}  # fmt: skip


class Engine:
    """The gateway's model: ``model_id`` is the name clients use, ``model`` the client model."""

    def __init__(
        self,
        model,
        model_id: str,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        speculation: Speculation | None = None,
    ):
        self.model = model
        self.model_id = model_id
        self.tokenizer = model.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"model {model_id} has no tokenizer files: the gateway needs one")
        self.context_length = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
        self.default_max_tokens = default_max_tokens
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._live: set[SessionCache] = set()  # the sessions of the generations running now
        self._live_lock = threading.Lock()
        self.speculation = speculation
        self.totals = Totals()

    @contextmanager
    def _session(self, positions: int, shared: int = 0) -> Iterator[SessionCache]:
        """The session ``generate`` runs in, listed in :meth:`routes` meanwhile: the thread's active
        one (a chat holds one across its turns), else one of ``positions`` for this call (what
        ``generate`` would reserve itself: prompt + new tokens) whose first ``shared`` tokens servers
        may let other peers reuse."""
        held = self.model.active_session
        shares = {"share_prefix": shared} if shared else {}  # models that know no sharing work too
        with nullcontext(held) if held is not None else self.model.inference_session(positions, **shares) as cache:
            with self._live_lock:
                self._live.add(cache)
            try:
                yield cache
            finally:
                with self._live_lock:
                    self._live.discard(cache)

    def routes(self) -> list[list[dict]]:
        """The chain of servers each running generation's session uses now: ``[{peer, start, end}]``
        per session (sessions over in-process blocks have none)."""
        with self._live_lock:
            sessions = [cache.session for cache in self._live]
        return [
            [{"peer": s.peer_id, "start": s.start, "end": s.end} for s in session.chain]
            for session in sessions
            if isinstance(session, RemoteSession)
        ]

    # ---- prompts -------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, ready for the answer."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise GatewayError(400, f"model {self.model_id} has no chat template: use /v1/completions", param="model")
        try:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        except Exception as exc:  # the template rejected the conversation (e.g. roles out of order)
            raise GatewayError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        ids = list(encoded["input_ids"])
        return ChatPrompt(ids, shared=self._system_tokens(messages, ids))

    def _system_tokens(self, messages: list[dict], ids: list[int]) -> int:
        """How many of ``ids`` (the whole conversation's) the leading system messages' rendering covers:
        the same for every conversation under that system prompt, so servers may let other peers reuse
        their pages (shoal.server.prefix). Its token ids' common prefix with ``ids``: tokens the template
        ends the system part with that the full rendering merges differently are not counted."""
        system = list(itertools.takewhile(lambda m: m.get("role") in ("system", "developer"), messages))
        if not system or len(system) == len(messages):
            return 0
        try:
            alone = self.tokenizer.apply_chat_template(system, add_generation_prompt=False, return_dict=True)
        except Exception:  # a template that wants a user turn: share nothing
            return 0
        same = [mine == full for mine, full in zip(alone["input_ids"], ids, strict=False)] + [False]
        return same.index(False)

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise GatewayError(400, f"token ids must lie in [0, {vocab})", param="prompt")
        return list(prompt)

    def budget(self, prompt: Sequence[int], max_tokens: int | None, param: str) -> int:
        """``max_tokens`` checked against the context (OpenAI's error when it does not fit)."""
        room = self.context_length - len(prompt)
        if max_tokens is None and room > 0:
            return min(self.default_max_tokens, room)
        asked = len(prompt) + (max_tokens or 0)
        if room <= 0 or asked > self.context_length:
            raise GatewayError(
                400,
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{asked} tokens ({len(prompt)} in the {param}, {max_tokens or 0} in the completion). "
                f"Please reduce the length of the {param} or completion.",
                param=param,
                code="context_length_exceeded",
            )
        return max_tokens

    # ---- generation ----------------------------------------------------------------------------
    def complete(
        self,
        prompt: Sequence[int],
        sampling: Sampling,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Completion:
        """Generate (blocking); ``on_text`` hears each text delta; setting ``cancel`` stops at the
        next token (and ``generate`` closes the servers' session)."""
        cancel = cancel or threading.Event()
        stream = TextStream(self.tokenizer, sampling.stop)
        config = copy.deepcopy(self.model.generation_config)
        config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
        config.max_new_tokens, config.max_length = sampling.max_tokens, None
        speculation = self.speculation or Speculation()
        processors = LogitsProcessorList()
        if sampling.temperature > 0:
            processors.append(PositionSeededSampler(sampling.temperature, sampling.top_p, sampling.seed))
        verification = self.model.verification
        holding = verification.auditing  # text only for audited tokens (see the module docstring)
        watch = _Watch(stream, len(prompt), on_text, cancel, feeds=not holding)
        input_ids = torch.tensor([list(prompt)], dtype=torch.long)
        drafting = speculation.generate_kwargs(self.tokenizer)
        config.prompt_lookup_num_tokens = drafting.pop("prompt_lookup_num_tokens", None)  # a config field
        if holding:
            drafting |= {"streamer": _Released(stream, on_text), "hold_back": True}
        before = self.model.last_speculation  # this thread's; replaced only by a speculative call
        counted = {name: getattr(verification, name) for name in VERIFY_COUNTERS}
        shared = getattr(prompt, "shared", 0) if self.model.active_session is None else 0
        with torch.inference_mode(), self._session(len(prompt) + sampling.max_tokens, shared) as cache:
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([watch]),
                **drafting,
            )
            state = checked(verification, counted, cache.session) if verification.mode != "off" else None
        stats = self.model.last_speculation
        summary = stats.summary() if self.speculation is not None and stats is not before else None
        generated = out[0, len(prompt) :].tolist()
        rest = stream.push(generated[len(stream.ids) :]) + stream.finish()
        if rest and on_text is not None:
            on_text(rest)
        if stream.stopped or (generated and generated[-1] in self.eos_ids):
            reason = "stop"
        elif cancel.is_set() and len(generated) < sampling.max_tokens:
            reason = "cancelled"
        else:
            reason = "length"
        done = Completion(stream.final(), reason, len(prompt), len(generated), summary, state)
        self.totals.add(done)
        return done
