"""The ``shoal/blocks/2`` protocol handler: info, stateless forward, and inference sessions.

A session lives on the stream that opened it: it is admitted at ``open`` against the per-peer limits
and the server-wide budget of KV pages (:mod:`shoal.server.admission`, :mod:`shoal.server.budget`),
its cache takes pages of the span's pool as its positions come (:class:`~shoal.models.kv.PagedCache`),
and they go back when the client closes it, the stream ends (client vanished) or no message arrives
within the idle timeout (the first step's, ``first_step_timeout``, sooner).

Server-to-server push: a ``step`` may carry the rest of the chain (``push``: the next servers'
tickets, session ids and tokens). The server hands its output straight to the next server (a
``push`` on a server-to-server stream) before answering its own client; that server accepts it only
with the token that binds the session's secret (issued at ``open``) to the pushing peer and the
step (:mod:`shoal.verify.tokens`: a server that learned a later hop's token cannot use it, the one
before cannot push the step elsewhere in the session, or without the receipt asked), runs the
step and answers on the session's client stream, and so on. Every server still answers the client
(who keeps the outputs to replay a span's history). The hand-off itself, and whom a server pushes
to at all (online members of its swarm serving the next blocks), is :mod:`shoal.server.push`.

Stateless requests (:mod:`shoal.server.stateless`): ``forward``, and for training (``train``)
``backward``, the gradient of a pass's inputs (recomputed with autograd, at the lowest priority);
requests may carry deep prompts and name a LoRA adapter.
Drain (leaving): new work gets ``unavailable``; open sessions' steps are served flagged ``draining``,
and a client may have a session's KV pages handed to a replacement of the same span (``migrate``,
``pages``: :mod:`shoal.server.migrate`) instead of replaying its history there.
Codecs: the output travels in the codec the hidden states came in (:mod:`shoal.wire.codecs`), to
the client and, pushed, to the next server, so both decode the very same tensor. Receipts
(``receipts``, :mod:`shoal.verify.receipts`): a step, push or forward that asks gets a receipt
signed with the node key (a push asks on for the next server); with a key, each session keeps the chain
digest of its cache's inputs (:class:`~shoal.verify.state.StateChain`, truncated on rollback) that a
step's receipt commits to (and the client checks). Evidence (``evidence``): another
server's signed lie, judged by :mod:`shoal.server.judge` (a liar convicted here gets no pushes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Mapping

import msgspec
import torch

from shoal.errors import (
    BadRequest,
    ClosedError,
    Forbidden,
    NotFound,
    RemoteError,
    RequestTimeout,
    ShoalError,
    Unavailable,
)
from shoal.ids import PeerId, SessionId
from shoal.limits import Limits
from shoal.models.kv import PagedCache
from shoal.server.admission import Admission
from shoal.server.backend import SpanBackend
from shoal.server.budget import CacheBudget
from shoal.server.judge import Judge
from shoal.server.migrate import Migrations
from shoal.server.prefix import PrefixIndex, SessionPrefix, prefix_seed
from shoal.server.push import Pusher
from shoal.server.session import ServedSession
from shoal.server.stateless import backward, forward, in_kind
from shoal.transport import MessageStream
from shoal.verify.receipts import ReceiptSigner, server_receipt
from shoal.verify.state import step_states
from shoal.verify.tokens import push_allowed
from shoal.wire import InvalidMessage, Message, error_message
from shoal.wire.schema import (
    InfoReply,
    OpenReply,
    OpenRequest,
    PushRequest,
    ServerCounters,
    SpanInfo,
    StepReply,
    StepRequest,
)

log = logging.getLogger(__name__)


class BlockServer:
    """Answers the blocks protocol for one loaded span. Built whole by :mod:`shoal.server.builder`:
    ``counters`` are the ones ``judge`` and ``pusher`` count in too."""

    def __init__(
        self,
        backend: SpanBackend,
        info: SpanInfo,
        budget: CacheBudget,
        counters: ServerCounters,
        judge: Judge,  # evidence of other servers' lies (EVIDENCE)
        pusher: Pusher,  # steps handed to the next server (never to a liar the judge convicted)
        limits: Limits,  # what one peer may hold: sessions, idle time, forward size (shoal.limits)
        signer: ReceiptSigner | None = None,  # the node key: signs receipts (RECEIPTS) when asked
        share_counters: bool = False,  # info carries the counters to any peer (else only what routing needs)
    ):
        self.backend = backend
        self.signer = signer
        self.info = info
        self.budget = budget
        self.limits = limits
        self.share_counters = share_counters
        self.idle_timeout = limits.session_timeout
        self.counters = counters
        self.judge = judge
        self.pusher = pusher
        self.draining = False
        self._sessions: dict[SessionId, ServedSession] = {}
        self.admission = Admission(budget, limits, counters, self._sessions)  # per-peer counts, pages kept
        self._push_tasks: set[asyncio.Task] = set()
        self._session_tasks: set[asyncio.Task] = set()  # streams serving a session, until their handler ends
        self.prefix = PrefixIndex(budget.pool)  # closed sessions' full pages, reused by digest; sets pool.reclaim
        self.migrations = Migrations(self)  # sessions' pages handed to a replacement, or taken from a drainer

    @property
    def sessions(self) -> Mapping[SessionId, ServedSession]:
        """The open sessions, by id (read only)."""
        return self._sessions

    def describe(self, counters: bool = True) -> InfoReply:
        """What this server is and has free; with ``counters`` (this process's metrics, or peers
        when it shares them) its counters too."""
        return InfoReply(
            span=self.info,
            free_cache_tokens=self.budget.free_tokens,
            draining=self.draining,
            # a copy (the reply is encoded later), with the compute thread's counts
            counters=msgspec.structs.replace(
                self.counters,
                **self.backend.compute_counters(),
                kv_pages_total=self.budget.pool.num_pages,
                kv_pages_in_use=self.budget.pool.in_use,
                prefix_cache_pages=self.prefix.cached_pages(),
            )
            if counters
            else None,
        )

    async def handle(self, stream: MessageStream, peer_id: PeerId, client_refusal: str | None = None) -> None:
        """Serve requests on one stream until it ends; ``open`` turns it into a session.
        ``client_refusal``: why the peer may not use this server as a client (a private swarm's
        serve-only member): its ``open``, ``forward`` and ``backward`` are answered ``forbidden``."""
        while True:
            try:
                request = await stream.recv(self.idle_timeout)
            except InvalidMessage as exc:  # well framed, bad metadata: answer, keep the stream
                self.counters.errors += 1
                await stream.send(error_message(exc.request_id, exc.code, exc.remote_message))
                continue
            try:
                if client_refusal is not None and request.kind in ("open", "forward", "backward"):
                    raise Forbidden(client_refusal)
                if request.kind == "info":
                    await stream.send(Message("result", request.id, self.describe(self.share_counters)))
                elif request.kind == "forward":
                    await stream.send(await forward(self, request, peer_id))
                elif request.kind == "backward":
                    await stream.send(await backward(self, request))
                elif request.kind == "pages":  # a draining server hands over a session's KV (MIGRATE)
                    await stream.send(await self.migrations.receive(request, peer_id))
                elif request.kind == "evidence":
                    await stream.send(await self.judge.judge(request, peer_id, draining=self.draining))
                elif request.kind == "open":
                    await self._run_session(stream, peer_id, request)
                    return
                elif request.kind == "push":  # each in its own task: sessions must not queue behind each other
                    task = asyncio.get_running_loop().create_task(self._receive_push(request.meta, request, peer_id))
                    self._push_tasks.add(task)
                    task.add_done_callback(self._push_tasks.discard)
                elif request.kind == "step":
                    raise NotFound(f"unknown session {request.meta.session!r} (open one on this stream first)")
                else:
                    raise BadRequest(f"{request.kind!r} is not a request of this protocol")
            except RemoteError as exc:
                self.counters.errors += 1
                await stream.send(error_message(request.id, exc.code, exc.remote_message))

    async def drain(self, timeout: float) -> None:
        """Leave gracefully: refuse new work, keep serving open sessions (their replies say
        ``draining``, so clients move away at their next step) until they are closed or
        ``timeout`` passes; then finish in-flight steps and close what is left."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout
        # a closed session's stream is waited for too: its close reply must leave before the node closes
        while (self._sessions or self._session_tasks) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for session in list(self._sessions.values()):
            remaining = max(0.0, deadline - asyncio.get_running_loop().time()) + 1.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await session.lock.acquire()  # let an in-flight step finish (and answer)
                    session.lock.release()
            if session.id in self._sessions and session.task is not None:
                self.counters.sessions_drained += 1
                session.task.cancel()
        await self.pusher.close()

    async def _open(self, peer_id: PeerId, request: Message, stream: MessageStream) -> ServedSession:
        if self.draining:
            raise Unavailable("server is draining (leaving the swarm): open the session elsewhere")
        meta: OpenRequest = request.meta
        max_length, batch_size = meta.max_length, meta.batch_size
        prompts = self.backend.session_prompts(request.tensors, meta.prompts, batch_size, max_length)
        self.backend.check_adapter(meta.adapter)
        pages = self.admission.admit(peer_id, batch_size, max_length)
        try:
            if prompts is not None:
                prompts = await self.backend.on_device(prompts)
        except BaseException:
            self.admission.cancel(peer_id, batch_size, pages)
            raise
        cache = PagedCache(self.budget.pool, batch_size, max_length)
        session = ServedSession(SessionId(secrets.token_hex(8)), peer_id, batch_size, max_length, pages, cache, stream)
        session.prompts, session.adapter = prompts, meta.adapter
        if prompts is None:  # deep prompts change every block's input: such sessions never share pages
            start, end, width, adapter = (
                self.info.blocks.start,
                self.info.blocks.end,
                self.backend.hidden_size,
                meta.adapter,
            )
            session.prefix = SessionPrefix(batch_size, self.budget.page_size,
                                           lambda dtype: prefix_seed(start, end, adapter, dtype, width),
                                           peer_id, meta.share)  # fmt: skip
        session.task = asyncio.current_task()
        self._session_tasks.add(session.task)
        session.task.add_done_callback(self._session_tasks.discard)
        self._sessions[session.id] = session
        self.counters.sessions_opened += 1
        self.counters.sessions_active += 1
        return session

    def _free(self, session: ServedSession) -> None:
        if self._sessions.pop(session.id, None) is None:
            return  # already freed
        self.admission.release(session)
        self.counters.sessions_active -= 1
        session.cache.close()  # its pages go back to the pool
        session.cache = None

    async def _run_session(self, stream: MessageStream, peer_id: PeerId, request: Message) -> None:
        session = await self._open(peer_id, request, stream)
        ended = False  # closed or timed out; any other end (stream closed, broken, cancelled) is "abandoned"
        try:
            reply = OpenReply(session=session.id, token=session.token, max_length=session.max_length)
            await stream.send(Message("result", request.id, reply))
            while True:
                try:
                    message = await self._next_message(session)
                except InvalidMessage as exc:  # bad metadata: answered, the session goes on
                    self.counters.errors += 1
                    await stream.send(error_message(exc.request_id, exc.code, exc.remote_message))
                    continue
                except RequestTimeout:
                    self.counters.sessions_timed_out += 1
                    ended = True
                    return
                except ClosedError:  # the client vanished: counted as abandoned below
                    return
                if message.kind == "close":
                    self.counters.sessions_closed += 1
                    ended = True
                    async with session.lock:  # a pushed step may be running
                        self._free(session)  # before the reply: a client that saw it sees the cache free
                    await stream.send(Message("result", message.id))
                    return
                if message.kind == "migrate":  # hand the pages to a replacement (MIGRATE)
                    try:
                        await stream.send(await self.migrations.send(session, message))
                    except RemoteError as exc:
                        self.counters.errors += 1
                        await stream.send(error_message(message.id, exc.code, exc.remote_message))
                    continue
                if message.kind != "step":
                    self.counters.errors += 1
                    text = f"a session stream takes step, migrate or close, not {message.kind!r}"
                    await stream.send(error_message(message.id, "bad_request", text))
                    continue
                await self._serve_step(session, message)
        finally:
            if session.pending is not None:
                session.pending.cancel()
            if not ended:
                self.counters.sessions_abandoned += 1
            if session.lock.locked():  # a pushed step is running: free once it is done
                asyncio.get_running_loop().create_task(self._free_after(session))
            else:
                self._free(session)

    async def _free_after(self, session: ServedSession) -> None:
        async with session.lock:
            self._free(session)

    async def _next_message(self, session: ServedSession) -> Message:
        """The client's next message. A session is idle when neither its client nor a pushing
        server has sent it anything for ``idle_timeout`` (with push, the client talks only to the
        first server of the chain); one that never stepped, after ``first_step_timeout`` already
        (an open that is never used is reclaimed quickly)."""
        loop = asyncio.get_running_loop()
        while True:
            if session.pending is None:
                session.pending = loop.create_task(session.stream.recv())
            timeout = self.idle_timeout if session.stepped else min(self.idle_timeout, self.limits.first_step_timeout)
            remaining = session.last_active + timeout - loop.time()
            done, _ = await asyncio.wait({session.pending}, timeout=max(0.0, remaining))
            if done:
                task, session.pending = session.pending, None
                session.last_active = loop.time()
                return task.result()
            if session.stepped and timeout < self.idle_timeout:
                continue  # its first step ran (pushed) while this waited: the idle deadline applies
            if loop.time() - session.last_active >= timeout:
                raise RequestTimeout(f"session {session.id} idle for {timeout:.3g} s")

    async def _serve_step(self, session: ServedSession, message: Message, from_push: bool = False) -> None:
        """Run one step, push the output down the chain if asked, answer the session's client.
        ``from_push`` (the previous server's push): dropped unless newer than the session's last step once
        the lock is held, as well as before: a late push that waited for the lock while the
        client's own retry ran must not overwrite the cache that retry wrote."""
        try:
            async with session.lock:
                if from_push and message.id <= session.last_step:  # overtaken while it waited
                    self.counters.pushes_rejected += 1
                    return
                if from_push:
                    self.counters.pushes_received += 1
                if session.cache is None:
                    raise NotFound(f"session {session.id} is closed")
                reply = await self._step(session, message, pushed=from_push)
                session.last_step = max(session.last_step, message.id)
            route = message.meta.push
            if route:
                pushed = await self.pusher.push(reply, message, route)
                reply.meta = msgspec.structs.replace(reply.meta, pushed=pushed)
        except RemoteError as exc:
            self.counters.errors += 1
            reply = error_message(message.id, exc.code, exc.remote_message)
        if self.draining and isinstance(reply.meta, StepReply):
            reply.meta = msgspec.structs.replace(reply.meta, draining=True)
        try:
            await session.stream.send(reply)
        except ShoalError as exc:  # the client vanished: its session ends with its stream
            log.info("could not answer session %s: %s", session.id, exc)

    async def _receive_push(self, meta: PushRequest, message: Message, peer_id: PeerId) -> None:
        """A step pushed by the previous server: its token must be the one the session's client
        derived from the session's secret for ``peer_id`` (the pushing stream's peer) and this very
        step (id, position, positions, receipt asked); then served like the client's own step (the
        reply goes to the session's client). Nothing is sent back to the pushing server."""
        session = self._sessions.get(meta.session)
        hidden = message.tensors[0] if message.tensors else None
        n = hidden.shape[1] if hidden is not None and hidden.dim() >= 2 else -1
        if session is None or not push_allowed(session.token, meta.token, peer_id, step=meta.step,
                                               position=meta.position, n=n, receipt=meta.receipt):  # fmt: skip
            self.counters.pushes_rejected += 1
            log.info("rejected a push from %s: unknown session, or not its token for that peer", peer_id[:10])
            return
        if meta.step <= session.last_step:  # overtaken: the client resent this step or moved on
            self.counters.pushes_rejected += 1
            return
        session.last_active = asyncio.get_running_loop().time()
        step = StepRequest(session=session.id, position=meta.position, push=meta.push, receipt=meta.receipt)
        try:
            step_message = Message("step", meta.step, step, message.tensors, message.codecs)
            await self._serve_step(session, step_message, from_push=True)  # checked again under the session's lock
        except Exception:
            log.exception("pushed step for session %s failed", session.id)

    async def _step(self, session: ServedSession, message: Message, pushed: bool = False) -> Message:
        """Run the session's step (``pushed``: handed on by the previous server of its chain)."""
        meta: StepRequest = message.meta
        if meta.session != session.id:
            raise NotFound(f"unknown session {meta.session!r} on this stream")
        position = meta.position
        if position > session.cache.length:
            raise BadRequest(f"position must be in [0, {session.cache.length}] (what the session holds)")
        hidden, position_ids, mask = self.backend.check_inputs(
            message.tensors, past_length=position, batch_size=session.batch_size, max_length=session.max_length
        )
        self.admission.step(session, position + hidden.shape[1])  # its pages (committed again if taken back)
        rolled_back = session.cache.length - position  # positions the client dropped (speculation, a retry)
        signs = self.signer is not None  # only a server with a key signs receipts: only it keeps the chain
        states = await step_states(session.state, position, hidden, position_ids, mask) if signs else b""
        started = time.perf_counter()

        async def run(hidden: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, past: int):
            return await self.backend.run(
                hidden,
                position_ids,
                mask,
                session.cache,
                past,
                prompts=session.prompts,
                adapter=session.adapter,
                peer=session.peer_id,
                pushed=pushed,
            )

        try:
            if session.prefix is not None:  # full pages of inputs seen before are adopted, not recomputed
                out, reused = await session.prefix.step(self.prefix, session.cache, position, hidden, position_ids,
                                                        mask, run)  # fmt: skip
                self.counters.prefix_hit_tokens += reused
            else:
                out = await run(hidden, position_ids, mask, position)
        except Exception:
            session.state.forget(position)  # the cache may be half written from here: no receipt vouches for it
            raise
        state = session.state.at(position)  # what the step ran on
        if signs:
            session.state.commit(position, states)
        self.counters.positions_rolled_back += rolled_back
        self.counters.step_seconds += time.perf_counter() - started
        self.counters.steps += 1
        self.counters.positions_processed += hidden.shape[1]
        codecs_out = in_kind(out, message)
        receipt = None
        if meta.receipt:
            receipt = server_receipt(self.signer, self.info, message, out, session.id, position,
                                     adapter=session.adapter, prompts=session.prompts is not None, state=state,
                                     device=self.backend.device)  # fmt: skip
        reply = StepReply(position=position + hidden.shape[1], receipt=receipt)
        return Message("result", message.id, reply, [out], codecs_out)
