"""The block stack as a chain of remote servers: a :class:`~shoal.client.blocks.BlockSequence`
over the ``shoal/blocks/1`` protocol, with routing and recovery.

Inference steps go to the first server of the chain, which pushes its output to the next and so
on (``push=False``: the client drives every hop itself); every server also answers the client,
which keeps each hop's inputs (the *history*) so that a failed server can be replaced mid-session:

* a reply that is late (an adaptive deadline from the latencies seen so far) triggers a ping: a
  live server keeps its chance, a dead one (or a closed stream, or an error reply) is banned with
  exponential backoff and the chain is re-planned from its first block, preferring servers that
  already hold the session; every new server gets the history of its first block replayed (one
  step over all positions so far), so it rebuilds its cache, and the step continues from there;
* a reply flagged ``draining`` (the server is leaving) moves that span the same way, after the step;
* a bounded number of recoveries per step, then :class:`~shoal.routing.NoRouteError` naming the
  blocks no live server covers.

The synchronous methods (called from transformers' generate) hand coroutines to the process's
client event loop (:mod:`shoal.client.runtime`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from shoal.client.directory import ServerDirectory
from shoal.client.runtime import LoopThread, shared_loop
from shoal.errors import BadRequest, ClosedError, NotFound, ShoalError, remote_error
from shoal.protocols import BLOCKS
from shoal.routing import NoRouteError, ServerSpan, format_blocks, uncovered_blocks
from shoal.transport import MessageStream, Node, Ticket, TransportConfig
from shoal.wire import Message

log = logging.getLogger(__name__)

MAX_RECOVERIES = 8  # per step (and per session open)
MIN_DEADLINE = 0.25  # seconds before a late reply makes the client check that the server lives
DEADLINE_FACTOR = 4.0  # ... or this many times the expected reply time, if longer
REPLAY_MS = 50.0  # routing price of a server that would need a replay (prefer those holding state)
RECOVERY_TIMEOUT = 1.5  # opening a session on a replacement: a dead candidate must not stall recovery long


def _inputs(hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> list[Tensor]:
    return [hidden, position_ids] if mask is None else [hidden, position_ids, mask]


class _HopFailed(Exception):
    """Server ``index`` of the chain failed this step; ``outputs`` holds what earlier hops returned."""

    def __init__(self, index: int, cause: BaseException, outputs: list[tuple[int, Tensor]]):
        super().__init__(f"hop {index} failed: {cause}")
        self.index = index
        self.cause = cause
        self.outputs = outputs


class RemoteSequence:
    """Blocks ``[0, num_blocks)`` served by the servers a :class:`ServerDirectory` knows."""

    def __init__(
        self, node: Node, runtime: LoopThread, directory: ServerDirectory, num_blocks: int, *, push: bool = True
    ):
        self.node = node
        self.runtime = runtime
        self.directory = directory
        self.num_blocks = num_blocks
        self.push = push
        self.chain: list[ServerSpan] = directory.route_inference(0, cache_tokens=0, push=push)

    @classmethod
    def connect(
        cls,
        initial_peers: Sequence[str | Ticket],
        num_blocks: int,
        hidden_size: int,
        transport: TransportConfig | None = None,
        runtime: LoopThread | None = None,
        model: str | None = None,
        *,
        push: bool = True,
        refresh_period: float = 30.0,
        seed: int | None = None,
    ) -> RemoteSequence:
        """Tickets with a swarm id: join the swarm through any of them and route over its table
        (servers of ``model`` whose fingerprints match the swarm's model record). Plain tickets:
        ask each peer what it hosts. ``refresh_period``: seconds between background refreshes of
        the server list and latencies (0: never)."""
        runtime = runtime or shared_loop()
        tickets = [t if isinstance(t, Ticket) else Ticket.parse(t) for t in initial_peers]
        if not tickets:
            raise ValueError("initial_peers is empty: give at least one server ticket")
        transport = transport or TransportConfig()
        timeout = transport.deadlines.connect + transport.deadlines.request

        async def setup() -> RemoteSequence:
            node = await Node.start(transport)
            try:
                directory = ServerDirectory(
                    node, tickets, model, num_blocks, hidden_size, timeout, refresh_period=refresh_period, seed=seed
                )
                await directory.refresh()
                sequence = cls(node, runtime, directory, num_blocks, push=push)
                directory.start()
                return sequence
            except BaseException:
                await node.close()
                raise

        sequence = runtime.run(setup())
        log.info("route: %s", " -> ".join(f"{s.peer_id[:8]}[{s.start}:{s.end})" for s in sequence.chain))
        return sequence

    def describe_route(self) -> list[dict]:
        return [{"peer": s.peer_id, "start": s.start, "end": s.end} for s in self.chain]

    def forward(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        return self.runtime.run(self._forward(hidden, position_ids, attention_mask))

    async def _forward(self, hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> Tensor:
        """Stateless pass; each call draws its own route (capacity-weighted). A failing server is
        banned and the rest of the pass re-routed from the block it should have started at."""
        block, failed, recoveries = 0, set(), 0
        timeout = self.node.config.deadlines.request
        while block < self.num_blocks:
            route = self.directory.route_forward(block, exclude=failed)
            for span in route:
                message = Message("forward", 1, {}, _inputs(hidden, position_ids, mask))
                try:
                    reply = await self.node.request(span.ticket, BLOCKS, message, timeout=timeout)
                except BadRequest:
                    raise
                except ShoalError as exc:
                    recoveries += 1
                    failed.add(span.peer_id)
                    self.directory.bans.ban(span.peer_id)
                    log.warning("forward through %s failed (%s); re-routing", span.peer_id[:10], exc)
                    if recoveries > MAX_RECOVERIES:
                        raise _gave_up(self.directory, failed, block, exc) from exc
                    break
                self.directory.bans.succeeded(span.peer_id)
                hidden, block = reply.tensors[0], span.end
        return hidden

    def open_session(self, batch_size: int, max_length: int) -> RemoteSession:
        session = RemoteSession(self, batch_size, max_length)
        self.runtime.run(session.open())
        return session

    def server_infos(self) -> list[dict]:
        """Fresh ``info`` of every server on the current route (counters included)."""

        async def gather() -> list[dict]:
            replies = [await self.node.request(s.ticket, BLOCKS, Message("info", 1)) for s in self.chain]
            return [r.meta for r in replies]

        return self.runtime.run(gather())

    def close(self) -> None:
        async def shutdown() -> None:
            await self.directory.stop()
            await self.node.close()

        self.runtime.run(shutdown())


def _gave_up(directory: ServerDirectory, failed: set[str], block: int, cause: BaseException) -> NoRouteError:
    live = [s for s in directory.spans if s.peer_id not in failed]
    missing = [b for b in uncovered_blocks(live, directory.num_blocks) if b >= block]
    where = f"no live server left for blocks {format_blocks(missing)}" if missing else "every route failed"
    return NoRouteError(f"gave up after {MAX_RECOVERIES} recoveries: {where} (last error: {cause})", missing)


@dataclass
class _Hop:
    """The session on one server of the chain."""

    span: ServerSpan
    stream: MessageStream
    session: str = ""
    token: str = ""
    ticket: str = ""
    pending: asyncio.Task | None = None  # a recv still waiting (a late reply we gave more time)
    draining: bool = False

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.span.peer_id, self.span.start, self.span.end)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _cat_serial(chunks: list[Tensor], dim: int) -> Tensor:
    """``torch.cat`` of CPU tensors without OpenMP. Histories are joined on the client's event loop
    thread, and the first parallel region a thread opens gives it a libgomp pool of its own: with
    the model thread's pool that is more threads than CPUs, and from then on every parallel region
    of the process sleeps at its barriers (the LM head gets ~1.8x slower). numpy joins serially."""
    dtype = chunks[0].dtype
    as_int = _SAME_SIZE_INT[dtype.itemsize]  # any dtype, bf16 included, travels as same-size ints
    joined = np.concatenate([chunk.view(as_int).numpy() for chunk in chunks], axis=dim)
    return torch.from_numpy(joined).view(dtype)


@dataclass
class _History:
    """Inputs of every step so far at chain boundaries (by first block), for replays."""

    hidden: dict[int, list[Tensor]] = field(default_factory=dict)  # block -> [B, n_k, H] per step
    positions: list[Tensor] = field(default_factory=list)  # [B, n_k] per step
    mask: Tensor | None = None  # [B, position] bool, all positions so far

    def at(self, block: int) -> Tensor | None:
        chunks = self.hidden.get(block)
        if chunks is None:
            return None
        if len(chunks) > 1:
            chunks[:] = [_cat_serial(chunks, dim=1)]
        return chunks[0] if chunks else None

    def position_ids(self) -> Tensor:
        if len(self.positions) > 1:
            self.positions[:] = [_cat_serial(self.positions, dim=1)]
        return self.positions[0]

    def truncate(self, position: int) -> None:
        for block in list(self.hidden):
            whole = self.at(block)
            self.hidden[block] = [whole[:, :position]] if whole is not None and position else []
        if self.positions:
            self.positions[:] = [self.position_ids()[:, :position]] if position else []
        if self.mask is not None:
            self.mask = self.mask[:, :position]


class RemoteSession:
    """An inference session over a chain of servers (one stream each), surviving server failures."""

    def __init__(self, sequence: RemoteSequence, batch_size: int, max_length: int):
        self.sequence = sequence
        self.directory = sequence.directory
        self.batch_size = batch_size
        self.max_length = max_length
        self._position = 0
        self._hops: list[_Hop] = []
        self._history = _History()
        self._step_id = 0
        self.closed = False
        self.recoveries: list[dict] = []  # what happened: failed peer, replacements, replayed positions

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if not 0 <= value <= self._position:
            raise ValueError(f"can only roll back: position {value} not in [0, {self._position}]")
        if value < self._position:
            self._history.truncate(value)
        self._position = value

    @property
    def chain(self) -> list[ServerSpan]:
        return [hop.span for hop in self._hops]

    @property
    def cache_tokens(self) -> int:
        return self.batch_size * self.max_length

    # ---- opening and closing -------------------------------------------------------------------

    async def open(self) -> None:
        failed: set[str] = set()
        for attempt in range(MAX_RECOVERIES + 1):
            route = self.directory.route_inference(
                0, cache_tokens=self.cache_tokens, push=self.sequence.push, exclude=failed
            )
            results = await asyncio.gather(*(self._open_hop(span) for span in route), return_exceptions=True)
            errors = [(span, r) for span, r in zip(route, results, strict=True) if isinstance(r, BaseException)]
            if not errors:
                self._hops = list(results)
                self.sequence.chain = self.chain
                return
            for hop in results:
                if isinstance(hop, _Hop):
                    await self._close_hop(hop)
            for span, error in errors:
                if isinstance(error, BadRequest) or not isinstance(error, ShoalError):
                    raise error
                failed.add(span.peer_id)
                self.directory.bans.ban(span.peer_id)
                log.warning("could not open a session on %s: %s", span.peer_id[:10], error)
            if attempt == MAX_RECOVERIES:
                raise _gave_up(self.directory, failed, 0, errors[0][1])
        raise AssertionError("unreachable")

    async def _open_hop(self, span: ServerSpan, timeout: float | None = None) -> _Hop:
        """Open the session on ``span``'s server; ``timeout`` bounds the dial and the reply each
        (recovery must not wait a whole request deadline on a dead replacement)."""
        stream = await self.sequence.node.open_stream(span.ticket, BLOCKS, timeout)
        hop = _Hop(span, stream, ticket=str(span.ticket))
        try:
            reply = await stream.request(
                Message("open", 1, {"max_length": self.max_length, "batch_size": self.batch_size}), timeout
            )
        except BaseException:
            await stream.abort()
            raise
        hop.session, hop.token = reply.meta["session"], reply.meta.get("token", "")
        return hop

    async def _close_hop(self, hop: _Hop) -> None:
        if hop.pending is not None:
            hop.pending.cancel()
            hop.pending = None
        try:
            if hop.session and not hop.stream.broken:
                await hop.stream.request(Message("close", self._next_id()), timeout=5)
        except ShoalError:
            pass
        finally:
            await hop.stream.finish()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            hops, self._hops = self._hops, []
            self.sequence.runtime.run(self._close_all(hops))

    async def _close_all(self, hops: list[_Hop]) -> None:
        await asyncio.gather(*(self._close_hop(hop) for hop in hops))

    # ---- steps ---------------------------------------------------------------------------------

    def step(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if self.closed:
            raise NotFound("session is closed")
        batch, n = hidden.shape[:2]
        if batch != self.batch_size:
            raise BadRequest(f"batch size {batch} != session batch size {self.batch_size}")
        if self._position + n > self.max_length:
            raise BadRequest(f"step of {n} at position {self._position} exceeds max_length {self.max_length}")
        out = self.sequence.runtime.run(self._step(hidden, position_ids, attention_mask))
        self._position += n
        return out

    def _next_id(self) -> int:
        self._step_id += 1
        return self._step_id

    async def _step(self, hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> Tensor:
        inputs: dict[int, Tensor] = {0: hidden}  # block -> this step's input there
        failed: set[str] = set()
        while draining := [i for i, hop in enumerate(self._hops) if hop.draining]:
            # the server said it is leaving: move its span before this step
            peer = self._hops[draining[0]].span.peer_id
            await self._recover(draining[0], ShoalError(f"server {peer[:10]} is draining"), failed, drain=True)
        index = 0
        while index < len(self._hops):
            try:
                outputs = await self._run(index, inputs[self._hops[index].span.start], position_ids, mask)
            except _HopFailed as failure:
                for k, out in failure.outputs:
                    inputs[self._hops[k].span.end] = out
                index = await self._recover(failure.index, failure.cause, failed)
                continue
            for k, out in outputs:
                inputs[self._hops[k].span.end] = out
            index = len(self._hops)
        self._remember(inputs, position_ids, mask, hidden.shape[1])
        return inputs[self.sequence.num_blocks]

    def _remember(self, inputs: dict[int, Tensor], position_ids: Tensor, mask: Tensor | None, n: int) -> None:
        history = self._history
        starts = {hop.span.start for hop in self._hops}
        for block in list(history.hidden):
            if block not in starts:  # no longer a boundary: its history stops being complete
                del history.hidden[block]
        for block in starts:
            history.hidden.setdefault(block, []).append(inputs[block])
        history.positions.append(position_ids)
        # a step's mask covers every position so far; None: nothing is padded
        history.mask = mask if mask is not None else torch.ones(self.batch_size, self._position + n, dtype=torch.bool)

    async def _run(self, index: int, hidden: Tensor, position_ids: Tensor, mask: Tensor | None):
        """Run the step from hop ``index`` to the end: sent to hop ``index`` with the rest of the
        chain to push through; where a push did not get through (or ``push`` is off), the client
        sends to the next hop itself. Returns ``[(hop, output)]``; raises :class:`_HopFailed`."""
        hops, n = self._hops, hidden.shape[1]
        outputs: list[tuple[int, Tensor]] = []
        k = index
        while k < len(hops):
            step_id = self._next_id()
            pushing = self.sequence.push and k + 1 < len(hops)
            meta: dict = {"session": hops[k].session, "position": self._position}
            if pushing:
                meta["push"] = [[h.ticket, h.session, h.token] for h in hops[k + 1 :]]
            try:
                await hops[k].stream.send(Message("step", step_id, meta, _inputs(hidden, position_ids, mask)))
            except ShoalError as exc:
                raise _HopFailed(k, exc, outputs) from exc
            sent_to = k
            while True:  # replies of hop k, then of the hops it pushed to
                started = time.perf_counter()
                try:
                    reply = await self._reply(hops[k], step_id, n, pushed=k > sent_to)
                except _PushLost:
                    break  # the server lives but the push never reached it: send it the step ourselves
                except (ShoalError, TimeoutError) as exc:
                    raise _HopFailed(k, exc, outputs) from exc
                peer = hops[k].span.peer_id
                if n == 1:
                    self.directory.latency.observe_step(peer, (time.perf_counter() - started) * 1e3)
                self.directory.bans.succeeded(peer)
                hops[k].draining = bool(reply.meta.get("draining"))
                hidden = reply.tensors[0]
                outputs.append((k, hidden))
                k += 1
                if k == len(hops) or not pushing or reply.meta.get("pushed") is False:
                    break
        return outputs

    async def _reply(self, hop: _Hop, step_id: int, n: int, pushed: bool = False) -> Message:
        """The reply to step ``step_id`` from ``hop``. Late: ping the server; a live one gets more
        time (up to the request deadline), a dead one fails the hop. A live server late with a
        ``pushed`` step may never have received it: :class:`_PushLost` (the caller resends)."""
        estimate = self.directory.latency.step_estimate_ms(hop.span) / 1e3
        deadline = max(MIN_DEADLINE, DEADLINE_FACTOR * estimate) * max(1.0, n / 8)
        give_up = time.monotonic() + self.sequence.node.config.deadlines.request * max(1.0, n / 256)
        while True:
            if hop.pending is None:
                hop.pending = asyncio.get_running_loop().create_task(hop.stream.recv())
            done, _ = await asyncio.wait({hop.pending}, timeout=deadline)
            if not done:
                if time.monotonic() > give_up:
                    raise TimeoutError(f"no reply from {hop.span.peer_id[:10]} within the request deadline")
                if not await self.directory.alive(hop.span):
                    raise ClosedError(f"server {hop.span.peer_id[:10]} stopped answering")
                if pushed:
                    raise _PushLost()
                continue
            task, hop.pending = hop.pending, None
            message = task.result()  # raises ClosedError, WireError ...
            if message.id != step_id:
                continue  # a late reply to an earlier (abandoned) step
            if message.kind == "error":
                raise remote_error(*message.error_info())
            return message

    # ---- recovery ------------------------------------------------------------------------------

    async def _recover(self, index: int, cause: BaseException, failed: set[str], drain: bool = False) -> int:
        """Replace hop ``index``: re-plan the chain from its first block (or, when no route starts
        there, from an earlier hop's first block), reusing hops that hold the session and
        replaying history to new ones. A draining hop keeps serving until its replacement is
        ready, and stays if there is none. Returns the index of the first hop replaced."""
        if isinstance(cause, BadRequest):
            raise cause  # our request was wrong: another server would refuse it too
        broken = self._hops[index]
        failed.add(broken.span.peer_id)
        self.directory.bans.ban(broken.span.peer_id, 60.0 if drain else None)
        log.warning("server %s failed (%s); re-routing blocks %d+", broken.span.peer_id[:10], cause, broken.span.start)
        if broken.pending is not None:
            broken.pending.cancel()
            broken.pending = None
        if not drain:
            await broken.stream.abort()
        started = time.perf_counter()
        for _attempt in range(MAX_RECOVERIES):
            try:
                first, route = self._replan(index, failed)
            except NoRouteError as exc:
                if drain:  # nobody can take over yet: keep using the leaving server while it serves
                    broken.draining = False
                    log.warning("no replacement for draining server %s yet: %s", broken.span.peer_id[:10], exc)
                    return index
                raise _gave_up(self.directory, failed, broken.span.start, exc) from exc
            reusable = {hop.key: hop for i, hop in enumerate(self._hops) if i >= first and i != index}
            try:
                suffix, replayed = await self._rebuild(route, reusable)
            except _RebuildFailed as rebuild:
                failed.add(rebuild.span.peer_id)
                self.directory.bans.ban(rebuild.span.peer_id)
                log.warning("replacement %s failed: %s", rebuild.span.peer_id[:10], rebuild.cause)
                if isinstance(rebuild.cause, BadRequest):
                    raise rebuild.cause from None
                continue
            for hop in self._hops[first:]:
                if hop not in suffix and hop is not broken:
                    await self._close_hop(hop)
            if drain:
                await self._close_hop(broken)
            self._hops = self._hops[:first] + suffix
            self.sequence.chain = self.chain
            self.recoveries.append(
                {
                    "failed": broken.span.peer_id,
                    "blocks": [broken.span.start, broken.span.end],
                    "position": self._position,
                    "replayed": replayed,
                    "seconds": round(time.perf_counter() - started, 4),
                    "drain": drain,
                }
            )
            return first
        raise _gave_up(self.directory, failed, broken.span.start, cause)

    def _replan(self, index: int, failed: set[str]) -> tuple[int, list[ServerSpan]]:
        """(first hop replaced, new route from that hop's first block): from the failed hop if a
        route starts there, else from the nearest earlier hop where one does."""
        reuse = {hop.key for i, hop in enumerate(self._hops) if i != index}
        error: NoRouteError | None = None
        for first in range(index, -1, -1):
            try:
                route = self.directory.route_inference(
                    self._hops[first].span.start,
                    cache_tokens=self.cache_tokens,
                    push=self.sequence.push,
                    exclude=failed,
                    reuse=reuse,
                    replay_ms=REPLAY_MS,
                )
            except NoRouteError as exc:
                error = error or exc
                continue
            return first, route
        raise error

    async def _rebuild(self, route: list[ServerSpan], reusable: dict) -> tuple[list[_Hop], dict[str, int]]:
        """Hops for ``route``: reuse the ones holding the session, open and replay the others (in
        order: each replay's output is the history the next new hop needs). On failure, the hops
        opened here are closed again."""
        hops, opened, replayed = [], [], {}
        try:
            for span in route:
                reused = reusable.get((span.peer_id, span.start, span.end))
                if reused is not None:
                    hops.append(reused)
                    continue
                try:
                    hop = await self._open_hop(span, RECOVERY_TIMEOUT)
                except ShoalError as exc:
                    raise _RebuildFailed(span, exc) from exc
                opened.append(hop)
                try:
                    if self._position:
                        await self._replay(hop)
                        replayed[span.peer_id] = self._position
                except (ShoalError, TimeoutError) as exc:
                    raise _RebuildFailed(span, exc) from exc
                hops.append(hop)
        except _RebuildFailed:
            for hop in opened:
                await self._close_hop(hop)
            raise
        return hops, replayed

    async def _replay(self, hop: _Hop) -> None:
        """One step over positions ``[0, position)`` with the history at the hop's first block;
        its output becomes the history at the hop's end block (if that is new)."""
        history = self._history
        hidden = history.at(hop.span.start)
        if hidden is None or hidden.shape[1] != self._position:
            raise ShoalError(f"no history at block {hop.span.start} to replay (internal error)")
        mask = history.mask
        mask = None if mask is None or bool(mask.all()) else mask
        step_id = self._next_id()
        meta = {"session": hop.session, "position": 0}
        await hop.stream.send(Message("step", step_id, meta, _inputs(hidden, history.position_ids(), mask)))
        reply = await self._reply(hop, step_id, self._position)
        if hop.span.end not in history.hidden or not history.hidden[hop.span.end]:
            history.hidden[hop.span.end] = [reply.tensors[0]]


class _PushLost(Exception):
    """A pushed step's reply is late although its server answers pings."""


class _RebuildFailed(Exception):
    def __init__(self, span: ServerSpan, cause: BaseException):
        super().__init__(str(cause))
        self.span = span
        self.cause = cause


__all__ = ["RemoteSequence", "RemoteSession"]
