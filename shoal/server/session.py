"""What a server keeps of one open inference session (:mod:`shoal.server.handler` serves it)."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

import torch

from shoal.ids import PeerId, SessionId
from shoal.models.kv import PagedCache
from shoal.server.prefix import SessionPrefix
from shoal.transport import MessageStream
from shoal.verify.state import StateChain


@dataclass
class ServedSession:
    id: SessionId
    peer_id: PeerId
    batch_size: int
    max_length: int
    pages: int  # KV pages committed (shoal.server.admission): its max_length's, less a reservation taken back
    cache: PagedCache | None
    stream: MessageStream  # the client's: every reply of the session goes there
    # the session's push secret, told only its client: a push from peer P carries the token the client
    # derived for P from it (shoal.verify.tokens), so only the previous hop the client chose can push
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    task: asyncio.Task | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one step at a time, from the client or a push
    pending: asyncio.Task | None = None  # the read of the client's next message
    last_active: float = field(default_factory=lambda: asyncio.get_running_loop().time())
    last_step: int = 0  # id of the latest step served: older pushes arriving late are dropped
    stepped: bool = False  # a step ran: the idle timeout applies, no longer the first-step one
    prompts: torch.Tensor | None = None  # deep prompts added at positions [0, N) of every step's blocks
    adapter: str | None = None  # the LoRA adapter the session runs with (None: the base weights)
    state: StateChain = field(default_factory=StateChain)  # what its cache holds: receipts commit to it
    prefix: SessionPrefix | None = None  # its rows' chains in the server's prefix cache (None: never shares)
    handed_over: int = 0  # tries to hand its KV pages to a replacement (shoal.server.migrate)
