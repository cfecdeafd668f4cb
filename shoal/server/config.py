"""Server settings: the one place CLI values become a frozen object the server runs from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from shoal.swarm.gossip import GossipConfig
from shoal.transport import Ticket, TransportConfig

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def parse_blocks(text: str) -> tuple[int, int]:
    """``START:END``, half-open."""
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--blocks takes START:END (half-open), got {text!r}") from None
    if not 0 <= start < end:
        raise ValueError(f"--blocks {text}: need 0 <= START < END")
    return start, end


@dataclass(frozen=True)
class ServerConfig:
    model: str  # local Hugging Face directory, known model name or Hub id
    blocks: tuple[int, int]  # half-open [start, end)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    cache_tokens: int = 8192  # KV cache budget per hosted block, in tokens (all sessions together)
    max_sessions_per_peer: int = 16
    session_idle_timeout: float = 300.0  # a session with no message for this long is closed
    identity_file: Path | None = None
    ticket_file: Path | None = None
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)
    transport: TransportConfig = field(default_factory=TransportConfig)
    new_swarm: bool = False  # create a swarm (its id goes into this server's ticket)
    join: tuple[Ticket, ...] = ()  # tickets of peers of the swarm to join
    throughput: float = 1.0  # what the server's record claims, until measurement exists
    gossip: GossipConfig = field(default_factory=GossipConfig)
    test_reply_delay: float = 0.0  # seconds before every reply: makes a slow server for routing tests
