"""The server-wide KV budget, in pages of the span's :class:`~shoal.models.kv.PagePool`.

Memory and admission are counted apart. A session *holds* only the pages its positions need (taken
as it grows, :class:`~shoal.models.kv.PagedCache`). To be admitted it *commits* the pages its
``max_length`` could need, and the committed pages of live sessions stay within the pool times
``overcommit``: at 1.0 (the default) an admitted session finds its pages however the others grow,
so a request that was accepted does not fail half-way; above 1.0 more sessions share the pool on the
bet that few reach their ``max_length``, and a step that finds no page answers "busy" (the session
stays usable at its length). Pages no live session holds keep the prefix cache
(:mod:`shoal.server.prefix`) until a session needs them.

A commitment beyond the positions a session has reached is a *reservation*, and a reservation is
not kept from others: when an ``open`` or a step finds the budget spent, the server takes back
(:meth:`CacheBudget.shrink`) the reservations of other peers' sessions that never stepped, then of
sessions idle for a while (:mod:`shoal.server.admission`), down to the pages their positions hold. Such a session
stays open; it commits again as its positions arrive (:meth:`CacheBudget.grow`). So a stranger who
opens sessions for all the free cache and never steps holds nothing anyone else needs.
"""

from __future__ import annotations

import math

from shoal.errors import BusyError
from shoal.models.kv import PagePool


class CacheBudget:
    def __init__(self, pool: PagePool, overcommit: float = 1.0):
        if not overcommit >= 1.0:
            raise ValueError(f"overcommit must be at least 1.0, got {overcommit}")
        self.pool, self.overcommit = pool, overcommit
        self.page_size = pool.page_size
        self.capacity_pages = pool.num_pages
        self.limit_pages = math.floor(pool.num_pages * overcommit)
        self.committed_pages = 0

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_pages * self.page_size

    @property
    def reserved_tokens(self) -> int:
        """Positions live sessions have committed (their ``max_length`` s, in whole pages, less the
        reservations taken back)."""
        return self.committed_pages * self.page_size

    @property
    def free_tokens(self) -> int:
        """The longest session (in positions) the server admits now without taking a reservation back."""
        return max(0, self.limit_pages - self.committed_pages) * self.page_size

    def pages_for(self, batch_size: int, length: int) -> int:
        return batch_size * math.ceil(length / self.page_size)

    def check_fits(self, batch_size: int, max_length: int) -> None:
        """Raise :class:`BusyError` if ``batch_size`` x ``max_length`` positions could never fit here."""
        whole = self.pages_for(batch_size, max_length)
        if whole > self.limit_pages:
            raise BusyError(
                f"busy: a session of {batch_size} x {max_length} positions needs {whole} KV pages of "
                f"{self.page_size}, this server has {self.limit_pages}; try a shorter max_length or another server"
            )

    def reserve(self, batch_size: int, max_length: int) -> int:
        """Commit the pages of a session of ``batch_size`` rows x ``max_length`` positions (returned,
        to release later) or raise :class:`BusyError` at once."""
        pages = self.pages_for(batch_size, max_length)
        free = self.limit_pages - self.committed_pages
        if pages > free:
            raise BusyError(
                f"busy: a session of {batch_size} x {max_length} positions needs {pages} KV pages of "
                f"{self.page_size}, {max(0, free)} of {self.limit_pages} are free; try a shorter max_length "
                "or another server"
            )
        self.committed_pages += pages
        return pages

    def grow(self, pages: int, batch_size: int, length: int) -> int:
        """A session committed ``pages`` reaches ``length`` positions: commit what that needs more (only
        after its reservation was taken back; the new total is returned) or raise :class:`BusyError`,
        committing nothing."""
        needed = self.pages_for(batch_size, length)
        if needed <= pages:
            return pages
        free = self.limit_pages - self.committed_pages
        if needed - pages > free:
            raise BusyError(
                f"busy: a session of {batch_size} x {length} positions needs {needed - pages} more KV pages of "
                f"{self.page_size}, {max(0, free)} of {self.limit_pages} are free; try another server"
            )
        self.committed_pages += needed - pages
        return needed

    def shrink(self, pages: int, batch_size: int, length: int) -> int:
        """Take back what a session committed ``pages`` reserved beyond its ``length`` positions; its
        new commitment is returned."""
        kept = min(pages, self.pages_for(batch_size, length))
        self.release(pages - kept)
        return kept

    def release(self, pages: int) -> None:
        self.committed_pages = max(0, self.committed_pages - pages)
