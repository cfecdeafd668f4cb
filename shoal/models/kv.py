"""Paged KV cache: one pool of fixed-size pages per span, shared by all its sessions.

A session's cache (:class:`PagedCache`) is a page table per batch row; pages are taken from the pool as
the session grows, so a session opened for 4,096 positions holds only the pages its positions need.
Pages are reference counted: a server's prefix cache (:mod:`shoal.server.prefix`) keeps the full pages
of closed sessions and lends them to sessions whose inputs start the same way. A shared page is never
written: a session about to write one gets a private copy first (copy-on-write).

Every cached step of every family runs through :class:`PackedSteps`: the steps of several sessions
(any mix of past lengths, new tokens and batch sizes) laid out as one padded batch, with the page slots
each row reads and writes and a 4D mask per attention window that gives every row exactly the positions
it would see alone (so a batched step equals each session's solo step within float noise). A solo step
is a batch of one: one code path. The layers see :class:`PagedStep` as their cache: ``update`` writes
the new keys/values into the rows' pages and returns every row's keys/values gathered from its pages
(padded with the pool's zero page, masked out).

Layout: per block, keys and values are ``[slots, kv_heads, head_dim]`` with ``slot = page * page_size +
offset``; page 0 is all zeros and never handed out (what padding reads).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shoal.errors import ShoalError
from shoal.models.base import CacheGeometry

DEFAULT_PAGE_SIZE = 16  # tokens per page: 16 wastes < 16 positions a row, and a decode step's gather stays cheap

ZERO_PAGE = 0


class PagesExhausted(ShoalError, RuntimeError):
    """The pool has no free page (and the prefix cache could not give one back)."""


class PagePool:
    """Every block's keys/values as pages of ``page_size`` positions, with reference counts.

    ``reclaim(wanted) -> released`` (set by a server's prefix cache) is asked for pages when none is
    free; it drops least-recently-used cached pages. Tensors are allocated empty (memory is committed as
    pages are first used) and a page is zeroed when handed out: a padded read of an unwritten position
    must never see a NaN another session left behind."""

    def __init__(self, num_blocks: int, geometry: CacheGeometry, page_size: int, num_pages: int, device):
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"a page pool needs page_size >= 1 and num_pages >= 1, got {page_size}, {num_pages}")
        self.page_size, self.num_pages, self.geometry = page_size, num_pages, geometry
        shape = ((num_pages + 1) * page_size, geometry.num_kv_heads, geometry.head_dim)
        self.keys = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(num_blocks)]
        self.values = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(num_blocks)]
        for tensor in self.keys + self.values:
            tensor[:page_size].zero_()
        self.page_nbytes = num_blocks * page_size * geometry.bytes_per_token_per_block()
        self._refs = [0] * (num_pages + 1)
        self._free = list(range(num_pages, 0, -1))  # a stack: low pages first
        self.reclaim: Callable[[int], int] | None = None
        # sessions adopt and release pages on the event loop while the compute thread takes them
        self._lock = threading.RLock()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self) -> int:
        """A zeroed page, referenced once (tensor work: call it on the compute thread)."""
        if not self._free and self.reclaim is not None:  # outside the lock: reclaim takes the index's first
            self.reclaim(1)
        with self._lock:
            if not self._free:
                raise PagesExhausted(f"all {self.num_pages} KV pages of {self.page_size} positions are in use")
            page = self._free.pop()
            self._refs[page] = 1
        slots = slice(page * self.page_size, (page + 1) * self.page_size)
        for tensor in self.keys + self.values:
            tensor[slots].zero_()
        return page

    def retain(self, page: int) -> None:
        with self._lock:
            if self._refs[page] <= 0 or page == ZERO_PAGE:
                raise ValueError(f"page {page} is not held: it cannot be shared")
            self._refs[page] += 1

    def release(self, page: int) -> None:
        with self._lock:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} released more often than held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def copy_page(self, source: int) -> int:
        """A new page holding ``source``'s keys and values (copy-on-write)."""
        page = self.allocate()
        size = self.page_size
        for tensor in self.keys + self.values:
            tensor[page * size : (page + 1) * size] = tensor[source * size : (source + 1) * size]
        return page


class PagedCache:
    """One session's KV cache on a :class:`PagePool`: a page table per batch row.

    Positions ``[0, length)`` are valid; a step may start at any ``past_length <= length`` (stepping
    again from an earlier position rolls back)."""

    def __init__(self, pool: PagePool, batch_size: int, max_length: int):
        self.pool, self.batch_size, self.max_length = pool, batch_size, max_length
        self.length = 0
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]
        self.closed = False

    def pages_held(self) -> int:
        return sum(len(table) for table in self.tables)

    def nbytes(self) -> int:
        return self.pages_held() * self.pool.page_nbytes

    def truncate(self, length: int) -> None:
        """Forget positions ``>= length``: pages wholly past it go back to the pool."""
        keep = math.ceil(length / self.pool.page_size)
        for table in self.tables:
            while len(table) > keep:
                self.pool.release(table.pop())
        self.length = min(self.length, length)

    def prepare(self, past_length: int, end: int) -> None:
        """Make positions ``[past_length, end)`` writable in every row: roll back to ``past_length``,
        take the pages still missing (all or nothing: :class:`PagesExhausted` takes none) and replace
        any shared page those positions fall in by a private copy. Tensor work: compute thread."""
        if self.closed:
            raise ValueError("the cache is closed")
        if not 0 <= past_length <= self.length:
            raise ValueError(f"past_length {past_length} outside the cached [0, {self.length}]")
        if end > self.max_length:
            raise ValueError(f"positions up to {end} exceed the cache's {self.max_length}")
        if past_length < self.length:
            self.truncate(past_length)
        size, pool = self.pool.page_size, self.pool
        need = math.ceil(end / size)
        first = past_length // size  # the first page written
        shared = [(r, k) for r, table in enumerate(self.tables) for k in range(first, min(len(table), need))
                  if pool.refcount(table[k]) > 1]  # fmt: skip
        missing = sum(max(0, need - len(table)) for table in self.tables) + len(shared)
        if missing > pool.free_pages and pool.reclaim is not None:
            pool.reclaim(missing - pool.free_pages)
        if missing > pool.free_pages:
            raise PagesExhausted(
                f"a step to position {end} needs {missing} more KV pages; "
                f"{pool.free_pages} of {pool.num_pages} are free"
            )
        for r, k in shared:
            page = self.tables[r][k]
            self.tables[r][k] = pool.copy_page(page)
            pool.release(page)
        for table in self.tables:
            while len(table) < need:
                table.append(pool.allocate())

    def adopt(self, row: int, pages: Sequence[int]) -> None:
        """Row ``row`` takes these full pages as its next positions (a prefix hit): each is retained.
        The row must hold whole pages only; the caller sets :attr:`length` once every row has them."""
        table = self.tables[row]
        if len(table) * self.pool.page_size != self.length:
            raise ValueError(f"row {row} holds a partial page: it cannot adopt more")
        for page in pages:
            self.pool.retain(page)
            table.append(page)

    def close(self) -> None:
        """Give every page back (idempotent)."""
        self.truncate(0)
        self.closed = True


@dataclass(frozen=True)
class CachedStep:
    """One session's step in a batch: new ``hidden`` ``[b, n, H]`` at ``position_ids`` ``[b, n]``,
    ``attention_mask`` ``[b, past_length + n]`` (None: no padding), written into ``cache`` from
    ``past_length``."""

    hidden: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    cache: PagedCache
    past_length: int


class PackedSteps:
    """Several steps as one padded batch: ``hidden`` ``[rows, n_max, H]``, the slots each row reads
    (``[rows, G]``, G a multiple of the page size covering the longest row) and writes, and masks.

    Building it takes each step's pages (:meth:`PagedCache.prepare`; :class:`PagesExhausted` if the
    pool runs out). Rows are the steps' batch rows in order. A row with fewer new tokens than ``n_max`` is padded: its
    padded queries attend to position 0 only and write nothing; their outputs are dropped."""

    def __init__(self, steps: Sequence[CachedStep], device):
        if not steps:
            raise ValueError("no steps to run")
        pool = steps[0].cache.pool
        if any(step.cache.pool is not pool for step in steps):
            raise ValueError("steps of one batch must share a page pool")
        if len({step.hidden.dtype for step in steps}) > 1:
            raise ValueError("steps of one batch must send the same dtype (one input buffer)")
        self.steps, self.pool = list(steps), pool
        for step in steps:  # the pages each step writes (a no-op where the scheduler took them already)
            step.cache.prepare(step.past_length, step.past_length + step.hidden.shape[1])
        size = pool.page_size
        counts = [step.hidden.shape[1] for step in steps]
        self.n_max = n_max = max(counts)
        rows = [(step, r) for step in steps for r in range(step.hidden.shape[0])]
        past = torch.tensor([step.past_length for step, _ in rows], device=device)
        new = torch.tensor([step.hidden.shape[1] for step, _ in rows], device=device)
        ends = past + new
        self.past, self.ends = past, ends
        pages = math.ceil(int(ends.max()) / size)
        self.kv_length = pages * size
        tables = torch.full((len(rows), pages), ZERO_PAGE, dtype=torch.long)
        for i, (step, r) in enumerate(rows):
            table = step.cache.tables[r][:pages]
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        offsets = torch.arange(size)
        self.read_pages = tables.to(device).reshape(-1)  # [rows * pages]: what each layer gathers
        self.read_slots = (self.read_pages.view(len(rows), pages, 1) * size + offsets.to(device)).reshape(-1)
        self._gathered: dict[int, torch.Tensor] = {}  # keys 0 / values 1: reused by every layer (no grad)
        # queries: absolute positions, and which are real (not padding)
        q_index = torch.arange(n_max, device=device)
        self.query_positions = past[:, None] + q_index[None, :]
        self.real = q_index[None, :] < new[:, None]  # [rows, n_max]
        write_rows = self.read_slots.view(len(rows), self.kv_length)
        gathered = torch.gather(write_rows, 1, self.query_positions.clamp(max=self.kv_length - 1))
        self.write_slots = gathered[self.real]  # [real tokens]
        self.write_index = self.real.reshape(-1).nonzero().squeeze(1)  # of the flattened [rows * n_max]
        # keys each row may see at all: its own [0, past + n), and its attention mask there
        keys = torch.arange(self.kv_length, device=device)[None, :] < ends[:, None]
        for i, (step, r) in enumerate(rows):
            if step.attention_mask is not None:
                end = int(ends[i])
                keys[i, :end] &= step.attention_mask[r].to(device=device, dtype=torch.bool)
        self.visible_keys = keys  # [rows, G]
        hidden = steps[0].hidden.new_zeros(len(rows), n_max, steps[0].hidden.shape[2])
        position_ids = torch.zeros(len(rows), n_max, dtype=torch.long, device=device)
        first = 0
        for step, n in zip(steps, counts, strict=True):
            b = step.hidden.shape[0]
            hidden[first : first + b, :n] = step.hidden
            position_ids[first : first + b, :n] = step.position_ids
            first += b
        self.hidden, self.position_ids = hidden, position_ids
        self.rows = len(rows)

    @property
    def uniform_past(self) -> int | None:
        """The one past length all rows share without padding (deep prompts need it), else None."""
        pasts = {step.past_length for step in self.steps}
        counts = {step.hidden.shape[1] for step in self.steps}
        return next(iter(pasts)) if len(pasts) == 1 and len(counts) == 1 else None

    def mask(self, window: int | None, additive: torch.dtype | None = None) -> torch.Tensor:
        """``[rows, 1, n_max, G]`` (True = attend): causal at each row's positions, its own keys
        and attention mask, the sliding ``window`` if any (transformers' ``kv > q - window``).
        ``additive``: the additive float mask of that dtype eager attention takes."""
        keys = torch.arange(self.kv_length, device=self.visible_keys.device)[None, None, :]
        q = self.query_positions[:, :, None]
        allowed = (keys <= q) & self.visible_keys[:, None, :]
        if window is not None:
            allowed &= keys > q - window
        real = self.real[:, :, None]
        if additive is None:
            return torch.where(real, allowed, keys == 0)[:, None]
        # a query that may see nothing (left padding): eager attention alone adds the lowest value to
        # every score of its row, which drowns them all: the mean of the values of its row's range
        blind = real & ~allowed.any(-1, keepdim=True)
        first = self.past[:, None, None] - window + 1 if window is not None else torch.zeros_like(q)
        seen = (keys >= first) & (keys < self.ends[:, None, None])
        lowest = torch.finfo(additive).min
        mask = torch.where(allowed & real, 0.0, lowest)
        mask = torch.where(blind, torch.where(seen, lowest, -torch.inf), mask)
        mask = torch.where(real | (keys == 0), mask, lowest)
        return mask.to(additive)[:, None]

    def gather(self, pool_part: torch.Tensor, which: int) -> torch.Tensor:
        """The pages every row reads, ``[rows, G, heads, dim]``, gathered a page at a time. Without
        gradients into one buffer per keys/values that each layer's gather overwrites (the layer
        before is done with it): a fresh ~MB-sized tensor per layer costs more than the copy."""
        size = self.pool.page_size
        pages = pool_part.view(-1, size, *pool_part.shape[1:])
        shape = (self.read_pages.shape[0], *pages.shape[1:])
        if torch.is_grad_enabled():
            out = pages.index_select(0, self.read_pages)
        else:
            out = self._gathered.get(which)
            if out is None or out.shape != shape or out.dtype != pages.dtype:
                out = self._gathered[which] = pages.new_empty(shape)
            torch.index_select(pages, 0, self.read_pages, out=out)
        return out.view(self.rows, self.kv_length, *pool_part.shape[1:])

    def cache_step(self, start: int) -> PagedStep:
        return PagedStep(self, start)

    def split(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Each step's output ``[b, n, H]`` from the batch's ``[rows, n_max, H]``; sets each cache's
        length (the step is done)."""
        outputs, first = [], 0
        for step in self.steps:
            b, n = step.hidden.shape[:2]
            outputs.append(hidden[first : first + b, :n])
            step.cache.length = step.past_length + n
            first += b
        return outputs


class PagedStep:
    """What the layers see as their cache during one batched forward (transformers' ``Cache.update``).

    The pool stores the geometry's kv heads. A layer that hands over keys/values already repeated for
    its query heads (``g`` times the pool's heads, repeat-interleaved: Falcon's new decoder architecture
    in transformers 5.17 broadcasts each group's key to its query heads) stores one head of every
    ``g`` and gets them repeated back; either way ``update`` returns as many heads as it was given."""

    def __init__(self, batch: PackedSteps, start: int):
        self.batch, self.start = batch, start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        batch, i = self.batch, layer_idx - self.start
        given, stored = key_states.shape[1], batch.pool.keys[i].shape[1]
        if given % stored:
            raise ValueError(f"block {layer_idx}: {given} kv heads handed to a cache of {stored} heads a position")
        g = given // stored
        if g > 1:
            key_states, value_states = key_states[:, ::g], value_states[:, ::g]
        rows, heads, n, dim = key_states.shape
        out = []
        for which, (pool_part, states) in enumerate(
            ((batch.pool.keys[i], key_states), (batch.pool.values[i], value_states))
        ):
            flat = states.transpose(1, 2).reshape(rows * n, heads, dim)
            pool_part.index_copy_(0, batch.write_slots, flat.index_select(0, batch.write_index).to(pool_part.dtype))
            read = batch.gather(pool_part, which).transpose(1, 2)
            out.append(read.repeat_interleave(g, dim=1) if g > 1 else read)
        return out[0], out[1]


def private_cache(span, batch_size: int, max_length: int, page_size: int = DEFAULT_PAGE_SIZE) -> PagedCache:
    """A cache on a pool of its own, just big enough for ``max_length`` positions of every row (a
    judge's recompute, a warm-up, a client's local span): ``span.allocate_cache``."""
    pool = span.allocate_pool(batch_size * math.ceil(max_length / page_size), page_size)
    return PagedCache(pool, batch_size, max_length)


__all__ = [
    "DEFAULT_PAGE_SIZE",
    "CachedStep",
    "PackedSteps",
    "PagePool",
    "PagedCache",
    "PagedStep",
    "PagesExhausted",
    "private_cache",
]
