"""Which models a gateway serves, whether the swarm covers each now, and their engines.

``shoal api MODEL --join ...`` serves the models it names; ``shoal api --join ...`` with none
serves every model the joined swarms list (each swarm's table holds a model record per model: a
pinned swarm one, a private swarm those its owner added; join several pinned swarms to serve
several models). A model's coverage is merged over every joined swarm that lists it
(:func:`coverage_of`): a block counts as covered when some online server of any of them hosts it.

A request for a model the swarms list but do not cover now is refused with 503
(``model_unavailable``) before anything loads; once servers cover it again it is served again.
Engines are made on first use and held in a :class:`~shoal.gateway.pool.ModelPool` under the
memory budget. Standalone servers' tickets name no swarm and list no model: a model named on
the command line is served over them with no coverage check, as before.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from shoal.checkpoints import model_source
from shoal.errors import ShoalError
from shoal.gateway.engine import Engine, GatewayError, Totals
from shoal.gateway.pool import ModelPool
from shoal.gateway.swarm import Watchers
from shoal.routing.chain import format_blocks
from shoal.transport import Ticket

log = logging.getLogger(__name__)

__all__ = ["COVERAGE_WAIT", "Catalog", "Coverage", "coverage_of"]

COVERAGE_WAIT = 2.0  # seconds a request waits for the swarms' tables before it goes by the last look


@dataclass(frozen=True)
class Coverage:
    """A model as the joined swarms hold it now."""

    name: str
    num_blocks: int
    uncovered: tuple[int, ...]  # blocks no online server hosts
    servers_online: int
    swarms: tuple[str, ...]  # the swarms whose tables list it
    peers: frozenset[str] = frozenset()  # its online servers

    @property
    def covered(self) -> bool:
        return not self.uncovered

    def as_json(self) -> dict:
        return {"num_blocks": self.num_blocks, "covered": self.covered, "uncovered": list(self.uncovered),
                "servers_online": self.servers_online, "swarms": list(self.swarms)}  # fmt: skip


def coverage_of(statuses: Sequence[dict]) -> dict[str, Coverage]:
    """Every model the swarm statuses (:func:`shoal.swarm.status.summarize`) list, coverage merged
    over them; a status no member answered for (``via`` None) is left out."""
    merged: dict[str, tuple[list[int], int, list[str]]] = {}
    peers: dict[str, set[str]] = {}
    for status in statuses:
        if status.get("via") is None:
            continue
        for model in status["models"]:
            counts, online, swarms = merged.setdefault(model["name"], ([0] * model["num_blocks"], 0, []))
            if len(counts) != model["num_blocks"]:  # two swarms disagree on the model's shape: the first wins
                log.warning("swarm %s lists %s with %d blocks, another %d", status["swarm"], model["name"],
                            model["num_blocks"], len(counts))  # fmt: skip
                continue
            counts[:] = [a + b for a, b in zip(counts, model["coverage"], strict=True)]
            online += sum(s["state"] == "online" for s in model["servers"])
            peers.setdefault(model["name"], set()).update(s["peer"] for s in model["servers"] if s["state"] == "online")
            merged[model["name"]] = (counts, online, [*swarms, status["swarm"]])
    found = {}
    for name, (counts, online, swarms) in sorted(merged.items()):
        uncovered = tuple(i for i, n in enumerate(counts) if n == 0)
        found[name] = Coverage(name, len(counts), uncovered, online, tuple(swarms), frozenset(peers.get(name, ())))
    return found


class Catalog:
    """The served models: their coverage, their engines (loaded on first use), their totals.

    ``named``: model name -> what to load it from (``shoal api MODEL``); empty with ``every``: the
    joined swarms' models, loaded from :func:`shoal.checkpoints.model_source`. ``make(path, tickets)`` builds an engine
    over ``tickets``: the plain ones and those of the swarms that list the model."""

    def __init__(
        self,
        join: Sequence[Ticket],
        watchers: Watchers | None,
        make: Callable[[str, str, tuple[Ticket, ...]], Engine],
        size: Callable[[str], int],
        budget: int,
        *,
        named: dict[str, str] | None = None,
        every: bool = False,
        models_dirs: Sequence[Path] = (),
    ):
        self.join = tuple(join)
        self.watchers = watchers
        self.named = dict(named or {})
        self.every = every
        self.models_dirs = tuple(models_dirs)
        self._make = make
        self._coverage: dict[str, Coverage] = {}
        self._totals: dict[str, Totals] = {}
        self._seen: dict[str, frozenset[str]] = {}  # the online servers each loaded client last listed
        self._pulling: asyncio.Future | None = None  # the pull of the swarms' tables under way (fresh)
        self._lock = threading.Lock()
        self.pool: ModelPool[Engine] = ModelPool(self._load, lambda name: size(self.path(name)), budget,
                                                 close=lambda engine: engine.model.close())  # fmt: skip

    @classmethod
    def of_engine(cls, engine: Engine) -> Catalog:
        """A catalog of one engine made already (no swarm to check coverage in, never evicted)."""
        catalog = cls((), None, lambda name, path, tickets: engine, lambda path: 0, 1, named={engine.model_id: ""})
        if getattr(engine, "totals", None) is not None:  # the engine's own counters, whichever app shows them
            catalog._totals[engine.model_id] = engine.totals
        catalog.pool.acquire(engine.model_id)
        catalog.pool.release(engine.model_id)
        return catalog

    def path(self, name: str) -> str:
        return self.named.get(name) or model_source(name, self.models_dirs)

    # ---- coverage ----------------------------------------------------------------------------------
    async def refresh(self) -> dict[str, Coverage]:
        """Every joined swarm's models and their coverage now (each swarm's table pulled at most every
        half second, see :class:`~shoal.gateway.swarm.SwarmWatcher`)."""
        swarms = {t.swarm_id: t for t in self.join if t.swarm_id}
        if self.watchers is None or not swarms:
            return {}
        statuses = await asyncio.gather(*(self.watchers.of(t).status() for t in swarms.values()))
        coverage = coverage_of(statuses)
        with self._lock:
            self._coverage = coverage
        return coverage

    async def fresh(self) -> dict[str, Coverage]:
        """The coverage now, or the last look's when a pull takes longer than ``COVERAGE_WAIT`` (a
        swarm member that stopped answering must not hold up every request): one pull at a time
        runs in the background, and the next request sees what it found."""
        if self._pulling is None or self._pulling.done():
            self._pulling = asyncio.ensure_future(self.refresh())
        pulling = self._pulling  # another request may start the next pull while this one waits
        done, _ = await asyncio.wait({pulling}, timeout=COVERAGE_WAIT)
        if done and pulling.exception() is None:
            return pulling.result()
        return self.known()

    async def served(self) -> dict[str, Coverage | None]:
        """The models served, each with its coverage (None: no joined swarm lists it)."""
        coverage = await self.fresh()
        names = list(self.named) if self.named or not self.every else list(coverage)
        return {name: coverage.get(name) for name in names}

    async def check(self, name: str) -> None:
        """Refuse a request for ``name``: 404 when this gateway does not serve it, 503 when the
        swarms list it but do not cover it now."""
        served = await self.served()
        if name not in served:
            which = ", ".join(served) or "none yet"
            raise GatewayError(404, f"The model `{name}` does not exist (this gateway serves: {which}).",
                               param="model", code="model_not_found")  # fmt: skip
        coverage = served[name]
        if coverage is not None and not coverage.covered:
            coverage = self._with_hosted(name, coverage)
        if coverage is not None and not coverage.covered:
            blocks = format_blocks(list(coverage.uncovered))
            raise GatewayError(
                503,
                f"model {name} is not served now: no online server hosts blocks {blocks} of its "
                f"{coverage.num_blocks}; it is served again once servers cover them",
                "server_error",
                param="model",
                code="model_unavailable",
            )
        if coverage is not None:
            await self._catch_up(name, coverage)

    def _with_hosted(self, name: str, coverage: Coverage) -> Coverage:
        """``coverage`` with the blocks this gateway serves itself (``--serve-blocks``) counted: its own
        span is up while its engine is loaded, however long the swarm's tables take to list it."""
        engine = self.pool.peek(name)
        blocks = getattr(engine.model, "blocks", None) if engine is not None else None
        hosted = getattr(blocks, "hosted", None)
        span = getattr(getattr(blocks, "config", None), "local_blocks", None)
        if hosted is None or span is None or hosted.task.done():
            return coverage
        return replace(coverage, uncovered=tuple(b for b in coverage.uncovered if not span.start <= b < span.end))

    async def _catch_up(self, name: str, coverage: Coverage) -> None:
        """Have ``name``'s loaded client list its servers again when the swarms show servers it has not
        seen (say a server that came back after the model lost coverage): a session opens only over
        the servers a client knows, which it otherwise pulls again every ``refresh_period``."""
        engine = self.pool.peek(name)
        with self._lock:
            seen = self._seen.get(name, frozenset())
        if engine is None or coverage.peers <= seen:
            return
        blocks = engine.model.blocks
        directory, runtime = getattr(blocks, "directory", None), getattr(blocks, "runtime", None)
        if directory is not None and runtime is not None:
            future = asyncio.run_coroutine_threadsafe(directory.refresh(), runtime.loop)
            try:
                await asyncio.wrap_future(future)
            except ShoalError as exc:  # the session's own routing says what is missing, if anything
                log.warning("listing the servers of %s again failed: %s", name, exc)
        with self._lock:
            self._seen[name] = coverage.peers

    # ---- engines -----------------------------------------------------------------------------------
    def totals(self, name: str) -> Totals:
        """What ``name``'s engines generated since start (kept across evictions)."""
        with self._lock:
            return self._totals.setdefault(name, Totals())

    def _tickets(self, name: str) -> tuple[Ticket, ...]:
        with self._lock:
            coverage = self._coverage.get(name)
        if coverage is None:
            return self.join  # no swarm lists it (standalone servers, or not pulled yet): every ticket
        return tuple(t for t in self.join if not t.swarm_id or t.swarm_id in coverage.swarms)

    def _load(self, name: str) -> Engine:
        log.info("loading model %s", name)
        with self._lock:
            coverage = self._coverage.get(name)
        engine = self._make(name, self.path(name), self._tickets(name))
        with self._lock:
            self._seen[name] = coverage.peers if coverage is not None else frozenset()
        engine.totals = self.totals(name)
        return engine

    def engines(self) -> list[Engine]:
        """The engines loaded now."""
        return [engine for name in self.pool.loaded() if (engine := self.pool.peek(name)) is not None]

    def routes(self) -> list[list[dict]]:
        return [route for engine in self.engines() for route in engine.routes()]

    def known(self) -> dict[str, Coverage]:
        """The coverage the last look found (no pull)."""
        with self._lock:
            return dict(self._coverage)
