"""The KV cache transformers' generation loop sees: a stand-in whose keys and values live in a remote
(or local) session, and the token ids that session consumed."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from shoal.client.blocks import BlockSession
from shoal.errors import ShoalError

__all__ = ["CACHE_KEY", "SessionCache", "common_prefix"]

# The name transformers gives the cache in model outputs and in generate's model_kwargs:
# ``past_key_values`` until 5.23, ``cache`` from 5.24 on.
CACHE_KEY = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def common_prefix(a: Tensor, b: Tensor) -> int:
    """The length of the longest common prefix of two ``[batch, n]`` id tensors (every row alike):
    what a session's cache, or a draft model's, can keep of what it consumed."""
    n = min(a.shape[1], b.shape[1])
    differ = (a[:, :n] != b[:, :n].to(a.device)).any(dim=0).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


class SessionCache(Cache):
    """Stands in for the KV cache in transformers' generation loop; the keys/values live in a
    :class:`BlockSession` on the servers. Keeps the token ids the session consumed ([B, position],
    ``-1`` where only embeddings were sent) so later calls can reuse or roll back the prefix.
    ``prefix``: session positions before the tokens (trained prompts), held from the first step on;
    ``position`` and everything transformers reads count tokens only."""

    def __init__(self, session: BlockSession, prefix: int = 0):
        super().__init__(layers=[])
        self.session = session
        self.prefix = prefix
        self._ids = torch.empty(session.batch_size, 0, dtype=torch.long)
        self.closed = False

    @property
    def position(self) -> int:
        return max(self.session.position - self.prefix, 0)

    @property
    def holds_prefix(self) -> bool:
        """Whether the session holds the prompts already (else the next step must send them)."""
        return self.session.position >= self.prefix

    @property
    def token_ids(self) -> Tensor:
        """Ids at positions ``[0, position)`` (the session may have been rolled back directly)."""
        return self._ids[:, : self.position]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.position

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.session.max_length - self.prefix

    def rollback(self, position: int) -> None:
        """Keep tokens ``[0, position)`` (and the prompts before them)."""
        self.session.position = position + self.prefix if self.holds_prefix else 0
        self._ids = self._ids[:, :position]

    def sync(self, input_ids: Tensor) -> int:
        """Roll back to the longest common prefix of ``input_ids`` (the whole sequence so far) and
        the consumed ids, keeping at least one token to send; return the new position."""
        common = min(common_prefix(input_ids, self.token_ids), input_ids.shape[1] - 1)
        if common < self.position:
            self.rollback(common)
        return common

    def record(self, input_ids: Tensor | None, n: int) -> None:
        """Note ``n`` tokens the session consumes (``input_ids`` None: embeddings only); before the
        step, so that ids past the position stay readable when it raises :class:`LieDetected`."""
        new = input_ids.to("cpu", torch.long) if input_ids is not None else torch.full((self._ids.shape[0], n), -1)
        self._ids = torch.cat([self.token_ids, new], dim=1)

    def consumed_ids(self, length: int) -> Tensor:
        """The ids of the first ``length`` tokens sent, even past a rollback (a repair resumes from them)."""
        if length > self._ids.shape[1] or bool((self._ids[:, :length] < 0).any()):
            raise ShoalError(f"no token ids to resume from at {length} (sent as embeddings?)")
        return self._ids[:, :length]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.session.close()

    # Cache interface used by generate: one non-linear, non-compilable "layer" that crops by position.
    @property
    def is_linear(self) -> list[bool]:
        return [False]

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return self.session.batch_size

    def crop(self, tokens_to_remove: int | Tensor) -> None:
        tokens_to_remove = int(tokens_to_remove)  # transformers 5.17's assisted decoding passes a 0-d tensor
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.rollback(self.position + tokens_to_remove)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise NotImplementedError("remote sessions cannot reorder their caches (no beam search)")

    batch_select_indices = batch_repeat_interleave = reorder_cache
