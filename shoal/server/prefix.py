"""A server's prefix cache: full KV pages of sessions, found again by a digest of the inputs that made them.

A session whose inputs start the same way as an earlier session's (a system prompt, a conversation
resent with one more turn) would recompute the very same keys and values. Instead, every FULL page of
every batch row is registered in a :class:`PrefixIndex` under a digest the server computes itself over
the bytes it decoded for those positions, and a later step whose inputs hash to the same digest adopts
the page (:meth:`PagedCache.adopt <shoal.models.kv.PagedCache.adopt>`) instead of computing it.

The digest of page ``k`` of a row is that row's chain at the page's end, the per-position chain of
:func:`shoal.verify.state.chain_states` (the code a receipt's ``state`` uses) seeded per span::

    c_0 = sha256("shoal/prefix/1" | blocks | adapter or "" | dtype | hidden size)[:16]
    c_{i+1} = sha256(c_i | hidden row i | position id i | mask value i)[:16]      d_k = c_{(k+1) P}

so a page's digest covers every input before it, at the positions it came at. It is never a client's
claim about tokens: other hidden states under the same positions (a forged prefix) hash elsewhere, so
nobody can plant pages another session will trust. Two more rules keep "same digest" meaning "same
keys and values": a step whose attention mask over the cached positions differs from the mask those
positions were computed with, or whose dtype differs from the session's, stops the session's chain
there (its later pages are neither looked up nor registered, until it rolls back before that point);
sessions with deep prompts never take part.

A page keeps the span's output rows for its positions, exactly what the server answered (in the
dtype the reply travelled in, before any codec): a hit answers those same bytes, so in a chain the
next server receives the inputs it saw the first time and finds its own pages; the client's history,
receipts and audits see nothing different.

Who may reuse a page: the peer(s) that sent those inputs, and anyone when the page lies within the
positions ``[0, share)`` its session's :class:`~shoal.wire.schema.OpenRequest` marked shareable. Hit
timing tells a client whether someone sent a prefix before, so another peer's prefix is reused only
when that peer chose to share it (a gateway's system prompt).

Closed sessions' registered pages stay: the index holds a reference to each, and pages held by
nobody else are the prefix cache, given back least-recently-used when the pool runs out
(``pool.reclaim``, called from the compute thread: the index is locked). A chain's first pages are
touched last, so its deepest pages go first (a page is useless without the pages before it). The
index holds at most one entry per page, so never more pages than the pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from shoal.verify.state import HASH_INLINE_BYTES, STATE_BYTES, chain_states
from shoal.wire.tensors import as_numpy

PREFIX_CONTEXT = b"shoal/prefix/1\0"

#: runs ``(hidden, position_ids, mask, past_length)`` through the span with the session's cache
RunStep = Callable[[Tensor, Tensor, "Tensor | None", int], Awaitable[Tensor]]


def prefix_seed(start: int, end: int, adapter: str | None, dtype: torch.dtype, hidden_size: int) -> bytes:
    """``c_0`` of every row's chain: which blocks, adapter and input dtype the pages were computed for."""
    tag = f"{start}:{end}\0{adapter or ''}\0{dtype}\0{hidden_size}".encode()
    return hashlib.sha256(PREFIX_CONTEXT + tag).digest()[:STATE_BYTES]


@dataclass(eq=False)
class PrefixEntry:
    """One registered page: its pool page, the span's output rows for its positions (``[P, H]``, CPU,
    the reply's dtype), who sent its inputs and whether anyone may reuse it."""

    page: int
    outputs: Tensor
    owner: str  # the peer that sent its inputs first
    shareable: bool


class PrefixIndex:
    """Digest -> :class:`PrefixEntry`, least recently used first; holds one pool reference per entry
    and installs itself as the pool's ``reclaim``."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.page_size: int = pool.page_size
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self._by_page: dict[int, bytes] = {}
        self._lock = threading.RLock()  # reclaim runs on the compute thread, the rest on the event loop
        pool.reclaim = self.reclaim

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        """Whether a shareable page, or any peer's own page, is kept under ``digest``."""
        return any(key[: len(digest)] == digest for key in self._entries)

    @staticmethod
    def _key(digest: bytes, peer: str | None) -> bytes:
        """A shareable page is kept under its digest; a peer's own page under the digest and the peer,
        so that another peer sending the same inputs registers (and is counted as) a page of its own:
        the counters must not tell it whether someone sent that prefix before."""
        return digest if peer is None else digest + b"\0" + peer.encode()

    def cached_pages(self) -> int:
        """Pages only the cache holds (no live session uses them): what :meth:`reclaim` can free."""
        with self._lock:
            return sum(1 for entry in self._entries.values() if self.pool.refcount(entry.page) == 1)

    def lookup(self, digest: bytes, peer: str) -> PrefixEntry | None:
        """The entry ``peer`` may reuse under ``digest``: its own, else a shareable one (not touched:
        see :meth:`adopt`)."""
        entry = self._entries.get(self._key(digest, peer))
        return entry if entry is not None else self._entries.get(digest)

    def adopt(
        self, cache: Any, position: int, digests: Sequence[Sequence[bytes]], peer: str
    ) -> list[list[PrefixEntry]]:
        """The hits of a step at ``position`` (a page boundary): ``digests[k][r]`` is row ``r``'s digest
        of the step's ``k``-th full page. Successive pages hit while every row's does; those pages are
        adopted by every row of ``cache`` (rolled back to ``position`` first) under the lock, so a
        reclaim cannot free one in between. Returns the hit entries, ``[page][row]``."""
        with self._lock:
            hits: list[list[PrefixEntry]] = []
            for page_digests in digests:
                entries = [self.lookup(digest, peer) for digest in page_digests]
                if any(entry is None for entry in entries):
                    break
                hits.append(entries)  # type: ignore[arg-type]
            if not hits:
                return hits
            cache.truncate(position)  # also drops pages a failed step took past it
            for row in range(len(hits[0])):
                cache.adopt(row, [page[row].page for page in hits])
            cache.length = position + len(hits) * self.page_size
            self._touch([[e for e in page] for page in hits])
            return hits

    def touch(self, chains: Sequence[Sequence[bytes]], peer: str) -> None:
        """Mark ``peer``'s pages used (``chains[k][r]``: page ``k`` of row ``r``), the first most recently."""
        with self._lock:
            found = [[self.lookup(d, peer) for d in page] for page in chains]
            self._touch([[entry for entry in page if entry is not None] for page in found])

    def _touch(self, pages: Sequence[Sequence[PrefixEntry]]) -> None:
        for page in reversed(pages):
            for entry in page:
                self._entries.move_to_end(self._by_page[entry.page])

    def register(self, digest: bytes, page: int, outputs: Tensor, owner: str, shareable: bool) -> bool:
        """Keep ``page`` (a full page whose inputs hash to ``digest``) for reuse, by ``owner`` only or,
        ``shareable``, by anyone; False when such an entry is known already (a shareable one then
        is reused, not replaced) or the page is registered under another."""
        key = self._key(digest, None if shareable else owner)
        with self._lock:
            known = self._entries.get(key)
            if known is not None:
                return False
            if page in self._by_page:
                return False
            self.pool.retain(page)
            self._entries[key] = PrefixEntry(page, outputs, owner, shareable)
            self._by_page[page] = key
            return True

    def reclaim(self, wanted: int) -> int:
        """Give back up to ``wanted`` pages nobody but the cache holds, least recently used first."""
        released = 0
        with self._lock:
            for digest in list(self._entries):
                if released >= wanted:
                    break
                entry = self._entries[digest]
                if self.pool.refcount(entry.page) != 1:
                    continue  # a live session uses it: dropping the entry frees nothing
                del self._entries[digest], self._by_page[entry.page]
                self.pool.release(entry.page)
                released += 1
        return released

    def clear(self) -> None:
        """Drop every entry (the pool gets its references back)."""
        with self._lock:
            for entry in self._entries.values():
                self.pool.release(entry.page)
            self._entries.clear()
            self._by_page.clear()


@dataclass
class _Row:
    """One batch row's chain ``c_0 .. c_known``, the mask values its positions were computed with, and
    the output rows of its page not yet full (positions ``[registered * P, known)``)."""

    states: bytearray
    mask: bytearray = field(default_factory=bytearray)
    tail: np.ndarray | None = None


@dataclass(frozen=True)
class _Plan:
    """What a step's inputs hash to, per row (``None``: the step does not extend the chain)."""

    position: int
    states: list[bytes] | None
    masks: list[bytes]


class SessionPrefix:
    """One session's part in the prefix cache: each row's chain, and which pages it registered."""

    def __init__(self, batch_size: int, page_size: int, seed: Callable[[torch.dtype], bytes], peer: str, share: int):
        self.page_size, self.peer, self.share = page_size, peer, share
        self._seed = seed
        self.dtype: torch.dtype | None = None
        self.known = 0  # positions [0, known) of every row are in the chains
        self.registered = 0  # leading pages of every row already offered to the index
        self.rows = [_Row(bytearray()) for _ in range(batch_size)]

    def truncate(self, position: int, index: PrefixIndex) -> None:
        """Positions from ``position`` on are no longer what the chains say (a rollback, a failed step).
        Rolled back into a registered page, a row gets that page's first output rows back from the
        index; where the entry is gone, the chains stop at the page's start instead."""
        if position >= self.known:
            return
        size = self.page_size
        page = position // size
        tails: list[np.ndarray | None] = []
        if page < self.registered:
            for row in self.rows:
                entry = index.lookup(bytes(row.states[(page + 1) * size * STATE_BYTES :][:STATE_BYTES]), self.peer)
                tails.append(None if entry is None else as_numpy(entry.outputs)[: position - page * size].copy())
            if any(tail is None for tail in tails):
                position, tails = page * size, []
        else:
            tails = [None if row.tail is None else row.tail[: position - self.registered * size] for row in self.rows]
        self.known, self.registered = position, min(self.registered, page)
        for row, tail in zip(self.rows, tails or [None] * len(self.rows), strict=True):
            del row.states[(position + 1) * STATE_BYTES :]
            del row.mask[position:]
            row.tail = tail

    async def plan(self, position: int, hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> _Plan:
        """Hash the step's inputs (off the event loop when large, as receipts' chains are)."""
        n = hidden.shape[1]
        masks = [bytes(np.ones(n, np.uint8)) if mask is None else
                 as_numpy(mask[r, position:]).astype(np.uint8).tobytes() for r in range(len(self.rows))]  # fmt: skip
        if position > self.known or not self._consistent(position, hidden.dtype, mask):
            return _Plan(position, None, masks)
        if position == 0:
            self.dtype = hidden.dtype
            self.rows = [_Row(bytearray(self._seed(hidden.dtype))) for _ in self.rows]
            self.known = self.registered = 0
        previous = [bytes(row.states[position * STATE_BYTES : (position + 1) * STATE_BYTES]) for row in self.rows]
        if hidden.numel() * hidden.element_size() <= HASH_INLINE_BYTES:
            return _Plan(position, _row_states(previous, hidden, position_ids, mask, position), masks)
        states = await asyncio.to_thread(_row_states, previous, hidden, position_ids, mask, position)
        return _Plan(position, states, masks)

    def _consistent(self, position: int, dtype: torch.dtype, mask: Tensor | None) -> bool:
        """Whether a step's keys/values will be what the chain says: same dtype, and the mask over
        the cached positions the one they were computed with."""
        if position == 0:
            return True
        if dtype != self.dtype:
            return False
        for r, row in enumerate(self.rows):
            seen = b"\x01" * position if mask is None else as_numpy(mask[r, :position]).astype(np.uint8).tobytes()
            if seen != bytes(row.mask[:position]):
                return False
        return True

    def page_digests(self, plan: _Plan, n: int) -> list[list[bytes]]:
        """``[k][r]``: each row's digest of the ``k``-th full page starting at the step's position."""
        if plan.states is None or plan.position % self.page_size:
            return []
        size, pages = self.page_size, n // self.page_size
        return [[states[((k + 1) * size - 1) * STATE_BYTES : (k + 1) * size * STATE_BYTES] for states in plan.states]
                for k in range(pages)]  # fmt: skip

    async def step(
        self, index: PrefixIndex, cache: Any, position: int, hidden: Tensor, position_ids: Tensor,
        mask: Tensor | None, run: RunStep,
    ) -> tuple[Tensor, int]:  # fmt: skip
        """One step through the prefix cache: adopt the pages that hit, compute the rest through
        ``run`` (from the first missed position, the mask still covering ``[0, past + n)``), register
        the pages that became full. Returns the output and how many positions were not recomputed."""
        n = hidden.shape[1]
        self.truncate(position, index)  # first: the plan extends the chains from what they hold then
        plan = await self.plan(position, hidden, position_ids, mask)
        hits = index.adopt(cache, position, self.page_digests(plan, n), self.peer)
        reused = len(hits) * self.page_size
        try:
            if reused < n:
                rest = await run(hidden[:, reused:], position_ids[:, reused:], mask, position + reused)
        except BaseException:
            if hits:
                cache.truncate(position)
            raise
        out = _joined(hits, rest if reused < n else None, hidden)
        self._commit(index, cache, plan, out, n, len(hits))
        return out, reused

    def _commit(self, index: PrefixIndex, cache: Any, plan: _Plan, out: Tensor, n: int, hit_pages: int) -> None:
        """Extend the chains by a step that ran, and register the pages it filled."""
        if plan.states is None:  # the cache past ``position`` is in no state the chains name
            return
        size, position = self.page_size, plan.position
        self.known = position + n
        first = self.registered = self.registered + hit_pages  # hit pages are registered already
        full = self.known // size
        for r, row in enumerate(self.rows):
            row.states += plan.states[r]
            row.mask += plan.masks[r]
            new = as_numpy(out[r, hit_pages * size :])
            row.tail = new if row.tail is None or not len(row.tail) else np.concatenate([row.tail, new])
            for k in range(first, full):
                digest = bytes(row.states[(k + 1) * size * STATE_BYTES : ((k + 1) * size + 1) * STATE_BYTES])
                rows = row.tail[(k - first) * size : (k - first + 1) * size].copy()
                index.register(digest, cache.tables[r][k], torch.from_numpy(rows).view(out.dtype), self.peer,
                               (k + 1) * size <= self.share)  # fmt: skip
            row.tail = row.tail[(full - first) * size :].copy()
        self.registered = full
        if full > first:  # the whole chain again, its first page last: reclaim takes the deepest first
            index.touch([[bytes(row.states[(k + 1) * size * STATE_BYTES : ((k + 1) * size + 1) * STATE_BYTES])
                          for row in self.rows] for k in range(full)], self.peer)  # fmt: skip


def _row_states(
    previous: list[bytes], hidden: Tensor, position_ids: Tensor, mask: Tensor | None, position: int
) -> list[bytes]:
    """Each row's chain digests of the step's positions (:func:`~shoal.verify.state.chain_states`)."""
    columns = [None if mask is None else mask[r : r + 1, position:] for r in range(len(previous))]
    return [chain_states(c, hidden[r : r + 1], position_ids[r : r + 1], columns[r]) for r, c in enumerate(previous)]


def _joined(hits: list[list[PrefixEntry]], rest: Tensor | None, hidden: Tensor) -> Tensor:
    """The step's output: the hit pages' stored rows, then what was computed (numpy: no torch
    kernel on the event loop)."""
    if not hits:
        assert rest is not None
        return rest
    parts = [np.stack([as_numpy(page[r].outputs) for page in hits]).reshape(-1, hidden.shape[2])
             for r in range(hidden.shape[0])]  # fmt: skip
    stored = np.stack(parts)
    if rest is not None:
        stored = np.concatenate([stored, as_numpy(rest)], axis=1)
    return torch.from_numpy(np.ascontiguousarray(stored)).view(hidden.dtype if rest is None else rest.dtype)


__all__ = ["PREFIX_CONTEXT", "PrefixEntry", "PrefixIndex", "SessionPrefix", "prefix_seed"]
