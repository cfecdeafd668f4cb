"""What the dashboard shows: a swarm's record table, pulled through any member the watcher knows.

A :class:`SwarmWatcher` keeps its own :class:`~shoal.swarm.table.RecordTable` and merges each pull
into it, so records it saw stay (until they expire) and a stopped server shows as ``offline``. It
pulls through the ticket it was given first, then through any online server of the table, so the
view survives the loss of that first peer.

Once :meth:`SwarmWatcher.start_sampling` is called it also samples, every second, each online
server's load through ``info`` (at most ``MAX_SAMPLED`` servers, each given ``INFO_TIMEOUT`` to
answer) into a :class:`~shoal.gateway.history.LoadHistory`: one small request per server per
second, whether or not anyone looks at the dashboard, and a pull of the table every
``TABLE_MAX_AGE`` seconds when no page pulls it more often.

iroh binds its callbacks to one event loop per process; all transport work therefore runs on the
client's loop thread (:func:`shoal.client.runtime.shared_loop`), which the gateway's model also uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from shoal.client.runtime import LoopThread, shared_loop
from shoal.errors import ShoalError
from shoal.gateway.history import LoadHistory, Reading
from shoal.gateway.views import with_load
from shoal.protocols import BLOCKS
from shoal.swarm.records import State
from shoal.swarm.service import adopt_reach, decode_table, fetch_table
from shoal.swarm.status import summarize
from shoal.swarm.table import RecordTable
from shoal.transport import Node, Ticket, TransportConfig
from shoal.wire import Message
from shoal.wire.schema import InfoReply

log = logging.getLogger(__name__)

__all__ = ["SwarmWatcher", "Watchers"]

MAX_SAMPLED = 64  # servers whose load is sampled each second
INFO_TIMEOUT = 0.8  # seconds a server gets to answer a sample's info
TABLE_MAX_AGE = 5.0  # seconds: older than this, sampling pulls the table itself (else a page's pulls do)


class SwarmWatcher:
    def __init__(
        self,
        ticket: Ticket,
        transport: TransportConfig,
        runtime: LoopThread | None = None,
        min_interval: float = 0.5,
        member: tuple[bytes | None, bytes | None] = (None, None),  # key and certificate (private swarms)
    ):
        if not ticket.swarm_id:
            raise ValueError("this ticket names no swarm (printed by a server started without --new-swarm/--join)")
        self.first = ticket
        self.transport = transport
        self.member = member
        self.runtime = runtime or shared_loop()
        self.min_interval = min_interval  # pulls closer together than this share one answer
        self.table = RecordTable(ticket.swarm_id)
        self._node: Node | None = None
        self._lock: asyncio.Lock | None = None
        self._last: tuple[float, dict] | None = None
        self._via: str | None = None  # the peer that answered the last pull
        self.load = LoadHistory()
        self._sampling: asyncio.Task | None = None

    async def status(self) -> dict:
        """The swarm's status (see :func:`shoal.swarm.status.summarize`) with each server's latest
        load (:func:`~shoal.gateway.views.with_load`), from any event loop."""
        return await self._on_loop(self._status_with_load())

    async def history(self, since: float | None = None) -> dict:
        """The load samples taken after ``since`` (seconds since the epoch; None: all), as JSON."""
        return await self._on_loop(self._history(since))

    async def _on_loop(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.runtime.loop))

    async def _status_with_load(self) -> dict:
        return with_load(await self._status(), self.load.latest())

    async def _history(self, since: float | None) -> dict:
        return self.load.as_json(since)

    def start_sampling(self) -> None:
        """Sample the servers' load every second from now on (idempotent, from any thread)."""

        def start() -> None:
            if self._sampling is None:
                self._sampling = asyncio.get_running_loop().create_task(self._sample_forever())

        self.runtime.loop.call_soon_threadsafe(start)

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
            identity, cert = self.member
            self._node = await Node.start(self.transport, secret_key=identity)
            self._node.credential = cert  # presented to a private swarm's members
        timeout = self.transport.deadlines.connect + self.transport.deadlines.request
        via, errors, rejected = None, [], None
        for ticket in self._candidates():
            try:
                payload = await fetch_table(self._node, ticket, min(timeout, 5.0))
                self.table.merge_many(decode_table(payload))
                adopt_reach(self.table, payload)  # that member's word on which servers answer
                via = self._via = ticket.peer_id
                rejected = dict(payload.rejected)  # what that member refused (forged records, verdicts)
                break
            except ShoalError as exc:
                errors.append(f"{ticket.peer_id[:10]}: {exc}")
        self.table.expire()
        status = summarize(self.table, time.time(), rejected=rejected)
        for server in (s for m in status["models"] for s in m["servers"]):
            signed = self.table.get(f"s:{server['peer']}")
            server["step_ms"] = signed.record.step_ms if signed is not None else 0.0
        status["via"] = via
        status["error"] = None if via else "no swarm member answered: " + "; ".join(errors)
        status["time"] = time.time()
        return status

    # ---- load samples ------------------------------------------------------------------------
    async def _sample_forever(self) -> None:
        interval = self.load.interval_s
        due = time.monotonic()
        while True:
            try:
                await self._sample()
            except Exception:  # a sample that failed is a gap in the chart, never the end of sampling
                log.exception("sampling the swarm's load failed")
            due += interval
            now = time.monotonic()
            if due < now:  # fell behind (a slow pull): skip the missed ticks
                due = now + interval
            await asyncio.sleep(due - now)

    async def _sample(self) -> None:
        if self._last is None or time.monotonic() - self._last[0] >= TABLE_MAX_AGE:
            await self._status()  # who is online: the table /api/swarm pulled, or a fresh pull
        online = [r for r in self.table.servers(include_offline=False) if r.state is State.ONLINE]
        tickets = [Ticket(r.peer, r.addrs, r.relay, self.table.swarm) for r in online[:MAX_SAMPLED]]
        t = time.time()
        replies = await asyncio.gather(*(self._reading(ticket) for ticket in tickets))
        self.load.add(t, {ticket.peer_id: r for ticket, r in zip(tickets, replies, strict=True) if r is not None})

    async def _reading(self, ticket: Ticket) -> Reading | None:
        try:
            reply = await self._node.request(ticket, BLOCKS, Message("info", 1), timeout=INFO_TIMEOUT)
            counters = reply.reply(InfoReply).counters
        except (ShoalError, TimeoutError):
            return None  # not answering now: no point for it in this sample
        if counters is None:
            return None  # the server keeps its counters to itself (the default): no load figure for it
        tokens = counters.positions_processed + counters.forward_tokens
        return Reading(tokens, counters.sessions_active, time.monotonic())

    async def close(self) -> None:
        async def shut() -> None:
            if self._sampling is not None:
                self._sampling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._sampling
                self._sampling = None
            if self._node is not None:
                await self._node.close()
                self._node = None

        await self._on_loop(shut())


class Watchers:
    """One watcher per swarm: the gateway's own, plus those the dashboard's ``?ticket=`` names; each
    samples its swarm's load from its creation on."""

    def __init__(
        self,
        transport: TransportConfig,
        default: Ticket | None = None,
        limit: int = 8,
        member: tuple[bytes | None, bytes | None] = (None, None),  # key and certificate (private swarms)
    ):
        self.transport = transport
        self.member = member
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
            watcher = self._by_swarm[parsed.swarm_id or ""] = SwarmWatcher(parsed, self.transport, member=self.member)
            watcher.start_sampling()
        return watcher

    def of(self, ticket: Ticket) -> SwarmWatcher:
        """The watcher of ``ticket``'s swarm (a joined swarm: not counted against ``limit``)."""
        watcher = self._by_swarm.get(ticket.swarm_id or "")
        if watcher is None:
            watcher = self._by_swarm[ticket.swarm_id or ""] = SwarmWatcher(ticket, self.transport, member=self.member)
            watcher.start_sampling()
        return watcher

    async def close(self) -> None:
        for watcher in self._by_swarm.values():
            await watcher.close()
