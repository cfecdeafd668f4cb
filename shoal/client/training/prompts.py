"""Prompt tuning as Petals does it: trainable prompts on the client, the blocks frozen on the swarm.

* ``ptune``: ``N`` prompt embeddings (``prompt_embeddings``, an ``nn.Embedding(N, hidden)`` with its
  default N(0, 1) init, as Petals) go before the input embeddings of every sequence.
* ``deep_ptune``: also one prompt per block (``intermediate_prompt_embeddings``, ``N`` rows of
  ``num_blocks * hidden``, zeros at first, as Petals), sent to the servers with each forward (and at
  a session's open) and added to each block's input at positions ``[0, N)``.

Where the prompts go: first in the sequence, before any left padding, so they take positions
``0..N-1`` in every row; the attention mask gets ``N`` ones in front. Token positions are the given
``position_ids`` plus ``N``; without them, they count the attended positions of the extended mask
as transformers' ``generate`` does for padded inputs (so every row's first real token is at ``N``),
or, with no padding, follow on from ``N``. Prompts are kept in float32 (as Petals: their optimiser
state too) and cast to the hidden states' dtype where they are used.

Saved with :meth:`PromptTuning.save` as one safetensors file: the prompt tensors and, in its
metadata, the mode, ``N``, the hidden size and the number of blocks, which :meth:`PromptTuning.load`
checks before it copies anything.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from shoal.errors import UsageError

TUNING_MODES = ("ptune", "deep_ptune")
FORMAT = "shoal-prompts/1"


class PromptTuning(nn.Module):
    """The trainable prompts of one model: ``mode`` is ``"ptune"`` or ``"deep_ptune"``."""

    def __init__(self, mode: str, pre_seq_len: int, hidden_size: int, num_blocks: int):
        super().__init__()
        if mode not in TUNING_MODES:
            raise UsageError(f"tuning_mode must be None or one of {', '.join(map(repr, TUNING_MODES))}, not {mode!r}")
        if not isinstance(pre_seq_len, int) or pre_seq_len < 1:
            raise UsageError(f"tuning_mode {mode!r} needs pre_seq_len >= 1 (prompt positions), got {pre_seq_len!r}")
        self.mode, self.pre_seq_len, self.hidden_size, self.num_blocks = mode, pre_seq_len, hidden_size, num_blocks
        self.prompt_embeddings = nn.Embedding(pre_seq_len, hidden_size, dtype=torch.float32)
        self.intermediate_prompt_embeddings: nn.Embedding | None = None
        if mode == "deep_ptune":
            self.intermediate_prompt_embeddings = nn.Embedding(pre_seq_len, num_blocks * hidden_size)
            with torch.no_grad():
                self.intermediate_prompt_embeddings.weight.zero_()

    def input_prompts(self, batch_size: int, dtype: torch.dtype) -> Tensor:
        """``[batch, N, hidden]``: what goes before every row's input embeddings."""
        return self.prompt_embeddings.weight.to(dtype).unsqueeze(0).expand(batch_size, -1, -1)

    def deep_prompts(self) -> Tensor | None:
        """``[num_blocks, 1, N, hidden]`` (one for every row), or None in ``ptune`` mode."""
        if self.intermediate_prompt_embeddings is None:
            return None
        weight = self.intermediate_prompt_embeddings.weight.view(self.pre_seq_len, self.num_blocks, self.hidden_size)
        return weight.permute(1, 0, 2).unsqueeze(1)

    def extend(
        self, hidden: Tensor, position_ids: Tensor | None, mask: Tensor | None, past: int, prepend: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The inputs of the blocks for ``hidden`` (``[B, n, H]``, tokens ``[past, past + n)``),
        ``position_ids`` (``[B, n]`` or None) and ``mask`` (``[B, past + n]`` bool, None: nothing
        padded), with the prompts' ``N`` positions in front: the mask gets ``N`` ones first, the
        positions move by ``N`` (see the module docstring), and with ``prepend`` (the prompts are
        not in the session yet) the prompt embeddings go before ``hidden``."""
        n_prompts, (batch, n) = self.pre_seq_len, hidden.shape[:2]
        if mask is not None:
            mask = torch.cat([torch.ones(batch, n_prompts, dtype=torch.bool, device=mask.device), mask], dim=1)
        if position_ids is not None:
            positions = position_ids.to(torch.long).expand(batch, n) + n_prompts
        elif mask is not None:
            positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)[:, -n:]
        else:
            positions = torch.arange(n_prompts + past, n_prompts + past + n, device=hidden.device).expand(batch, n)
        if prepend:
            hidden = torch.cat([self.input_prompts(batch, hidden.dtype).to(hidden.device), hidden], dim=1)
            first = torch.arange(n_prompts, device=positions.device).expand(batch, n_prompts)
            positions = torch.cat([first, positions], dim=1)
        return hidden, positions, mask

    # ---- saving and loading --------------------------------------------------------------------

    def _shape(self) -> dict[str, str]:
        return {
            "tuning_mode": self.mode,
            "pre_seq_len": str(self.pre_seq_len),
            "hidden_size": str(self.hidden_size),
            "num_blocks": str(self.num_blocks),
        }

    def save(self, path: str | Path) -> None:
        """Write the prompts (and what they fit) to the safetensors file ``path``."""
        tensors = {name: p.detach().to("cpu").contiguous().clone() for name, p in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"format": FORMAT, **self._shape()})

    def load(self, path: str | Path) -> None:
        """Copy the prompts saved at ``path`` into these (in place: an optimiser's references stay
        valid); raises :class:`UsageError` if they were saved for another mode, ``N`` or model."""
        with safe_open(str(path), framework="pt") as file:
            meta = file.metadata() or {}
            if meta.get("format") != FORMAT:
                raise UsageError(f"{path} is not a shoal prompts file (format {meta.get('format')!r})")
            saved = {key: meta.get(key) for key in self._shape()}
            if saved != self._shape():
                diff = ", ".join(f"{k} {saved[k]} (this model: {v})" for k, v in self._shape().items() if saved[k] != v)
                raise UsageError(f"prompts in {path} do not fit this model: saved with {diff}")
            tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        if set(tensors) != set(self.state_dict()):
            raise UsageError(f"prompts in {path} hold {sorted(tensors)}, expected {sorted(self.state_dict())}")
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(tensors[name])


__all__ = ["TUNING_MODES", "PromptTuning"]
