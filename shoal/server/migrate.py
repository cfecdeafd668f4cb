"""KV migration: a session's pages handed to a replacement server of the same span (on drain).

The client drives it (:meth:`shoal.client.remote.driver.ChainDriver.migrate`). Told that its hop is
draining, it opens a session on a replacement of the same blocks, weights and cache dtype, and sends
the draining server ``migrate`` on the old session's stream, naming the new session with a token
bound to this server and this migration (:func:`~shoal.verify.tokens.migrate_token`). The draining
server (:meth:`Migrations.send`) reads the session's pages of positions ``[0, position)`` on its
compute thread and sends them to the replacement on a stream of its own (``pages``: keys, values and
the session's state chain ``c_1 .. c_position``, :mod:`shoal.verify.state`). The replacement
(:meth:`Migrations.receive`) checks the token against the sending peer, that the span the sender
states is its own (model, blocks, weights digest, cache dtype, adapter, deep prompts: only such a
server can use the pages), the tensors' shapes and dtype and that they are finite; takes the pages
from its KV budget (it may refuse: busy), commits the chain and reports to the client on the new
session's stream (:class:`~shoal.wire.schema.MigratedReply` under the migration's id: the position
and ``c_position``), then acknowledges the sender, which acknowledges the client. The client switches
over only when that digest is its own chain's for the old hop (what it sent it); on an error, a
timeout or a mismatch it replays the history to the same replacement, as before migration existed.

Only a draining server sends pages, at most :data:`MAX_HAND_OVERS` times per session (a client cannot
make a serving server ship its sessions around), and only to the peer the client's token is bound to
if it serves the very same span: in a swarm, an online member not found unreachable from here whose
record states the same model and blocks, dialled at the addresses it announces; and in any case one
that answers ``info`` with the same model, blocks, weights and dtype.

What the check guards, and what it does not: the chain digest names the inputs the pages were
computed from, not that they were computed right. The replacement cannot recompute the pages (a full
prefill: what migration saves), so it vouches for them by taking them: its receipts commit to the
chain it was handed, and pages that do not match their inputs make it answer wrongly and sign it.
A lying sender is caught like any lie, by an audit recomputing from the client's history
(:mod:`shoal.client.verification.audit`), which accuses the replacement that signed; the sender
was the session's own server, chosen by the same routing as any other.

Size: one ``pages`` message per session, within the receiver's ``max_message_bytes`` (256 MiB by
default: a 2,000-position session of all 30 SmolLM2 blocks in float32 is 92 MB); a larger session is
refused and replayed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from shoal.errors import BadRequest, BusyError, Forbidden, NotFound, RemoteError, ShoalError, Unavailable
from shoal.ids import PeerId
from shoal.models.kv import PagedCache, PagesExhausted
from shoal.protocols import BLOCKS
from shoal.server.session import ServedSession
from shoal.swarm.liveness import Reach
from shoal.swarm.records import ServerRecord, State
from shoal.transport import Ticket
from shoal.verify.receipts import weights_digest
from shoal.verify.state import STATE_BYTES, UNKNOWN_STATE
from shoal.verify.tokens import migrate_allowed
from shoal.wire import Message
from shoal.wire.schema import InfoReply, MigratedReply, MigrateRequest, PagesRequest, same_weights

if TYPE_CHECKING:
    from shoal.server.handler import BlockServer

log = logging.getLogger(__name__)

MIGRATE_TIMEOUT = 30.0  # seconds for the pages to reach the replacement and be taken
DIAL_TIMEOUT = 2.0  # dialling the replacement, and (standalone) its answer to ``info``
MAX_HAND_OVERS = 3  # tries per session (a client that fails one may try another replacement)


def _slots(cache: PagedCache, position: int) -> torch.Tensor:
    """``[batch, position]``: the pool slots of positions ``[0, position)`` of every row."""
    size = cache.pool.page_size
    pages = math.ceil(position / size)
    table = torch.tensor([row[:pages] for row in cache.tables], dtype=torch.long)  # [B, pages]
    slots = (table[:, :, None] * size + torch.arange(size)).reshape(len(cache.tables), -1)
    return slots[:, :position].to(cache.pool.keys[0].device)


def read_pages(cache: PagedCache, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions ``[0, position)``, ``[blocks, batch, position, kv heads, head dim]``
    on the CPU (tensor work: the compute thread). One copy, straight into the tensors sent."""
    slots, pool = _slots(cache, position), cache.pool
    shape = (len(pool.keys), len(cache.tables), position, *pool.keys[0].shape[1:])
    keys, values = (torch.empty(shape, dtype=pool.keys[0].dtype, device=pool.keys[0].device) for _ in range(2))
    for block, (k, v) in enumerate(zip(pool.keys, pool.values, strict=True)):
        for row in range(len(cache.tables)):
            torch.index_select(k, 0, slots[row], out=keys[block, row])
            torch.index_select(v, 0, slots[row], out=values[block, row])
    return keys.cpu(), values.cpu()


def write_pages(cache: PagedCache, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``cache`` hold ``keys``/``values`` (as :func:`read_pages` gives them) at ``[0, position)``:
    its pages taken from the pool (:class:`~shoal.models.kv.PagesExhausted` takes none). Raises
    ValueError, writing nothing, if they are not all finite. Compute thread."""
    # a NaN or an infinity anywhere makes the sum so (one pass, no 92 MB mask: 40x quicker than
    # isfinite(...).all() here); values so large that the sum overflows are refused too
    if not bool(torch.isfinite(keys.sum() + values.sum())):
        raise ValueError("the pages hold values that are not finite")
    position = keys.shape[2]
    cache.prepare(0, position)
    slots, pool = _slots(cache, position), cache.pool
    for block, (k, v) in enumerate(zip(pool.keys, pool.values, strict=True)):
        for row in range(len(cache.tables)):
            k.index_copy_(0, slots[row], keys[block, row].to(k.device))
            v.index_copy_(0, slots[row], values[block, row].to(v.device))
    cache.length = position


class Migrations:
    """A block server's side of KV migration: :meth:`send` (the session's server, on ``migrate``) and
    :meth:`receive` (the replacement, on ``pages``)."""

    def __init__(self, server: BlockServer):
        self.server = server

    # ---- the draining server -------------------------------------------------------------------
    async def send(self, session: ServedSession, message: Message) -> Message:
        """Hand ``session``'s pages to the replacement ``message`` (a ``migrate``) names; the reply to
        the client: an empty result once the replacement took them. Raises a remote error."""
        server = self.server
        meta: MigrateRequest = message.meta
        started = time.perf_counter()
        try:
            if not server.draining:  # a client cannot make a serving server ship its pages around
                raise Unavailable("only a draining server hands its sessions over")
            if session.handed_over >= MAX_HAND_OVERS:
                raise Unavailable(f"session {session.id} was handed over {session.handed_over} times already")
            session.handed_over += 1
            if server.signer is None:
                raise Unavailable("this server keeps no state chain (no key): it cannot migrate sessions")
            if server.pusher.node is None:
                raise Unavailable("this server has no endpoint to send pages from")
            if meta.session != session.id:
                raise NotFound(f"unknown session {meta.session!r} on this stream")
            async with session.lock:  # no step (a push) changes the cache while it is read
                if session.cache is None:
                    raise NotFound(f"session {session.id} is closed")
                position = meta.position
                if position > session.cache.length or position > len(session.state):
                    raise BadRequest(f"position must be in [1, {min(session.cache.length, len(session.state))}]")
                if session.state.at(position) == UNKNOWN_STATE:
                    raise Unavailable("the session's cache is in no state its chain names (a step failed)")
                states = session.state.digests(position)
                keys, values = await server.backend.cache_work(read_pages, session.cache, position)
            nbytes = keys.numel() * keys.element_size() * 2 + len(states)
            if nbytes > server.limits.max_message_bytes:
                raise Unavailable(f"the session's pages ({nbytes} bytes) exceed one message: replay it")
            info = server.info
            pages = PagesRequest(
                session=meta.to.session, token=meta.to.token, position=position, step=meta.step, model=info.model,
                blocks=info.blocks, weights=weights_digest(tuple(info.fingerprints), info.quantization.value),
                dtype=str(keys.dtype).removeprefix("torch."), adapter=session.adapter,
                prompts=session.prompts is not None,
            )  # fmt: skip
            chain = torch.frombuffer(bytearray(states), dtype=torch.uint8)
            async with asyncio.timeout(MIGRATE_TIMEOUT):
                stream = await self._open(meta.to.ticket)
                try:
                    request = Message("pages", stream.next_id(), pages, [keys, values, chain])
                    await stream.request(request, MIGRATE_TIMEOUT)
                except RemoteError as exc:
                    raise Unavailable(f"the replacement refused the pages ({exc.code}): {exc.remote_message}") from None
                finally:
                    await stream.finish()
        except TimeoutError:
            server.counters.migrations_failed += 1
            raise Unavailable(f"the replacement did not take the pages within {MIGRATE_TIMEOUT:g} s") from None
        except ShoalError:
            server.counters.migrations_failed += 1
            raise
        except ValueError as exc:  # a malformed ticket
            server.counters.migrations_failed += 1
            raise BadRequest(f"cannot send pages there: {exc}") from None
        server.counters.sessions_migrated_out += 1
        log.info("session %s: %d positions (%.1f MB) handed over in %.0f ms", session.id, position, nbytes / 1e6,
                 (time.perf_counter() - started) * 1e3)  # fmt: skip
        return Message("result", message.id)

    async def _open(self, text: str):
        """A stream to the replacement ``text`` (a ticket), if it serves this very span (see the module)."""
        server = self.server
        ticket = Ticket.parse(text)
        table = server.pusher.table
        if table is not None:
            signed = table.get(f"s:{ticket.peer_id}")
            record = signed.record if signed is not None else None
            # probed or not (servers of one span never push to each other), but not found unreachable
            if (not isinstance(record, ServerRecord) or record.state is not State.ONLINE
                    or record.expires <= time.time() or table.reach(record) is Reach.UNREACHABLE):  # fmt: skip
                raise Forbidden(f"peer {ticket.peer_id[:10]} is not an online member reachable from here")
            if record.model != server.info.model or record.blocks != server.info.blocks:
                raise Forbidden(f"member {ticket.peer_id[:10]} does not serve this span")
            ticket = Ticket(record.peer, record.addrs, record.relay, record.swarm)
        stream = await server.pusher.node.open_stream(ticket, BLOCKS, timeout=DIAL_TIMEOUT)
        try:
            reply = (await stream.request(Message("info", stream.next_id()), DIAL_TIMEOUT)).reply(InfoReply)
            if not same_weights(reply.span, server.info):
                raise Forbidden(f"peer {ticket.peer_id[:10]} does not serve this span with the same weights")
        except BaseException:
            await stream.abort()
            raise
        return stream

    # ---- the replacement -----------------------------------------------------------------------
    async def receive(self, message: Message, peer_id: PeerId) -> Message:
        """Take the pages of ``message`` (a ``pages`` from ``peer_id``) into the session it names and
        report to that session's client; the reply to the sender. Raises a remote error."""
        server = self.server
        meta: PagesRequest = message.meta
        try:
            session = server.sessions.get(meta.session)
            if session is None or not migrate_allowed(session.token, meta.token, peer_id, step=meta.step,
                                                      position=meta.position):  # fmt: skip
                raise Forbidden("unknown session, or not its migration token for that peer")
            self._check_span(meta, session)
            keys, values, chain = self._check_tensors(message, meta, session)
            async with session.lock:
                if session.cache is None:
                    raise NotFound(f"session {session.id} is closed")
                if session.stepped or session.cache.length:
                    raise BadRequest("pages go only to a session that never stepped")
                server.admission.step(session, meta.position)  # its pages from the budget (or BusyError)
                try:
                    await server.backend.cache_work(write_pages, session.cache, keys, values)
                except ValueError as exc:  # not finite (checked before any page is written)
                    raise BadRequest(str(exc)) from None
                except PagesExhausted as exc:
                    raise BusyError(f"no room for the pages: {exc}") from None
                session.state.commit(0, chain)
                session.prefix = None  # its rows' digests are unknown here: the pages are never shared
                session.last_step = max(session.last_step, meta.step)
                session.last_active = asyncio.get_running_loop().time()
                report = MigratedReply(position=meta.position, state=session.state.at(meta.position))
            await session.stream.send(Message("result", meta.step, report))
        except ShoalError:
            server.counters.migrations_failed += 1
            raise
        server.counters.sessions_migrated_in += 1
        return Message("result", message.id)

    def _check_span(self, meta: PagesRequest, session: ServedSession) -> None:
        info, server = self.server.info, self.server
        if server.signer is None:
            raise Unavailable("this server keeps no state chain (no key): it takes no pages")
        mine = weights_digest(tuple(info.fingerprints), info.quantization.value)
        pool_dtype = str(server.budget.pool.geometry.dtype).removeprefix("torch.")
        if (meta.model, meta.blocks, meta.weights, meta.dtype) != (info.model, info.blocks, mine, pool_dtype):
            raise BadRequest("pages of another span, weights or cache dtype: this server cannot use them")
        if meta.adapter != session.adapter or meta.prompts != (session.prompts is not None):
            raise BadRequest("pages computed with another adapter or deep prompts than this session's")
        if meta.position > session.max_length:
            raise BadRequest(f"{meta.position} positions exceed the session's {session.max_length}")

    def _check_tensors(
        self, message: Message, meta: PagesRequest, session: ServedSession
    ) -> tuple[torch.Tensor, torch.Tensor, bytes]:
        geometry = self.server.budget.pool.geometry
        if len(message.tensors) != 3:
            raise BadRequest("pages carry three tensors: keys, values, states")
        keys, values, chain = message.tensors
        shape = (self.server.backend.num_blocks, session.batch_size, meta.position, geometry.num_kv_heads,
                 geometry.head_dim)  # fmt: skip
        for name, tensor in (("keys", keys), ("values", values)):
            if tuple(tensor.shape) != shape or tensor.dtype != geometry.dtype:
                wanted, got = f"{list(shape)} {geometry.dtype}", f"{list(tensor.shape)} {tensor.dtype}"
                raise BadRequest(f"{name} must be {wanted}, got {got}")
        if chain.dtype != torch.uint8 or tuple(chain.shape) != (meta.position * STATE_BYTES,):
            raise BadRequest(f"states must be {meta.position * STATE_BYTES} bytes (u8)")
        return keys, values, chain.numpy().tobytes()


__all__ = ["MIGRATE_TIMEOUT", "Migrations", "read_pages", "write_pages"]
