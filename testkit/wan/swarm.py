"""A swarm of in-process servers and clients behind the WAN emulator.

:class:`WanSwarm` is shoal's :class:`~shoal.launch.InProcessSwarm` on iroh nodes (each bound to
loopback) plus a :class:`~testkit.wan.WanEmulator`: every server's node is sealed and registered
as it starts (``"s0"``, ``"s1"``, ... in the order added), every client's node too (``"client"``
by default: :meth:`WanSwarm.connect` wraps the ``start_node`` the client starts its node with),
and every ticket the swarm hands out (:meth:`tickets`, a client's initial peers, so the push
routes the client builds from them) is the emulator's. No shoal node ever learns another's own
address, so every datagram between them crosses a proxy, with that link's conditions::

    with WanSwarm(model_dir, [BlockRange(0, 2), BlockRange(2, 4)], default=LinkConditions(rtt_ms=30)) as swarm:
        swarm.set_link("s0", "s1", rtt_ms=80.0)  # or by span: swarm.set_link(BlockRange(0, 2), ...)
        model = swarm.connect(push=True)
        model.generate(...)
        swarm.stats("s0", "s1").forwarded_bytes

The emulator's thread shares this process with the servers' torch compute and the client: it
needs the GIL for every delivery, so keep the models tiny (a compute step that holds the GIL for
milliseconds delays datagrams by as much).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from shoal.ids import BlockRange
from shoal.launch.inprocess import InProcessSwarm, LocalServer, Prepare
from shoal.transport import BaseNode, Handler, Node, Protocol, StartNode, Ticket, TransportConfig
from testkit.wan.emulator import DirectionStats, LinkConditions, WanEmulator

#: A node of the swarm: its emulator name, or a span (the first live server hosting it).
Who = str | BlockRange


class WanSwarm(InProcessSwarm):
    """Servers for ``spans`` behind one emulator whose links start with ``default`` conditions,
    those named in ``links`` (``{("client", "s1"): LinkConditions(...)}``, both directions) with
    theirs, applied as soon as both ends exist. ``seed`` seeds the emulator's loss and jitter.
    ``wan``: an emulator of the caller's instead (``default`` and ``seed`` are then its own), left
    open by :meth:`close` (to read its counters once every node is gone). Other keywords go to
    :class:`~shoal.launch.InProcessSwarm` (the nodes are iroh's)."""

    def __init__(
        self,
        model_dir: str | Path,
        spans: Iterable[BlockRange],
        *,
        default: LinkConditions = LinkConditions(),
        links: Mapping[tuple[str, str], LinkConditions] | None = None,
        seed: int = 0,
        wan: WanEmulator | None = None,
        **swarm_options: Any,
    ):
        self._owns_wan = wan is None
        self.wan = WanEmulator(default, seed) if wan is None else wan
        self.links = dict(links or {})
        self.names: dict[str, str] = {}  # peer id -> emulator name
        try:
            super().__init__(model_dir, spans, start_node=Node.start, **swarm_options)
        except BaseException:
            self._close_wan()
            raise

    def add(self, span: BlockRange, prepare: Prepare | None = None, *, name: str | None = None) -> LocalServer:
        """One more server (named ``name``, default ``s<n>`` for the n-th server added)."""
        name = name or f"s{len(self.servers)}"
        local = super().add(span, prepare)
        self._register(local.node, name)  # before anyone is given its ticket: nothing reached it yet
        return local

    def connect(self, spans: Sequence[BlockRange] | None = None, *, name: str = "client", **kwargs: Any):
        """A client whose node is registered as ``name`` before it sends anything."""
        return super().connect(spans, start_node=self._registering(name), **kwargs)

    def tickets(self, spans: Sequence[BlockRange] | None = None) -> list[Ticket]:
        """The emulator's tickets of the live servers (of ``spans``, in that order, if given)."""
        return [self.wan.ticket(self.names[t.peer_id]) for t in super().tickets(spans)]

    def ticket(self, who: Who) -> Ticket:
        return self.wan.ticket(self.name(who))

    def name(self, who: Who) -> str:
        """The emulator name of ``who`` (a span: its first live server)."""
        if isinstance(who, BlockRange):
            return self.names[self.server(who).node.id]
        return who

    def set_link(self, a: Who, b: Who, conditions: LinkConditions | None = None, **changes: Any) -> None:
        """Both directions between ``a`` and ``b`` (see :meth:`WanEmulator.set_link`)."""
        self.wan.set_link(self.name(a), self.name(b), conditions, **changes)

    def stats(self, src: Who, dst: Who) -> DirectionStats:
        return self.wan.stats(self.name(src), self.name(dst))

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._close_wan()

    def __enter__(self) -> WanSwarm:
        return self

    def _close_wan(self) -> None:
        if self._owns_wan:
            self.wan.close()

    # ---- wiring ----------------------------------------------------------------------------------
    def _register(self, node: BaseNode, name: str) -> None:
        ticket = node.ticket()
        self.wan.add_node(ticket, name)  # seals the node's sockets: from now on only proxies reach it
        self.names[ticket.peer_id] = name
        known = {n.name for n in self.wan.nodes}
        for (a, b), conditions in self.links.items():
            if name in (a, b) and {a, b} <= known:
                self.wan.set_link(a, b, conditions)

    def _registering(self, name: str) -> StartNode:
        """``Node.start``, and the node registered as ``name`` before it is returned."""

        async def start(
            config: TransportConfig, handlers: dict[Protocol, Handler] | None = None, **kwargs: Any
        ) -> BaseNode:
            node = await Node.start(config, handlers, **kwargs)
            try:
                self._register(node, name)
            except BaseException:
                await node.close()
                raise
            return node

        return start


__all__ = ["WanSwarm", "Who"]
