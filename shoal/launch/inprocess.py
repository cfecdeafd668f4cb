"""A swarm of block servers inside this process: the real handler, sessions, push chain and client,
minus the process boundary (tests, benchmarks, notebooks).

Each server is built by the very steps ``shoal serve`` takes (:mod:`shoal.server.builder`: the
span's weights only, its own compute thread, a swarm presence when in one), answering on a node of one
:class:`~shoal.transport.MemoryNetwork` by default, or on iroh nodes (``start_node=Node.start``,
e.g. behind the WAN emulator). Servers and clients share the client runtime's event loop thread
(:func:`shoal.client.runtime.shared_loop`), as the in-memory network requires.

    with InProcessSwarm(model_dir, [BlockRange(0, 2), BlockRange(2, 4)]) as swarm:
        model = swarm.connect()  # an AutoDistributedModelForCausalLM over every server
        model.generate(...)
        swarm.kill(BlockRange(0, 2))  # abrupt: its streams end, as if the process died

With ``swarm="name"`` every server also takes part in a swarm as ``shoal serve --join`` does (its
swarm presence: signed records, gossip over the same network, its verdicts as a judge), each joining
through the first live server; tickets then carry the swarm id, so a client pulls the swarm's table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shoal.client.runtime import LoopThread, shared_loop
from shoal.ids import BlockRange
from shoal.limits import limit_fields
from shoal.server.backend import compute_thread
from shoal.server.builder import (
    Prepare,
    check_member,
    come_online,
    make_presence,
    node_key,
    span_loader,
    start_endpoint,
)
from shoal.server.config import ServerConfig
from shoal.server.handler import BlockServer
from shoal.server.preflight import check_model, check_server
from shoal.server.presence import LoadingGate, Presence
from shoal.swarm.gossip import GossipConfig
from shoal.transport import BaseNode, MemoryNetwork, StartNode, Ticket, TransportConfig

LIMIT_NAMES = frozenset(item.name for item in limit_fields())

LOOPBACK = TransportConfig(bind_addr="127.0.0.1:0")
#: gossip for in-process swarms: news spreads within a few tenths of a second
FAST_GOSSIP = GossipConfig(period=0.2)


@dataclass
class LocalServer:
    """One server of an :class:`InProcessSwarm`."""

    blocks: BlockRange
    server: BlockServer
    node: BaseNode
    compute: ThreadPoolExecutor
    gate: LoadingGate  # what its node answers through
    alive: bool = True
    presence: Presence | None = None  # its part in the swarm (``InProcessSwarm(swarm=...)``)

    @property
    def ticket(self) -> Ticket:
        return self.node.ticket(self.presence.service.table.swarm if self.presence is not None else None)


class InProcessSwarm:
    """Servers for ``spans`` of the checkpoint at ``model_dir``, in this process. A context manager
    that closes every client it made, then every server."""

    def __init__(
        self,
        model_dir: str | Path,
        spans: Iterable[BlockRange],
        *,
        cache_tokens: int = 4096,
        session_timeout: float = 60.0,
        num_threads: int = 1,
        start_node: StartNode | None = None,
        transport: TransportConfig = LOOPBACK,
        prepare: Prepare | None = None,
        runtime: LoopThread | None = None,
        swarm: str | None = None,
        gossip: GossipConfig = FAST_GOSSIP,
        **settings: Any,
    ):
        """``settings``: any other :class:`~shoal.server.config.ServerConfig` field for every server
        (e.g. ``max_batch``, ``page_size``, ``kv_overcommit``), or any :class:`~shoal.limits.Limits`
        field (e.g. ``max_sessions_per_peer``): those go into the transport's limits."""
        self.model_dir = Path(model_dir)
        self.model = check_model(str(self.model_dir))  # its config read once, for every server
        self.swarm_id = swarm
        self.gossip = gossip
        self.runtime = runtime or shared_loop()
        self.network = MemoryNetwork() if start_node is None else None
        self.start_node: StartNode = self.network.start if self.network is not None else start_node
        self.transport = transport
        self.servers: list[LocalServer] = []
        self.clients: list = []
        # the harness runs every server: tests read their counters over info (share_counters)
        self._settings = {"share_counters": True, "cache_tokens": cache_tokens, "session_timeout": session_timeout,
                          "num_threads": num_threads, **settings}  # fmt: skip
        try:
            for span in spans:
                self.add(span, prepare)
        except BaseException:
            self.close()
            raise

    def add(self, span: BlockRange, prepare: Prepare | None = None, **settings: Any) -> LocalServer:
        """Load one more server for ``span`` and start serving it; ``settings`` (``model``: another
        name for the swarm's model, e.g. one whose weights were fetched from peers, ``cache_tokens``,
        ``max_sessions_per_peer``, ``session_timeout``, ``num_threads``, and any other
        :class:`~shoal.server.config.ServerConfig` field, e.g. ``quant``) override the swarm's."""
        settings = {**self._settings, **settings}
        limits = {name: settings.pop(name) for name in LIMIT_NAMES if name in settings}
        transport = settings.pop("transport", self.transport)
        settings["transport"] = replace(transport, limits=replace(transport.limits, **limits))
        if self.swarm_id is not None:  # announced as given: no throughput measurement
            settings = {"throughput": 100.0, "gossip": self.gossip, "join": tuple(self.tickets()[:1]), **settings}
        config = ServerConfig(**{"model": str(self.model_dir), "blocks": span, **settings})
        checked = check_server(config, self.model if config.model == str(self.model_dir) else None)
        compute = compute_thread(config.num_threads)
        key = node_key(config)  # the node's, and the one its receipts are signed with
        check_member(config, self.swarm_id, key)
        run, presence = self.runtime.run, None
        try:
            node, gate = run(start_endpoint(config, key, self.start_node, swarm=self.swarm_id is not None))
            try:
                if self.swarm_id is not None:  # as ``shoal serve --join``: joined, then the span announced online
                    presence = make_presence(checked, node, key, self.swarm_id, gate, compute)
                    run(presence.join())
                load = span_loader(checked, node, key, compute, presence, prepare)
                server = run(come_online(checked, gate, presence, load, compute))
            except BaseException:
                if presence is not None:
                    run(presence.service.stop(), timeout=10)
                run(node.close(), timeout=10)
                raise
        except BaseException:
            compute.shutdown(wait=False, cancel_futures=True)
            raise
        local = LocalServer(span, server, node, compute, gate, presence=presence)
        self.servers.append(local)
        return local

    def server(self, span: BlockRange) -> LocalServer:
        """The first live server of ``span``."""
        for local in self.servers:
            if local.blocks == span and local.alive:
                return local
        raise KeyError(f"no live server for blocks {span}")

    def tickets(self, spans: Sequence[BlockRange] | None = None) -> list[Ticket]:
        """Tickets of the live servers (of ``spans``, in that order, if given)."""
        if spans is None:
            return [s.ticket for s in self.servers if s.alive]
        return [self.server(span).ticket for span in spans]

    def connect(self, spans: Sequence[BlockRange] | None = None, **kwargs):
        """A client (:class:`~shoal.client.AutoDistributedModelForCausalLM`) given the servers of
        ``spans`` (default: all) as its initial peers. ``start_node`` (default: the servers') may
        wrap it, e.g. to register the client's node with a network emulator."""
        from shoal.client import AutoDistributedModelForCausalLM

        kwargs.setdefault("transport", self.transport)
        kwargs.setdefault("start_node", self.start_node)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(self.model_dir), initial_peers=self.tickets(spans), **kwargs
        )
        self.clients.append(model)
        return model

    def kill(self, target: BlockRange | LocalServer) -> LocalServer:
        """End a server (``target``, or the first live one of that span) abruptly: its node closes
        (peers' streams fail at once) and it computes no more."""
        local = target if isinstance(target, LocalServer) else self.server(target)
        local.alive = False
        if local.presence is not None:
            self.runtime.run(local.presence.service.stop())
        self.runtime.run(local.node.close())
        local.compute.shutdown(wait=False, cancel_futures=True)
        return local

    def drain(self, target: BlockRange | LocalServer, timeout: float = 5.0) -> None:
        """Leave gracefully, as a server does on SIGTERM: open sessions move away, then it closes."""
        local = target if isinstance(target, LocalServer) else self.server(target)
        if local.presence is not None:
            self.runtime.run(local.presence.leave())  # its offline record first, as on SIGTERM
        self.runtime.run(local.server.drain(timeout))
        self.kill(local)

    def close(self) -> None:
        clients, self.clients = self.clients, []
        for model in clients:
            try:
                model.close()
            except Exception:  # a client that failed half-way must not keep the servers alive
                pass
        for local in self.servers:
            if local.alive:
                local.alive = False
                try:
                    if local.presence is not None:
                        self.runtime.run(local.presence.service.stop(), timeout=10)
                    self.runtime.run(local.node.close(), timeout=10)
                finally:
                    local.server.backend.shutdown()
                    local.compute.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> InProcessSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["FAST_GOSSIP", "LOOPBACK", "InProcessSwarm", "LocalServer", "Prepare"]
