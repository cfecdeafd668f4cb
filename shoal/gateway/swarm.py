"""What the dashboard shows: a swarm's record table, pulled through any member the watcher knows.

A :class:`SwarmWatcher` keeps its own :class:`~shoal.swarm.table.RecordTable` and merges each pull
into it, so records it saw stay (until they expire) and a stopped server shows as ``offline``. It
pulls through the ticket it was given first, then through any online server of the table, so the
view survives the loss of that first peer.

iroh binds its callbacks to one event loop per process; all transport work therefore runs on the
client's loop thread (:func:`shoal.client.runtime.shared_loop`), which the gateway's model also uses.
"""

from __future__ import annotations

import asyncio
import time

from shoal.client.runtime import LoopThread, shared_loop
from shoal.errors import ShoalError
from shoal.swarm.records import State
from shoal.swarm.service import decode_table, fetch_table
from shoal.swarm.status import summarize
from shoal.swarm.table import RecordTable
from shoal.transport import Node, Ticket, TransportConfig

__all__ = ["SwarmWatcher", "Watchers"]


class SwarmWatcher:
    def __init__(
        self, ticket: Ticket, transport: TransportConfig, runtime: LoopThread | None = None, min_interval: float = 0.5
    ):
        if not ticket.swarm_id:
            raise ValueError("this ticket names no swarm (printed by a server started without --new-swarm/--join)")
        self.first = ticket
        self.transport = transport
        self.runtime = runtime or shared_loop()
        self.min_interval = min_interval  # pulls closer together than this share one answer
        self.table = RecordTable(ticket.swarm_id)
        self._node: Node | None = None
        self._lock: asyncio.Lock | None = None
        self._last: tuple[float, dict] | None = None
        self._via: str | None = None  # the peer that answered the last pull

    async def status(self) -> dict:
        """The swarm's status (see :func:`shoal.swarm.status.summarize`), from any event loop."""
        future = asyncio.run_coroutine_threadsafe(self._status(), self.runtime.loop)
        return await asyncio.wrap_future(future)

    def _candidates(self) -> list[Ticket]:
        """Whom to ask, in order: the peer that answered last, the online servers, the first ticket."""
        online = [
            Ticket(r.peer, r.addrs, r.relay, self.table.swarm)
            for r in self.table.servers(include_offline=False)
            if r.state is State.ONLINE
        ]
        unique: dict[str, Ticket] = {}
        for ticket in [*sorted(online, key=lambda t: t.peer_id != self._via), self.first]:
            unique.setdefault(ticket.peer_id, ticket)
        return list(unique.values())

    async def _status(self) -> dict:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last[0] < self.min_interval:
                return self._last[1]
            status = await self._pull()
            self._last = (time.monotonic(), status)
            return status

    async def _pull(self) -> dict:
        if self._node is None:
            self._node = await Node.start(self.transport)
        timeout = self.transport.deadlines.connect + self.transport.deadlines.request
        via, errors = None, []
        for ticket in self._candidates():
            try:
                self.table.merge_many(decode_table(await fetch_table(self._node, ticket, min(timeout, 5.0))))
                via = self._via = ticket.peer_id
                break
            except ShoalError as exc:
                errors.append(f"{ticket.peer_id[:10]}: {exc}")
        self.table.expire()
        status = summarize(self.table, time.time())
        for server in (s for m in status["models"] for s in m["servers"]):
            signed = self.table.get(f"s:{server['peer']}")
            server["step_ms"] = signed.record.step_ms if signed is not None else 0.0
        status["via"] = via
        status["error"] = None if via else "no swarm member answered: " + "; ".join(errors)
        status["time"] = time.time()
        return status

    async def close(self) -> None:
        if self._node is not None:
            future = asyncio.run_coroutine_threadsafe(self._node.close(), self.runtime.loop)
            await asyncio.wrap_future(future)
            self._node = None


class Watchers:
    """One watcher per swarm: the gateway's own, plus those the dashboard's ``?ticket=`` names."""

    def __init__(self, transport: TransportConfig, default: Ticket | None = None, limit: int = 8):
        self.transport = transport
        self.default = default
        self.limit = limit
        self._by_swarm: dict[str, SwarmWatcher] = {}

    def get(self, ticket: str | None) -> SwarmWatcher:
        """The watcher for ``ticket`` (a ticket string), or the default one; ValueError if neither."""
        parsed = Ticket.parse(ticket) if ticket else self.default
        if parsed is None:
            raise ValueError("no swarm to show: pass ?ticket=TICKET")
        watcher = self._by_swarm.get(parsed.swarm_id or "")
        if watcher is None:
            if len(self._by_swarm) >= self.limit:
                raise ValueError(f"this dashboard already watches {self.limit} swarms")
            watcher = self._by_swarm[parsed.swarm_id or ""] = SwarmWatcher(parsed, self.transport)
        return watcher

    async def close(self) -> None:
        for watcher in self._by_swarm.values():
            await watcher.close()
