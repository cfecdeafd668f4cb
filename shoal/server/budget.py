"""The server-wide KV cache budget: all-or-nothing reservations, released when a session ends."""

from __future__ import annotations

from shoal.errors import BusyError


class CacheBudget:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self.reserved_tokens = 0

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.reserved_tokens

    def reserve(self, tokens: int) -> None:
        """Reserve ``tokens`` (batch x max_length) or raise :class:`BusyError` at once."""
        if tokens > self.free_tokens:
            raise BusyError(
                f"session needs {tokens} cache tokens, {self.free_tokens} of {self.capacity_tokens} are free; "
                "try a shorter max_length or another server"
            )
        self.reserved_tokens += tokens

    def release(self, tokens: int) -> None:
        self.reserved_tokens = max(0, self.reserved_tokens - tokens)
