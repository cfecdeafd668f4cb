"""A shoal block server whose behaviour is altered on purpose, built from an honest one at the seams
that exist already, without a flag or hook in ``shoal/``:

* the backend: :class:`FaultyBackend` takes the place of the server's :class:`SpanBackend` (same
  interface; its input checks and cache allocation pass through unchanged) and alters what a step
  computes (skipped or re-weighted blocks, a stale cache) or returns (noise, zeros, its input);
* the streams the server answers on: :class:`~testkit.faulty_streams.FaultyStream` delays or drops
  replies;
* the node the server pushes through: :class:`~testkit.faulty_streams.FaultyNode` hands out push
  streams that carry another tensor to the next server than the one the client gets (equivocation).

The three share a :class:`FaultState`: the faults, the :class:`~testkit.faults.FaultRecord`, and the
outputs in flight (found again by identity when the server sends them: the reply and the push carry
the very tensor :meth:`FaultyBackend.run` returned).

    # an iroh node on loopback answering the blocks protocol with a server built for it
    local = await serve_locally(lambda node: make_faulty(load_block_server(checked, span, node), [Noise(0.1)]))
    ... drive it ...; local.server.record.entries("noise")
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.launch.inprocess import LOOPBACK
from shoal.server.backend import SpanBackend
from shoal.server.handler import BlockServer
from shoal.server.presence import LoadingGate
from shoal.transport import BaseNode, MemoryNetwork, MessageStream, Node, Ticket, TransportConfig
from shoal.wire.messages import FRAME_HEAD, FRAME_PREFIX
from testkit.faults import (
    BLOCK_FAULTS,
    CRASH_EXIT_CODE,
    OUTPUT_FAULTS,
    Alteration,
    Crash,
    DropReply,
    Equivocate,
    Fault,
    FaultRecord,
    Identity,
    Malformed,
    OtherWeights,
    ReplyDelay,
    SkipBlock,
    StaleCache,
    Zeros,
    fault_name,
)
from testkit.faulty_streams import FaultyNode, FaultyStream

_MAX_IN_FLIGHT = 64  # outputs remembered until their reply goes out (bounded: some never do)


@dataclass(frozen=True)
class _Call:
    """One run of the span: which session (None: a forward), which step of it, which positions."""

    session: int | None
    step: int
    positions: tuple[int, int]


@dataclass
class _Issued:
    """An output on its way out, and what the stream seams must do with it."""

    tensor: torch.Tensor
    call: _Call
    drop: bool = False
    push: torch.Tensor | None = None  # equivocation: what the next server gets instead
    garbage: bytes | None = None  # malformed: the frame sent instead of the reply
    push_size: float | None = None


def garbage_frame(rng: random.Random, size: int = 64) -> bytes:
    """A header frame of ``size`` random bytes: well framed, no message (a malformed reply)."""
    return FRAME_PREFIX.pack(size + 1, FRAME_HEAD) + rng.randbytes(size)


class FaultState:
    """What the backend, stream and node seams of one faulty server share."""

    def __init__(self, faults: list[Fault], record: FaultRecord, exit_on_crash: bool):
        self.faults = faults
        self.record = record
        self.exit_on_crash = exit_on_crash
        self.delay = sum(f.seconds for f in faults if isinstance(f, ReplyDelay))
        self.crashed = False
        self.node: BaseNode | None = None  # the real node (an in-process crash closes it)
        self._issued: OrderedDict[int, _Issued] = OrderedDict()
        self._closing: asyncio.Task | None = None

    def issue(self, issued: _Issued) -> None:
        self._issued[id(issued.tensor)] = issued  # the entry holds the tensor: its id is not reused meanwhile
        while len(self._issued) > _MAX_IN_FLIGHT:
            self._issued.popitem(last=False)

    def find(self, tensor: torch.Tensor, remove: bool = False) -> _Issued | None:
        issued = self._issued.get(id(tensor))
        if issued is None or issued.tensor is not tensor:
            return None
        if remove:
            del self._issued[id(tensor)]
        return issued

    def crash(self, call: _Call) -> None:
        self.record.add(Alteration(fault="crash", step=call.step, session=call.session, positions=call.positions))
        if self.exit_on_crash:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)
        self.crashed = True
        if self.node is not None:  # drops every connection at once
            self._closing = asyncio.get_running_loop().create_task(self.node.close())


class _Skipped(nn.Module):
    """Stands in for a skipped block: hands its input on."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


def perturbed_copy(layer: nn.Module, relative: float, seed: int) -> nn.Module:
    """A copy of ``layer`` whose every floating tensor has Gaussian noise of norm
    ``relative * ||tensor||`` added (parameters in ``named_parameters`` order, one generator)."""
    layer = copy.deepcopy(layer)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in layer.named_parameters():
            if param.is_floating_point():
                noise = torch.randn(param.shape, generator=generator)
                scale = relative * param.float().norm() / noise.norm().clamp_min(1e-30)
                param.add_((noise * scale).to(param.device, param.dtype))
    return layer


def _relative_change(after: torch.Tensor, before: torch.Tensor) -> float:
    before = before.float()
    return float((after.float() - before).norm() / before.norm().clamp_min(1e-30))


def _held_pages(cache: Any, start: int, end: int):
    """What ``cache``'s pages hold at positions ``[start, end)``, and a function that puts it back
    after a step wrote there (a page taken by the step, or its copy on write, gets what the page
    it replaces held; a new one zeros, as a page is handed out)."""
    pool, size = cache.pool, cache.pool.page_size
    first, last = start // size, -(-end // size)
    parts = pool.keys + pool.values
    saved = {(r, k): [t[table[k] * size : (table[k] + 1) * size].clone() for t in parts]
             for r, table in enumerate(cache.tables) for k in range(first, min(last, len(table)))}  # fmt: skip

    def restore() -> None:
        for r, table in enumerate(cache.tables):
            for k in range(first, min(last, len(table))):
                page = table[k]
                for t, held in zip(parts, saved.get((r, k)) or [None] * len(parts), strict=True):
                    if held is None:
                        t[page * size : (page + 1) * size].zero_()
                    else:
                        t[page * size : (page + 1) * size] = held

    return restore


class FaultyBackend:
    """A :class:`SpanBackend` stand-in that runs the real one and alters the step as the faults say.

    Runs one step at a time: a block fault swaps a layer of the span for its run only. A stale-cache
    step copies the session's pages it writes on the event loop thread and puts them back after
    (fine for tests, not for timing)."""

    def __init__(self, inner: SpanBackend, state: FaultState):
        self.inner = inner
        self.span = inner.span
        self.hidden_size = inner.hidden_size
        self.device = inner.device
        self._state = state
        self._lock = asyncio.Lock()
        self._next_step: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # per session cache
        self._session_ids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._forwards = 0
        self._sessions_seen = 0
        faults = state.faults
        self._draws = {i: random.Random(f.when.seed) for i, f in enumerate(faults) if hasattr(f, "when")}
        self._noise = {i: torch.Generator().manual_seed(f.seed) for i, f in enumerate(faults) if hasattr(f, "seed")}
        self._blocks = (self.span.start, self.span.end)
        self._replacements: dict[int, nn.Module] = {}
        for i, fault in enumerate(faults):
            if isinstance(fault, BLOCK_FAULTS):
                layers = self._layers()
                if not self.span.start <= fault.block < self.span.end:
                    raise ValueError(f"{fault}: block {fault.block} is not in the span {self._blocks}")
                original = layers[fault.block - self.span.start]
                is_skip = isinstance(fault, SkipBlock)
                self._replacements[i] = _Skipped() if is_skip else perturbed_copy(original, fault.relative, fault.seed)

    # ---- passed through -----------------------------------------------------------------------
    def check_inputs(self, *args: Any, **kwargs: Any):
        return self.inner.check_inputs(*args, **kwargs)

    async def allocate_cache(self, batch_size: int, max_length: int):
        async with self._lock:  # not while a layer is swapped out (the cache asks the layers for their device)
            return await self.inner.allocate_cache(batch_size, max_length)

    def warm_up(self, tokens: int = 8) -> None:
        self.inner.warm_up(tokens)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # anything else a server may read
        return getattr(self.inner, name)

    # ---- altered ------------------------------------------------------------------------------
    def _layers(self) -> nn.ModuleList:
        layers = getattr(self.span, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"block faults need a span with a `layers` ModuleList, not {type(self.span).__name__}")
        return layers

    def _call(self, cache: Any, past_length: int, n: int) -> _Call:
        positions = (past_length, past_length + n)
        if cache is None:
            return _Call(None, self._forwards, positions)
        if cache not in self._session_ids:
            self._session_ids[cache] = self._sessions_seen
            self._sessions_seen += 1
        return _Call(self._session_ids[cache], self._next_step.get(cache, 0), positions)

    def _commit(self, cache: Any, call: _Call) -> None:
        if cache is None:
            self._forwards += 1
        else:
            self._next_step[cache] = call.step + 1

    def _hits(self, call: _Call) -> list[tuple[int, Fault]]:
        hits = []
        for i, fault in enumerate(self._state.faults):
            when = getattr(fault, "when", None)
            if when is None or not when.selects(call.step, call.positions):
                continue
            if when.probability < 1.0 and self._draws[i].random() >= when.probability:
                continue
            hits.append((i, fault))
        return hits

    def _note(self, fault: Fault, call: _Call, **fields: Any) -> None:
        entry = Alteration(fault=fault_name(fault), step=call.step, session=call.session, **fields)
        self._state.record.add(entry)

    async def run(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Any = None,
        past_length: int = 0,
        **options: Any,  # prompts, adapter: passed on
    ) -> torch.Tensor:
        state = self._state
        async with self._lock:
            call = self._call(cache, past_length, hidden.shape[1])
            crashes = [f for f in state.faults if isinstance(f, Crash) and f.step == call.step]
            if state.crashed or (crashes and call.session is not None):
                if not state.crashed:
                    state.crash(call)
                await asyncio.Future()  # never answers; the closing node cancels this task
            hits = self._hits(call)
            stale = cache is not None and any(isinstance(f, StaleCache) for _, f in hits)
            restore = _held_pages(cache, past_length, past_length + hidden.shape[1]) if stale else None
            layers = self._layers() if any(isinstance(f, BLOCK_FAULTS) for _, f in hits) else None
            swapped = []
            try:
                for i, fault in hits:
                    if isinstance(fault, BLOCK_FAULTS):
                        index = fault.block - self.span.start
                        swapped.append((index, layers[index]))
                        layers[index] = self._replacements[i]
                out = await self.inner.run(hidden, position_ids, mask, cache, past_length, **options)
            finally:
                for index, original in reversed(swapped):
                    layers[index] = original
            self._commit(cache, call)
            if restore is not None:
                restore()  # the session moves on; its slots keep what they held
            if any(isinstance(f, OUTPUT_FAULTS) for _, f in hits):
                out = out.clone()  # the span's output is an inference tensor: not writable out here
            issued = _Issued(out, call)
            for i, fault in hits:
                self._apply(i, fault, call, hidden, issued)
            seams = issued.drop or issued.push is not None or issued.garbage is not None or state.delay
            if seams:  # the stream seams look for it
                state.issue(issued)
            return issued.tensor

    async def run_blocks(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, start: int, end: int,
        **options: Any,
    ) -> torch.Tensor:  # fmt: skip
        """A forward over part of the span (a piece of an audit's cover): the output faults apply as
        to a whole forward (a liar lies on pieces too); the others are for whole passes."""
        async with self._lock:
            call = self._call(None, 0, hidden.shape[1])
            hits = [(i, f) for i, f in self._hits(call) if isinstance(f, OUTPUT_FAULTS)]
            out = await self.inner.run_blocks(hidden, position_ids, mask, start, end, **options)
            self._commit(None, call)
            issued = _Issued(out.clone() if hits else out, call)
            for i, fault in hits:
                self._apply(i, fault, call, hidden, issued)
            return issued.tensor

    def _apply(self, i: int, fault: Fault, call: _Call, hidden: torch.Tensor, issued: _Issued) -> None:
        """Alter ``issued`` (its output, what it pushes, whether it is dropped) by one hit fault."""
        start, end = call.positions
        if isinstance(fault, SkipBlock):
            self._note(fault, call, positions=call.positions, blocks=(fault.block, fault.block + 1),
                       detail=f"block {fault.block} skipped")  # fmt: skip
        elif isinstance(fault, OtherWeights):
            detail = f"block {fault.block} ran with weights perturbed by {fault.relative:g} (seed {fault.seed})"
            self._note(fault, call, positions=call.positions, blocks=(fault.block, fault.block + 1), detail=detail)
        elif isinstance(fault, StaleCache):
            self._note(fault, call, positions=call.positions, blocks=self._blocks,
                       detail=f"cache positions {start}:{end} not written")  # fmt: skip
        elif isinstance(fault, OUTPUT_FAULTS):
            first = max(0, fault.when.from_position - start)  # output index of the first position hit
            out = issued.tensor
            before = out[:, first:].clone()
            if isinstance(fault, Zeros):
                out[:, first:] = 0
            elif isinstance(fault, Identity):
                out[:, first:] = hidden[:, first:].to(out.dtype)
            else:
                out[:, first:] = before + self._noise_like(i, before, fault.relative).to(out.dtype)
            size = _relative_change(out[:, first:], before)
            self._note(fault, call, positions=(start + first, end), blocks=self._blocks, size=size,
                       detail=f"{fault_name(fault)} on positions {start + first}:{end}")  # fmt: skip
        elif isinstance(fault, Equivocate):
            first = max(0, fault.when.from_position - start)
            pushed = issued.tensor.clone()
            honest = pushed[:, first:].clone()
            pushed[:, first:] = honest + self._noise_like(i, honest, fault.relative).to(pushed.dtype)
            issued.push, issued.push_size = pushed, _relative_change(pushed, issued.tensor)
        elif isinstance(fault, DropReply):
            issued.drop = True
        elif isinstance(fault, Malformed):
            issued.garbage = garbage_frame(random.Random(f"{fault.seed}:{call.session}:{call.step}"))

    def _noise_like(self, i: int, honest: torch.Tensor, relative: float) -> torch.Tensor:
        noise = torch.randn(honest.shape, generator=self._noise[i])
        return noise * (relative * honest.float().norm() / noise.norm().clamp_min(1e-30))


class FaultyBlockServer(BlockServer):
    """A :class:`BlockServer` answering through the fault seams. Made by :func:`make_faulty`."""

    fault_state: FaultState

    @property
    def record(self) -> FaultRecord:
        return self.fault_state.record

    async def handle(self, stream: MessageStream, peer_id: str, client_refusal: str | None = None) -> None:
        await super().handle(FaultyStream(stream, self.fault_state), peer_id, client_refusal)


def make_faulty(
    server: BlockServer, faults: list[Fault], record: FaultRecord | None = None, *, exit_on_crash: bool = False
) -> FaultyBlockServer:
    """``server`` with ``faults`` applied: the same span, budget, counters and sessions (the returned
    object takes over the server's state; use it instead of ``server``). ``exit_on_crash``: a
    :class:`~testkit.faults.Crash` ends the process (else it closes the node)."""
    state = FaultState(list(faults), record if record is not None else FaultRecord(), exit_on_crash)
    faulty = FaultyBlockServer.__new__(FaultyBlockServer)
    faulty.__dict__.update(vars(server))
    faulty.fault_state = state
    faulty.backend = FaultyBackend(server.backend, state)
    node = state.node = server.pusher.node
    if node is not None:  # its pushes leave through the node seam
        faulty.pusher = server.pusher.via(FaultyNode(node, state))
    return faulty


@dataclass
class LocalServer:
    """A block server answering on a node of this process."""

    server: BlockServer
    node: BaseNode

    @property
    def ticket(self) -> Ticket:
        return self.node.ticket()

    async def close(self) -> None:
        await self.node.close()
        self.server.backend.shutdown()


async def serve_locally(
    build: Callable[[BaseNode], BlockServer],
    network: MemoryNetwork | None = None,
    transport: TransportConfig = LOOPBACK,
) -> LocalServer:
    """Serve the server ``build`` makes for a new node in this process (faulty or not): of
    ``network`` (the in-memory transport), or an iroh node on loopback without one. The node answers
    ``busy`` until the server is built (as ``shoal serve``'s does while it loads)."""
    gate = LoadingGate()
    handlers = gate.handlers(swarm=False)
    node = await (network.start(transport, handlers) if network is not None else Node.start(transport, handlers))
    gate.server = build(node)
    return LocalServer(gate.server, node)
