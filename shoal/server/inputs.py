"""What a server checks of a request's tensors before anything is queued: shapes, dtypes and lengths
of hidden states, positions, masks, deep prompts and gradients, each refused with a
:class:`~shoal.errors.BadRequest` that names the problem (a malformed step never reaches compute)."""

from __future__ import annotations

import torch

from shoal.errors import BadRequest

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class SpanInputs:
    """The checks of one span's inputs (its ``num_blocks`` and ``hidden_size`` say what fits); the
    span's backend is one (:class:`shoal.server.backend.SpanBackend`)."""

    hidden_size: int

    @property
    def num_blocks(self) -> int:
        raise NotImplementedError

    def check_inputs(
        self,
        tensors: list[torch.Tensor],
        *,
        past_length: int = 0,
        batch_size: int | None = None,
        max_length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Validate ``[hidden, position_ids, attention_mask?]``; raise :class:`BadRequest` naming the problem."""
        if len(tensors) not in (2, 3):
            raise BadRequest(f"expected [hidden, position_ids, attention_mask?], got {len(tensors)} tensors")
        hidden, position_ids = tensors[0], tensors[1]
        mask = tensors[2] if len(tensors) == 3 else None
        if hidden.dtype not in FLOAT_DTYPES:
            raise BadRequest(f"hidden states must be float32, float16 or bfloat16, got {hidden.dtype}")
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise BadRequest(f"hidden states must be [batch, tokens, {self.hidden_size}], got {list(hidden.shape)}")
        batch, n = hidden.shape[:2]
        if batch == 0 or n == 0:
            raise BadRequest(f"empty hidden states {list(hidden.shape)}")
        if batch_size is not None and batch != batch_size:
            raise BadRequest(f"session was opened for batch {batch_size}, step has batch {batch}")
        if max_length is not None and past_length + n > max_length:
            raise BadRequest(f"step to position {past_length + n} is past the session's max_length {max_length}")
        if position_ids.dtype != torch.int64 or list(position_ids.shape) != [batch, n]:
            raise BadRequest(
                f"position_ids must be int64 [{batch}, {n}], got {position_ids.dtype} {list(position_ids.shape)}"
            )
        if mask is not None and (mask.dtype != torch.bool or list(mask.shape) != [batch, past_length + n]):
            raise BadRequest(
                f"attention_mask must be bool [{batch}, {past_length + n}], got {mask.dtype} {list(mask.shape)}"
            )
        return hidden, position_ids, mask

    def forward_inputs(self, tensors: list[torch.Tensor], with_prompts: bool) -> tuple[torch.Tensor, ...]:
        """A forward's ``[hidden, position_ids, attention_mask?, prompts?]``, checked:
        ``(hidden, position_ids, mask, prompts)``."""
        if len(tensors) - with_prompts not in (2, 3):
            raise BadRequest(
                f"expected [hidden, position_ids, attention_mask?{', prompts' if with_prompts else ''}], "
                f"got {len(tensors)} tensors"
            )
        prompts = tensors[-1] if with_prompts else None
        hidden, position_ids, mask = self.check_inputs(tensors[: len(tensors) - with_prompts])
        if prompts is not None:
            self.check_prompts(prompts, hidden.shape[0], hidden.shape[1])
        return hidden, position_ids, mask, prompts

    def backward_inputs(self, tensors: list[torch.Tensor], with_prompts: bool) -> tuple[torch.Tensor, ...]:
        """A backward's ``[hidden, position_ids, attention_mask?, prompts?, grad_output]``, checked:
        ``(hidden, position_ids, mask, prompts, grad_output)``."""
        if len(tensors) - with_prompts - 1 not in (2, 3):
            raise BadRequest(
                f"expected [hidden, position_ids, attention_mask?{', prompts' if with_prompts else ''}, "
                f"grad_output], got {len(tensors)} tensors"
            )
        hidden, position_ids, mask, prompts = self.forward_inputs(tensors[:-1], with_prompts)
        return hidden, position_ids, mask, prompts, self.check_grad_output(tensors[-1], hidden)

    def session_prompts(
        self, tensors: list[torch.Tensor], with_prompts: bool, batch_size: int, max_length: int
    ) -> torch.Tensor | None:
        """An open's deep prompts (its one tensor, if it says ``prompts``), checked."""
        if len(tensors) != with_prompts:
            wanted = "one tensor (the deep prompts)" if with_prompts else "no tensors (without prompts)"
            raise BadRequest(f"open takes {wanted}, got {len(tensors)} tensors")
        return self.check_prompts(tensors[0], batch_size, max_length) if with_prompts else None

    def check_prompts(self, prompts: torch.Tensor, batch: int, max_tokens: int) -> torch.Tensor:
        """Deep prompts ``[span blocks, 1 or batch, N, hidden]`` with ``1 <= N <= max_tokens`` (the
        positions they can reach: a stateless pass's tokens, a session's ``max_length``)."""
        shape = list(prompts.shape)
        if prompts.dtype not in FLOAT_DTYPES:
            raise BadRequest(f"deep prompts must be float32, float16 or bfloat16, got {prompts.dtype}")
        blocks, hidden = self.num_blocks, self.hidden_size
        fits = len(shape) == 4 and shape[0] == blocks and shape[1] in (1, batch) and shape[3] == hidden
        if not fits or not 1 <= shape[2] <= max_tokens:
            batches = "1" if batch == 1 else f"1 or {batch}"
            raise BadRequest(
                f"deep prompts must be [{blocks} (the span's blocks), {batches}, N <= {max_tokens}, {hidden}], "
                f"got {shape}"
            )
        return prompts

    @staticmethod
    def check_grad_output(grad_output: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The gradient of the span's output: float, the output's shape (the hidden states')."""
        if grad_output.dtype not in FLOAT_DTYPES or grad_output.shape != hidden.shape:
            raise BadRequest(
                f"grad_output must be float32, float16 or bfloat16 {list(hidden.shape)} (the output's shape), "
                f"got {grad_output.dtype} {list(grad_output.shape)}"
            )
        return grad_output


__all__ = ["FLOAT_DTYPES", "SpanInputs"]
