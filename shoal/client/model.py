"""A ``transformers`` causal LM whose transformer blocks run elsewhere.

The client keeps embeddings, final norm and LM head (a :class:`~shoal.models.base.ClientHead`);
hidden states go through a :class:`~shoal.client.blocks.BlockSequence`. ``generate`` is
transformers' own loop. Two hooks connect it to remote sessions:

* ``_prepare_cache_for_generation`` puts a :class:`SessionCache` in ``model_kwargs[CACHE_KEY]``: the
  active ``inference_session`` if any, else a session opened for this call (``generate`` closes it,
  also on errors). Its ``get_seq_length()`` is the session position, so transformers feeds only the
  tokens the servers do not hold yet.
* ``_prefill`` first lines the session up with the prompt: if the prompt's prefix differs from the
  token ids the session consumed, the session rolls back to the common prefix (cheap: the servers'
  caches are written by position). Assisted decoding does the same before its first round.
* ``_get_candidate_generator`` (speculative decoding: ``assistant_model=`` or
  ``prompt_lookup_num_tokens=``) wraps transformers' drafter so that shoal's
  :class:`~shoal.client.generation.speculation.WindowPlanner` picks each round's window;
  :attr:`DistributedModelForCausalLM.last_speculation` says what the last such call did.

Training: a stateless pass whose input embeddings or prompts require grad is differentiable through
the servers (:mod:`shoal.client.training.backward`); ``labels=`` gives transformers' causal LM ``loss``. With
prompt tuning (:mod:`shoal.client.training.prompts`) the prompts take a session's first ``N`` positions: the
session holds them from its first step on (and is opened with the deep prompts), while everything
transformers sees (``get_seq_length``, ``max_length``, logits) counts tokens only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from shoal.client.blocks import BlockSequence
from shoal.client.generation.cache import CACHE_KEY, SessionCache
from shoal.client.generation.speculation import PlannedDrafts, SpeculationStats, WindowPlanner, max_window, windowed
from shoal.client.training.prompts import PromptTuning
from shoal.client.verification.audit import Verification
from shoal.client.verification.repair import GenerationContext, GenerationSlot, generate_repaired
from shoal.models.base import ClientHead

__all__ = ["DistributedModelForCausalLM"]


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """``DistributedModelForCausalLM(config, head, blocks)``: a causal LM over remote blocks.

    ``model(...)`` without ``cache`` is a stateless pass; with ``cache=`` (the object yielded by
    :meth:`inference_session`) it appends the given tokens to that session. Hidden states travel as
    ``wire_dtype`` and are cast back to the head's dtype. ``prompts``: trainable prompts
    (:class:`~shoal.client.training.prompts.PromptTuning`), the model's only trainable parameters as loaded.
    """

    base_model_prefix = "shoal"
    main_input_name = "input_ids"
    # Attention runs on the servers: accept whatever implementation the config names.
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True

    def __init__(
        self,
        config,
        head: ClientHead,
        blocks: BlockSequence,
        wire_dtype: torch.dtype = torch.float32,
        prompts: PromptTuning | None = None,
    ):
        super().__init__(config)
        self.head = head
        self.blocks = blocks
        self.wire_dtype = wire_dtype
        self.ptune = prompts
        self._per_thread = threading.local()  # the active session and generate's own: one set per thread
        self._generation = GenerationSlot()  # each thread's generate attempt under way, for repairs
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """The head's tensors come from the checkpoint: nothing to initialise."""

    def close(self) -> None:
        """Stop the model's background work (server list refresh, witness) and close its node.
        Idempotent; also done when the model is garbage-collected or the interpreter exits. Sessions
        still open end with it (their servers free them)."""
        self.blocks.close()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Per thread, so that threads sharing the model (e.g. a gateway) each generate in their own session.
    @property
    def _active(self) -> SessionCache | None:
        return getattr(self._per_thread, "active", None)

    @_active.setter
    def _active(self, cache: SessionCache | None) -> None:
        self._per_thread.active = cache

    @property
    def _opened(self) -> list[SessionCache] | None:
        return getattr(self._per_thread, "opened", None)

    @_opened.setter
    def _opened(self, caches: list[SessionCache] | None) -> None:
        self._per_thread.opened = caches

    @property
    def active_session(self) -> SessionCache | None:
        return self._active

    @property
    def tuning_mode(self) -> str | None:
        return self.ptune.mode if self.ptune is not None else None

    @property
    def pre_seq_len(self) -> int:
        """Positions the trained prompts take before every sequence (0: no prompt tuning)."""
        return self.ptune.pre_seq_len if self.ptune is not None else 0

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.head.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head.lm_head

    def save_prompts(self, path) -> None:
        """Write the trained prompts to the safetensors file ``path`` (see :mod:`shoal.client.training.prompts`)."""
        self._prompts("save").save(path)

    def load_prompts(self, path) -> None:
        """Load prompts saved by :meth:`save_prompts`; refuses ones of another mode, length or model.
        Sessions opened before keep the deep prompts they were opened with."""
        self._prompts("load").load(path)

    def _prompts(self, what: str) -> PromptTuning:
        if self.ptune is None:
            raise ValueError(f"no prompts to {what}: load the model with tuning_mode='ptune' or 'deep_ptune'")
        return self.ptune

    def _open_cache(self, batch_size: int, max_length: int, share_prefix: int = 0) -> SessionCache:
        """A session for ``max_length`` tokens (and the prompts), opened with the deep prompts (whose
        sessions servers never share). ``share_prefix``: its first tokens other peers may reuse."""
        deep = self.ptune.deep_prompts() if self.ptune is not None else None
        length = max_length + self.pre_seq_len
        if deep is None:
            shared = {"share": share_prefix + self.pre_seq_len} if share_prefix > 0 else {}  # any blocks take none
            return SessionCache(self.blocks.open_session(batch_size, length, **shared), self.pre_seq_len)
        prompts = deep.detach().to(self.wire_dtype)
        return SessionCache(self.blocks.open_session(batch_size, length, prompts=prompts), self.pre_seq_len)

    @property
    def last_speculation(self) -> SpeculationStats | None:
        """Rounds, drafted and accepted tokens of this thread's last speculative ``generate`` call."""
        return getattr(self._per_thread, "speculation", None)

    def _window_planner(self, key: tuple, inner, fixed: bool) -> WindowPlanner:
        """This thread's planner for one drafter: what it measured (the chain's and the drafter's
        costs, the acceptance rate) carries over to the next call with the same drafter."""
        planners: dict[tuple, WindowPlanner] = getattr(self._per_thread, "planners", None) or {}
        self._per_thread.planners = planners
        planner, widest = planners.get(key), max_window(inner)
        if planner is None or planner.max_window != widest:
            lookup = key[0] == "lookup"  # lookup drafts for free: start wide; a draft model: with 2
            planner = WindowPlanner(widest, free_drafts=lookup, fixed=fixed, first_window=widest if lookup else 2)
            planners[key] = planner
        return planner

    @contextmanager
    def inference_session(self, max_length: int, batch_size: int = 1, share_prefix: int = 0) -> Iterator[SessionCache]:
        """Hold one session across ``generate`` calls (each sends only tokens it does not hold).
        ``share_prefix``: its first tokens, whose server-side KV pages other peers' sessions may reuse
        (a system prompt; the default 0 lets only this peer's own later sessions reuse them)."""
        if self._active is not None:
            raise RuntimeError("an inference session is already active on this model")
        cache = self._open_cache(batch_size, max_length, share_prefix)
        self._active = cache
        try:
            yield cache
        finally:
            self._active = None
            cache.close()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """As a transformers causal LM: ``labels`` (-100: ignored) give the shifted cross-entropy
        ``loss``. With prompt tuning the logits cover the tokens only, so labels line up with them."""
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if cache is not None and not isinstance(cache, SessionCache):
            raise TypeError("remote blocks keep their own cache: pass the cache from model.inference_session()")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        hidden = self.head.embed(input_ids) if inputs_embeds is None else inputs_embeds
        batch, n = hidden.shape[:2]
        past = cache.position if cache is not None else 0
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != (batch, past + n):
                raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != {(batch, past + n)}")
            mask = None if bool(attention_mask.all()) else attention_mask.bool()
        prepended = 0
        if self.ptune is not None:
            prepend = cache is None or not cache.holds_prefix
            hidden, position_ids, mask = self.ptune.extend(hidden, position_ids, mask, past, prepend)
            prepended = self.pre_seq_len if prepend else 0
        else:
            if position_ids is None:  # as the transformers models do: positions follow the cache
                position_ids = torch.arange(past, past + n, device=hidden.device).unsqueeze(0)
            position_ids = position_ids.to(torch.long).expand(batch, n)

        wire = hidden.to(self.wire_dtype)
        if cache is None:
            out = self._stateless(wire, position_ids, mask)
        else:  # sessions are for inference: their steps are not differentiable
            cache.record(input_ids, n)
            out = cache.session.step(wire.detach(), position_ids, mask)
        out = out[:, prepended:].to(device=hidden.device, dtype=self.dtype)
        logits = self.head.logits(_positions_to_keep(out, logits_to_keep))
        loss = None
        if labels is not None:
            extra = {k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **extra)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_KEY: cache})
        return output if return_dict is not False else output.to_tuple()

    def _stateless(self, wire: Tensor, position_ids: Tensor, mask: Tensor | None) -> Tensor:
        deep = self.ptune.deep_prompts() if self.ptune is not None else None
        if deep is None:
            return self.blocks.forward(wire, position_ids, mask)
        return self.blocks.forward(wire, position_ids, mask, prompts=deep.to(self.wire_dtype))

    @property
    def verification(self) -> Verification:
        """What audits did (``from_pretrained(verify="audit" or "redundant")``; see
        :mod:`shoal.client.verification.audit`). Blocks that keep no counters verify nothing: ``off``."""
        return getattr(self.blocks, "verification", None) or Verification("off")

    def generate(self, *args: Any, **kwargs: Any):
        """transformers' ``generate``; without an active session, one is opened for this call and
        closed afterwards (also when generation raises). In audit mode a lie found is repaired, and
        ``hold_back=True`` holds a streamer's tokens until audited (:mod:`shoal.client.verification.repair`)."""
        outer, self._opened = self._opened, []
        try:
            return generate_repaired(self, self._generation, super().generate, args, kwargs)
        finally:
            opened, self._opened = self._opened, outer
            for cache in opened:
                cache.close()

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        if generation_config.num_beams > 1:
            raise NotImplementedError("beam search needs cache reordering, which remote sessions do not support")
        if generation_config.use_cache is False:
            return  # every step re-sends the whole sequence through the stateless forward
        cache = model_kwargs.get(CACHE_KEY)
        cache = self._active if cache is None else cache  # (a Cache with no layers is falsy)
        rows = batch_size * generation_config.num_return_sequences
        if cache is None:
            cache = self._open_cache(rows, max_cache_length + 1)  # prompt + new tokens
            if self._opened is not None:
                self._opened.append(cache)
        elif not isinstance(cache, SessionCache):
            raise TypeError("remote blocks keep their own cache: use model.inference_session()")
        if cache.batch_size != rows:
            raise ValueError(f"generate needs {rows} sequences, the session holds {cache.batch_size}")
        if max_cache_length > (room := cache.get_max_cache_shape()):
            raise ValueError(f"generate needs {max_cache_length} positions, the session has {room}")
        model_kwargs[CACHE_KEY] = cache
        self._generation.hand_over(GenerationContext(cache, generation_config, model_kwargs.get("attention_mask")))

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):  # fmt: skip
        inner = super()._get_candidate_generator(
            generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
            assistant_model=assistant_model, target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer,
        )  # fmt: skip
        cache = model_kwargs.get(CACHE_KEY)
        if not windowed(inner) or not isinstance(cache, SessionCache):
            return inner
        if assistant_model is None:
            key, fixed = ("lookup",), False
        else:
            fixed = assistant_model.generation_config.num_assistant_tokens_schedule == "constant"
            key = ("draft", id(assistant_model), assistant_model.config.name_or_path, fixed)
        stats = SpeculationStats()
        self._per_thread.speculation = stats
        return PlannedDrafts(inner, self._window_planner(key, inner, fixed), stats, cached=lambda: cache.position)

    def _assisted_decoding(self, input_ids: Tensor, *args: Any, **kwargs: Any):
        cache = kwargs.get(CACHE_KEY)
        if isinstance(cache, SessionCache) and kwargs.get("inputs_embeds") is None:
            cache.sync(input_ids)  # reuse what an inference session holds of this prompt, as _prefill does
        return super()._assisted_decoding(input_ids, *args, **kwargs)

    def prepare_inputs_for_generation(
        self, input_ids: Tensor, *args: Any, next_sequence_length: int | None = None, is_first_iteration: bool = False,
        inputs_embeds: Tensor | None = None, **kwargs: Any,
    ) -> dict:  # fmt: skip
        """transformers sends the whole sequence in a first iteration (assisted decoding's included),
        assuming an empty cache; a session that holds a prefix of it takes only the rest."""
        cache = kwargs.get(CACHE_KEY)
        if (
            is_first_iteration
            and next_sequence_length is None
            and isinstance(cache, SessionCache)
            and 0 < cache.position < input_ids.shape[1]
            and inputs_embeds is None
            and (kwargs.get("attention_mask") is None or kwargs["attention_mask"].shape[1] == input_ids.shape[1])
        ):
            next_sequence_length = input_ids.shape[1] - cache.position
        return super().prepare_inputs_for_generation(
            input_ids, *args, next_sequence_length=next_sequence_length, is_first_iteration=is_first_iteration,
            inputs_embeds=inputs_embeds, **kwargs,
        )  # fmt: skip

    def _prefill(self, input_ids: Tensor, generation_config, model_kwargs: dict, is_first_iteration: bool = True):
        cache = model_kwargs.get(CACHE_KEY)
        if isinstance(cache, SessionCache):
            if model_kwargs.get("inputs_embeds") is not None and is_first_iteration:
                cache.rollback(0)  # embeddings cannot be compared with what the session holds
            else:
                mask = model_kwargs.get("attention_mask")
                mask_length = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)
                if mask_length == input_ids.shape[1]:  # the whole sequence (else: only the new tokens)
                    cache.sync(input_ids)
        return super()._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=is_first_iteration)


def _positions_to_keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions whose logits are wanted, as transformers' models pick them: an int keeps the last
    ``logits_to_keep`` (0 keeps all), a 1-D tensor names positions (transformers' own helper for this
    came in 5.21)."""
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, keep, :]
