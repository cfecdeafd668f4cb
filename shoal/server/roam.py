"""``shoal serve --join TICKET`` with no model: serve where the swarm is short, and follow demand.

The server reads the tables of the swarms its tickets name, lists the models their records define
(a model record each: its name and blocks), and weighs them (:mod:`shoal.server.demand`). It can
load a model the swarm calls ``NAME`` from ``DIR/NAME`` of the first ``--models-dir`` that has it,
else from ``NAME`` itself as ``shoal serve NAME`` would (a known model, a local path, a Hub id);
a model it cannot resolve is not a candidate. (A peer-to-peer source of weights plugs in at
:func:`shoal.checkpoints.model_source`.) It then starts as ``shoal serve MODEL --join`` (:func:`shoal.server.app.serve`,
the same builder steps), with the tickets of that model's swarm, and places its span in it as any
server without ``--blocks`` does.

Every ``rebalance_period`` (+-20%) it re-reads the tables and asks :func:`~shoal.server.demand.plan_switch`
whether to change model: at most one switch per period, never one that leaves a block of its model
uncovered. A switch stops the server as at exit (offline record first, open sessions drained) and
starts it again on the other model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from shoal.checkpoints import model_source
from shoal.errors import RemoteError, ShoalError, UsageError
from shoal.server.config import ServerConfig
from shoal.server.demand import Choice, Hosted, Switcher, choose_model
from shoal.server.presence import Presence
from shoal.swarm.records import State
from shoal.swarm.service import fetch_table, table_from_reply
from shoal.swarm.table import RecordTable
from shoal.transport import BaseNode, Node, StartNode, Ticket

log = logging.getLogger(__name__)

__all__ = ["Roaming", "Swarms", "read_swarms", "serve_where_needed"]


@dataclass(frozen=True)
class Roaming:
    """How a server without a model finds one: where its checkpoints are, how often it re-checks."""

    models_dirs: tuple[Path, ...] = ()
    rebalance_period: float = 600.0  # seconds between re-checks across models (at most one switch each)

    def __post_init__(self):
        if not self.rebalance_period > 0:
            raise UsageError(f"--rebalance-period must be positive, got {self.rebalance_period}")


@dataclass(frozen=True)
class Swarms:
    """What the joined swarms' tables say, as demand placement reads it."""

    models: dict[str, int]  # model name -> blocks (from its model record)
    hosted: tuple[Hosted, ...]  # online and joining servers
    swarm_of: dict[str, str]  # model name -> the (first, by id) swarm that lists it

    @classmethod
    def of(cls, tables: Iterable[RecordTable], now: float | None = None) -> Swarms:
        now = time.time() if now is None else now
        models: dict[str, int] = {}
        swarm_of: dict[str, str] = {}
        hosted: list[Hosted] = []
        for table in sorted(tables, key=lambda t: t.swarm):
            for record in table.models():
                if record.expires > now and models.setdefault(record.name, record.num_blocks) == record.num_blocks:
                    swarm_of.setdefault(record.name, table.swarm)
            for r in table.servers(include_unreachable=True):
                if r.expires > now and r.state is not State.OFFLINE and swarm_of.get(r.model) == table.swarm:
                    hosted.append(Hosted(r.peer, r.model, r.blocks, r.cache_tokens_free, r.queued))
        return cls(models, tuple(hosted), swarm_of)


async def read_swarms(
    node: BaseNode, tickets: Sequence[Ticket], timeout: float, own: RecordTable | None = None
) -> Swarms:
    """The tables of the swarms ``tickets`` name (``own``: the server's live table of its swarm,
    read in place): per swarm, from the first of its tickets that answers."""
    tables = {own.swarm: own} if own is not None else {}
    for ticket in tickets:
        if ticket.swarm_id is None or ticket.swarm_id in tables or ticket.peer_id == node.id:
            continue
        with contextlib.suppress(ShoalError, RemoteError, TimeoutError):
            tables[ticket.swarm_id] = table_from_reply(ticket.swarm_id, await fetch_table(node, ticket, timeout))
    return Swarms.of(tables.values())


class _Spans:
    """Per model name: the blocks this server would host of it, or None when it cannot load it
    (read from the model's config once, then remembered)."""

    def __init__(self, config: ServerConfig, roaming: Roaming):
        self.config, self.roaming = config, roaming
        self._known: dict[str, int | None] = {}

    def of(self, names: Iterable[str]) -> dict[str, int]:
        return {name: n for name in names if (n := self._one(name)) is not None}

    def _one(self, name: str) -> int | None:
        if name not in self._known:
            self._known[name] = self._measure(name)
        return self._known[name]

    def _measure(self, name: str) -> int | None:
        from shoal.server.preflight import check_model, check_quantization
        from shoal.server.throughput import default_num_blocks

        config = self.config
        try:
            model = check_model(model_source(name, self.roaming.models_dirs))
            check_quantization(config.quant, model)
            n = config.num_blocks or default_num_blocks(model.hf_config, config.dtype, config.device,
                                                        config.cache_tokens, quantization=config.quant,
                                                        packed=config.packed_weights)  # fmt: skip
        except (ShoalError, ValueError, OSError) as exc:
            log.info("model %s: not a candidate here (%s)", name, exc)
            return None
        return min(n, model.num_blocks)


async def serve_where_needed(
    config: ServerConfig,
    roaming: Roaming,
    on_ready: Callable[[Ticket], None] | None = None,
    stop: asyncio.Event | None = None,
    start_node: StartNode = Node.start,
) -> None:
    """Serve the model the joined swarms are shortest of, switching when demand shifts, until
    ``stop`` (``config``: a server's settings but its model; ``on_ready``: each time it is online)."""
    from shoal.server.app import serve
    from shoal.server.builder import node_key

    stop = stop or asyncio.Event()
    spans = _Spans(config, roaming)
    deadline = config.transport.deadlines.request
    host = (config.transport.bind_addr or "0.0.0.0:0").rsplit(":", 1)[0]
    looking = replace(config.transport, bind_addr=f"{host}:0", announce_addrs=())  # only dials: nothing to announce
    looker = await start_node(looking, {}, secret_key=node_key(config))
    looker.credential = config.member_cert
    try:
        swarms = await read_swarms(looker, config.join, deadline)
    finally:
        await looker.close()
    choice = choose_model(swarms.models, swarms.hosted, spans.of(swarms.models), config.cache_tokens)
    swarm = swarms.swarm_of[choice.model] if choice is not None else None
    while not stop.is_set():
        if choice is None:
            raise UsageError(
                "no model of the joined swarms can be loaded here: name one, or give --models-dir DIR holding "
                f"DIR/NAME for one of: {', '.join(sorted(swarms.models)) or 'none (no model record)'}"
            )
        log.info("serving %s (the swarm's %s before this server)", choice.model, _describe(choice))
        chosen = replace(config, model=model_source(choice.model, roaming.models_dirs),
                         join=tuple(t for t in config.join if t.swarm_id == swarm))  # fmt: skip
        inner = asyncio.Event()  # set by ``stop``, or by the watcher to switch
        found: list[tuple[Choice, str]] = []  # the switch, and the swarm of its model
        relay = asyncio.create_task(_relay(stop, inner))
        try:
            watch = _watcher(config, roaming, spans, inner, found)
            await serve(chosen, on_ready, inner, start_node=start_node, beside=watch if config.rebalance else None)
        finally:
            relay.cancel()
        if not found or stop.is_set():
            return
        choice, swarm = found[0]


def _watcher(
    config: ServerConfig, roaming: Roaming, spans: _Spans, stop: asyncio.Event, found: list[tuple[Choice, str]]
):
    """The re-check run beside the server (:func:`shoal.server.app.serve`'s ``beside``): a switch
    found goes into ``found`` and sets ``stop``."""
    rng = random.Random()

    async def watch(presence: Presence) -> None:
        switcher = Switcher(presence.node.id, config.balance_margin)
        while True:
            await asyncio.sleep(roaming.rebalance_period * rng.uniform(0.8, 1.2))
            swarms = await read_swarms(presence.node, config.join, config.transport.deadlines.request,
                                       own=presence.service.table)  # fmt: skip
            switch = switcher.check(swarms.models, swarms.hosted, spans.of(swarms.models), config.cache_tokens)
            if switch is not None:
                log.info("switching from %s to %s (%s)", presence.model, switch.model, _describe(switch))
                found.append((switch, swarms.swarm_of[switch.model]))
                stop.set()
                return

    return watch


async def _relay(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def _describe(choice: Choice) -> str:
    b = choice.before
    return (
        f"{b.uncovered} uncovered blocks" if b.uncovered else f"{b.bottleneck:.0f} free KV tokens at the weakest block"
    )
