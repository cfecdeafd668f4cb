"""The server-wide KV budget, in pages of the span's :class:`~shoal.models.kv.PagePool`.

A session *commits* pages as its positions arrive, never ahead of them: at ``open`` one page per
row (room to start), then at each step the pages its new length needs (taken by the step, before
it runs; :meth:`CacheBudget.grow`). A reservation that never steps so holds almost nothing, and a
stranger cannot starve everyone else by opening sessions for the advertised free cache. The
committed pages of live sessions stay within the pool times ``overcommit`` (1.0 by default: a page
committed is a page the pool has). When the budget is spent, a step that needs more answers
"busy" (the session stays usable at its length; its client moves it to another server, replaying
its history), and an open whose ``max_length`` could never fit is refused at once. Pages no live
session holds keep the prefix cache (:mod:`shoal.server.prefix`) until a session needs them.
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
        """Positions live sessions have committed (what their steps reached, in whole pages)."""
        return self.committed_pages * self.page_size

    @property
    def free_tokens(self) -> int:
        """Positions of cache not committed to a live session."""
        return max(0, self.limit_pages - self.committed_pages) * self.page_size

    def pages_for(self, batch_size: int, length: int) -> int:
        return batch_size * math.ceil(length / self.page_size)

    def admit(self, batch_size: int, max_length: int) -> int:
        """Commit the first page of each of a new session's ``batch_size`` rows (returned, to grow
        and release later), or raise :class:`BusyError` at once: when even that is not free, or
        when ``batch_size`` x ``max_length`` positions could never fit this server."""
        whole = self.pages_for(batch_size, max_length)
        if whole > self.limit_pages:
            raise BusyError(
                f"busy: a session of {batch_size} x {max_length} positions needs {whole} KV pages of "
                f"{self.page_size}, this server has {self.limit_pages}; try a shorter max_length or another server"
            )
        return self._commit(batch_size, batch_size, max_length)

    def grow(self, pages: int, batch_size: int, length: int) -> int:
        """A session holding ``pages`` reaches ``length`` positions: commit what that needs more
        (the new total is returned) or raise :class:`BusyError`, committing nothing."""
        needed = self.pages_for(batch_size, length)
        if needed <= pages:
            return pages
        return pages + self._commit(needed - pages, batch_size, length)

    def _commit(self, pages: int, batch_size: int, length: int) -> int:
        free = self.limit_pages - self.committed_pages
        if pages > free:
            raise BusyError(
                f"busy: a session of {batch_size} x {length} positions needs {pages} more KV pages of "
                f"{self.page_size}, {max(0, free)} of {self.limit_pages} are free; try another server"
            )
        self.committed_pages += pages
        return pages

    def release(self, pages: int) -> None:
        self.committed_pages = max(0, self.committed_pages - pages)
