"""The ``shoal/blocks/1`` protocol handler: info, stateless forward, and inference sessions.

A session lives on the stream that opened it: its KV cache is allocated at ``open`` (all or
nothing, against the server-wide budget) and freed when the client closes it, the stream ends
(client vanished) or no message arrives within the idle timeout.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from shoal.errors import BadRequest, BusyError, ClosedError, NotFound, RemoteError, RequestTimeout
from shoal.server.backend import SpanBackend
from shoal.server.budget import CacheBudget
from shoal.transport import MessageStream
from shoal.wire import Message, error_message

log = logging.getLogger(__name__)
MAX_SESSION_LENGTH = 1 << 20


@dataclass
class Counters:
    """What a server has done, readable through ``info`` (tests and dashboards use them)."""

    sessions_opened: int = 0
    sessions_closed: int = 0  # closed by the client
    sessions_abandoned: int = 0  # the client vanished mid-session (or broke its stream)
    sessions_timed_out: int = 0  # idle for longer than the timeout
    sessions_active: int = 0
    sessions_rejected_busy: int = 0
    steps: int = 0
    positions_processed: int = 0
    forward_requests: int = 0
    forward_tokens: int = 0
    errors: int = 0


@dataclass(frozen=True)
class SpanInfo:
    model: str
    num_blocks: int
    start: int
    end: int
    fingerprints: list[str]
    dtype: str
    hidden_size: int
    version: str


@dataclass
class _Session:
    id: str
    peer_id: str
    batch_size: int
    max_length: int
    tokens: int
    cache: Any


class BlockServer:
    def __init__(
        self,
        backend: SpanBackend,
        info: SpanInfo,
        budget: CacheBudget,
        max_sessions_per_peer: int,
        idle_timeout: float,
    ):
        self.backend = backend
        self.info = info
        self.budget = budget
        self.max_sessions_per_peer = max_sessions_per_peer
        self.idle_timeout = idle_timeout
        self.counters = Counters()
        self._sessions: dict[str, _Session] = {}
        self._per_peer: Counter[str] = Counter()

    def describe(self) -> dict:
        return {**asdict(self.info), "free_cache_tokens": self.budget.free_tokens, "counters": asdict(self.counters)}

    async def handle(self, stream: MessageStream, peer_id: str) -> None:
        """Serve requests on one stream until it ends; ``open`` turns it into a session."""
        while True:
            request = await stream.recv(self.idle_timeout)
            try:
                if request.kind == "info":
                    await stream.send(Message("result", request.id, self.describe()))
                elif request.kind == "forward":
                    await stream.send(await self._forward(request))
                elif request.kind == "open":
                    await self._run_session(stream, peer_id, request)
                    return
                elif request.kind == "step":
                    raise NotFound(f"unknown session {request.meta.get('session')!r} (open one on this stream first)")
                else:
                    raise BadRequest(f"{request.kind!r} is not a request of this protocol")
            except RemoteError as exc:
                self.counters.errors += 1
                await stream.send(error_message(request.id, exc.code, exc.remote_message))

    async def _forward(self, request: Message) -> Message:
        hidden, position_ids, mask = self.backend.check_inputs(request.tensors)
        out = await self.backend.run(hidden, position_ids, mask)
        self.counters.forward_requests += 1
        self.counters.forward_tokens += hidden.shape[0] * hidden.shape[1]
        return Message("result", request.id, {}, [out])

    def _open(self, peer_id: str, meta: dict) -> _Session:
        max_length, batch_size = meta.get("max_length"), meta.get("batch_size", 1)
        if not isinstance(max_length, int) or not 0 < max_length <= MAX_SESSION_LENGTH:
            raise BadRequest(f"max_length must be an int in [1, {MAX_SESSION_LENGTH}], got {max_length!r}")
        if not isinstance(batch_size, int) or not 0 < batch_size <= 1024:
            raise BadRequest(f"batch_size must be an int in [1, 1024], got {batch_size!r}")
        if self._per_peer[peer_id] >= self.max_sessions_per_peer:
            self.counters.sessions_rejected_busy += 1
            raise BusyError(
                f"peer already has {self._per_peer[peer_id]} open sessions (limit {self.max_sessions_per_peer})"
            )
        tokens = batch_size * max_length
        try:
            self.budget.reserve(tokens)
        except BusyError:
            self.counters.sessions_rejected_busy += 1
            raise
        try:
            cache = self.backend.allocate_cache(batch_size, max_length)
        except Exception:
            self.budget.release(tokens)
            raise
        session = _Session(secrets.token_hex(8), peer_id, batch_size, max_length, tokens, cache)
        self._sessions[session.id] = session
        self._per_peer[peer_id] += 1
        self.counters.sessions_opened += 1
        self.counters.sessions_active += 1
        return session

    def _free(self, session: _Session) -> None:
        if self._sessions.pop(session.id, None) is None:
            return  # already freed
        self._per_peer[session.peer_id] -= 1
        if self._per_peer[session.peer_id] <= 0:
            del self._per_peer[session.peer_id]
        self.budget.release(session.tokens)
        self.counters.sessions_active -= 1
        session.cache = None

    async def _run_session(self, stream: MessageStream, peer_id: str, request: Message) -> None:
        session = self._open(peer_id, request.meta)
        ended = False  # closed or timed out; any other end (stream closed, broken, cancelled) is "abandoned"
        try:
            await stream.send(Message("result", request.id, {"session": session.id, "max_length": session.max_length}))
            while True:
                try:
                    message = await stream.recv(self.idle_timeout)
                except RequestTimeout:
                    self.counters.sessions_timed_out += 1
                    ended = True
                    return
                except ClosedError:  # the client vanished: counted as abandoned below
                    return
                if message.kind == "close":
                    self.counters.sessions_closed += 1
                    ended = True
                    self._free(session)  # before the reply: a client that saw it sees the cache free
                    await stream.send(Message("result", message.id))
                    return
                try:
                    await stream.send(await self._step(session, message))
                except RemoteError as exc:
                    self.counters.errors += 1
                    await stream.send(error_message(message.id, exc.code, exc.remote_message))
        finally:
            if not ended:
                self.counters.sessions_abandoned += 1
            self._free(session)

    async def _step(self, session: _Session, message: Message) -> Message:
        if message.kind != "step":
            raise BadRequest(f"a session stream takes step or close, not {message.kind!r}")
        if message.meta.get("session") != session.id:
            raise NotFound(f"unknown session {message.meta.get('session')!r} on this stream")
        position = message.meta.get("position")
        if not isinstance(position, int) or not 0 <= position <= session.cache.length:
            raise BadRequest(f"position must be an int in [0, {session.cache.length}] (what the session holds)")
        hidden, position_ids, mask = self.backend.check_inputs(
            message.tensors, past_length=position, batch_size=session.batch_size, max_length=session.max_length
        )
        out = await self.backend.run(hidden, position_ids, mask, session.cache, position)
        self.counters.steps += 1
        self.counters.positions_processed += hidden.shape[1]
        return Message("result", message.id, {"position": position + hidden.shape[1]}, [out])
