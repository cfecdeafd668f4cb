"""A server's part in a swarm (:class:`Presence`: its records, its measured throughput, where it
sits and when it moves), and the :class:`LoadingGate` its node answers through while a span loads.

Without ``--blocks`` the server measures its throughput (:mod:`shoal.server.throughput`), reads the
swarm's table, chooses the span that best fills the weakest part of the swarm's coverage
(:mod:`shoal.server.placement`), and every ``balance_period`` re-checks whether moving would clearly
help; a move announces the new span as ``joining``, drains the old span, loads the new one and
announces it ``online``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

from shoal.checkpoints import model_name
from shoal.errors import Forbidden, RefusedError, ShoalError, TransportError
from shoal.ids import BlockRange
from shoal.protocols import BLOCKS, WEIGHTS
from shoal.server.announce import Announcement
from shoal.server.handler import BlockServer
from shoal.server.judge import Jurisdiction
from shoal.server.placement import Balance, Placed, choose_span, counted, plan_move
from shoal.server.preflight import CheckedServer
from shoal.server.throughput import announced_throughput, cached_compute, default_num_blocks, measure_network
from shoal.swarm.liveness import Reach
from shoal.swarm.members import refusal
from shoal.swarm.records import ServerRecord, State
from shoal.swarm.service import SWARM, SwarmService, fetch_table, join_failure, reach_any
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import VerdictKeeper, convicted
from shoal.transport import BaseNode, Handler, Protocol, Ticket
from shoal.weights.give import Giver
from shoal.wire import InvalidMessage, error_message

log = logging.getLogger(__name__)
MAX_DEFERRALS = 3  # re-checks in a row a server leaves a move to another one
ADMIT_ROUNDS = 3  # rounds of probes of unreached records before a joining server places itself
Loader = Callable[[BlockRange], Awaitable[BlockServer]]  # loads a span on the compute thread


class LoadingGate:
    """The node's handlers, bound before there is anything to answer with: the blocks protocol
    answers ``busy`` while no span is loaded (starting, or moving), the swarm protocol ends streams
    that come before the server's presence exists. In a private swarm it is also where a peer's
    streams enter, so where membership is checked, once per stream (:meth:`refusal`): a non-member's
    first request is answered ``forbidden`` and its stream ends; a member that may only serve is
    refused sessions and forwards (its pushes, gossip and evidence are served)."""

    def __init__(self) -> None:
        self.server: BlockServer | None = None  # the span served now
        self.presence: Presence | None = None  # the server's part in the swarm, once made
        self.giver: Giver | None = None  # gives the model's weights to peers, when this server holds them

    def handlers(self, swarm: bool) -> dict[Protocol, Handler]:
        """Per protocol, what answers (``swarm``: the server takes part in one)."""
        return {BLOCKS: self.blocks, SWARM: self.swarm, WEIGHTS: self.weights} if swarm else {BLOCKS: self.blocks}

    def refusal(self, peer_id: str, serving: bool = True) -> str | None:
        """Why ``peer_id`` may not use this server (``serving``: as a server; else as a client), or
        None: anyone in a public swarm; in a private one, a member, as its certificate says."""
        presence = self.presence
        if presence is None or not presence.service.table.id.private or peer_id == presence.node.id:
            return None
        table, node = presence.service.table, presence.node
        return refusal(node.credentials.get(peer_id), peer_id, table.id, time.time(), table.revoked, serving=serving)

    async def _refuse(self, stream, why: str) -> None:
        request = await stream.recv(5.0)
        await stream.send(error_message(request.id, "forbidden", why))

    async def blocks(self, stream, peer_id: str) -> None:
        if (why := self.refusal(peer_id)) is not None:
            await self._refuse(stream, why)
            return
        server = self.server
        if server is None:
            request = await stream.recv(5.0)
            await stream.send(error_message(request.id, "busy", "server is still loading its blocks"))
            return
        serve_only = self.refusal(peer_id, serving=False)  # passed only when there is one: handle's usual call
        await (server.handle(stream, peer_id) if serve_only is None else server.handle(stream, peer_id, serve_only))

    async def weights(self, stream, peer_id: str) -> None:
        if (why := self.refusal(peer_id)) is not None:
            await self._refuse(stream, why)
        elif self.giver is None:
            try:
                request = await stream.recv(5.0)
            except InvalidMessage as exc:
                await stream.send(error_message(exc.request_id, exc.code, exc.remote_message))
                return
            await stream.send(error_message(request.id, "not_found", "this server gives no weights"))
        else:
            await self.giver.handle(stream, peer_id)

    async def swarm(self, stream, peer_id: str) -> None:
        if (why := self.refusal(peer_id)) is not None:
            await self._refuse(stream, why)
        elif self.presence is not None:
            await self.presence.service.handle(stream, peer_id)


class Presence:
    """A server's part in a swarm: its announcement, its measurement, where it sits, its moves."""

    def __init__(
        self, checked: CheckedServer, node: BaseNode, key: bytes, swarm_id: str, gate: LoadingGate, compute: Executor
    ):
        config = checked.config
        self.config, self.node, self.gate, self.compute = config, node, gate, compute
        self.hf_config = checked.model.hf_config  # read once, by the preflight
        self.total = checked.model.num_blocks
        self.model = model_name(config.model)
        self.rng = random.Random()
        self.leaving = False
        blocks = config.blocks or BlockRange(0, 1)  # until placed: nothing is announced without fingerprints
        self.announcement = Announcement(
            node, key, swarm_id, self.model, blocks, fingerprints=[], throughput=0.0, gossip=config.gossip,
            quantization=config.quant, cert=config.member_cert,
        )  # fmt: skip
        table = RecordTable(swarm_id, max_lifetime=max(3600.0, 2 * config.gossip.expiry))
        self.service = SwarmService(node, table, config.gossip, list(config.join), self.own_records)
        self.announcement.service = self.service
        # kept a day, even while the accused is away
        self.verdicts = VerdictKeeper(key, self.service.publish, cert=config.member_cert)

    @property
    def jurisdiction(self) -> Jurisdiction:
        """What every span this server loads judges in: its swarm, its table, its verdicts (signed,
        gossiped, re-signed while online)."""
        table = self.service.table
        return Jurisdiction(table.swarm, table, self.verdicts.add)

    async def join(self) -> None:
        """Join the swarm through the tickets given, gossip from now on, and measure (or take the
        given) throughput before choosing or announcing a span. Unless ``join_anyway``, a peer of
        the tickets must answer first: a stale ticket would leave the server serving alone, unseen."""
        peers = [t for t in self.config.join if t.peer_id != self.node.id]
        if peers and not self.config.join_anyway:
            reached = await self._reach(peers)
            if self.service.table.id.private:  # say at once when the swarm will not have this server
                try:
                    await fetch_table(self.node, reached, self.config.transport.deadlines.request)
                except Forbidden as exc:
                    raise ShoalError(f"cannot join the swarm: {exc}") from None
        if not await self.service.join():
            log.warning("no peer of the tickets gave its table yet: gossip brings it")
        self.service.start()
        await self.measure()

    async def _reach(self, peers: list[Ticket]) -> Ticket:
        """The first peer of ``peers`` that answers; fail in one line, within the connect deadline,
        when none does."""
        timeout = self.config.transport.deadlines.connect
        try:
            return await reach_any(self.node, peers, timeout)
        except RefusedError:
            raise  # it answered, and refused: its own error says why
        except TransportError as exc:
            raise join_failure(peers, timeout) from exc

    def own_records(self) -> list:
        """Due for (re)publication: the server's records, and its verdicts until it leaves."""
        return [*self.announcement.records(), *([] if self.leaving else self.verdicts.due())]

    @property
    def announced(self) -> bool:
        a = self.announcement
        return bool(a.fingerprints) and len(a.fingerprints) == len(a.blocks)

    def publish(self) -> None:
        self.service.publish(self.announcement.server_record(time.time()))

    def announce_span(self, span: BlockRange, fingerprints: list[str], state: State) -> None:
        if self.leaving:  # e.g. a load still running on the compute thread at shutdown
            return
        a = self.announcement
        a.blocks = span
        a.fingerprints, a.state = fingerprints, state
        self.publish()

    def known_fingerprints(self, span: BlockRange) -> list[str] | None:
        """The span's fingerprints from the swarm's model record (None without one)."""
        record = self.service.table.model(self.model)
        if record is None or record.num_blocks != self.total:
            return None
        return [record.fingerprints[i].hex() for i in span.blocks()]

    # ---- measuring -------------------------------------------------------------------------
    async def measure(self) -> None:
        """Fill the announcement's throughput and step_ms: given, or measured (cached)."""
        a, config = self.announcement, self.config
        if config.throughput is not None:
            a.throughput = config.throughput
            a.step_ms = 1000.0 / config.throughput if config.throughput > 0 else 0.0
            return
        loop = asyncio.get_running_loop()
        measure = functools.partial(cached_compute, quantization=config.quant)
        compute, cached = await loop.run_in_executor(self.compute, measure, self.hf_config, config.dtype, config.device)
        network = None
        peers = [t for t in config.join if t.peer_id != self.node.id]
        if peers:
            network = await measure_network(self.node, peers[0])
        a.throughput = round(announced_throughput(compute, network, self.hf_config.hidden_size), 3)
        a.step_ms = round(compute.step_ms, 4)
        log.info(
            "throughput %.1f tokens/s per block (%s: step %.3f ms, prefill %.0f tokens/s; network %s)",
            a.throughput, "cached" if cached else "measured", compute.step_ms, compute.prefill_tokens_per_s,
            "not measured" if network is None else f"{network / 2**20:.0f} MiB/s",
        )  # fmt: skip

    # ---- placement -------------------------------------------------------------------------
    def records(self) -> list[ServerRecord]:
        """Every record of this model's servers in the table, whatever its state or reach."""
        return self.service.table.servers(self.model, include_offline=True, include_unreachable=True)

    def placed(self) -> list[Placed]:
        """The servers of this model that placement counts (:func:`placeable`)."""
        return placeable(self.service.table, self.model, self.node.id, time.time())

    async def choose(self) -> BlockRange:
        config = self.config
        n = config.num_blocks
        if n is None:
            n = default_num_blocks(
                self.hf_config,
                config.dtype,
                config.device,
                config.cache_tokens,
                quantization=config.quant,
                packed=config.packed_weights,
            )
        n = min(n, self.total)
        if not config.new_swarm:  # let servers starting at the same time see each other's choices
            await asyncio.sleep(config.gossip.period * self.rng.uniform(1.0, 2.0))
            # the table as the peers hold it now: the join's pull may have failed or its records
            # expired since (a loaded machine placed servers over an empty table, as on a new swarm)
            if not await self.service.pull():
                log.warning("no peer of the tickets answered: placing by the table gossip brought")
            # placement counts only servers this one has reached (counted): reach them now, and
            # those whose records came meanwhile (servers starting together)
            for _ in range(ADMIT_ROUNDS):
                if not await self.service.admit([r for r in self.records() if r.state is not State.OFFLINE]):
                    break
        others = [p for p in self.placed() if p.peer != self.node.id]
        span = choose_span(others, self.total, n, self.announcement.throughput, self.rng)
        seen = sum(r.peer != self.node.id for r in self.records())
        log.info("placed at blocks %s of %d (%d servers counted of %d records)", span, self.total, len(others), seen)
        return span

    async def keep_balanced(self, load: Loader) -> None:
        """Every ``balance_period`` (+-20%): move when :func:`plan_move` says it clearly helps. A
        server that defers to another one (which should move first) does so ``MAX_DEFERRALS`` checks
        in a row at most: that one may never move (started with ``--blocks``)."""
        deferred = 0
        while True:
            await asyncio.sleep(self.config.balance_period * self.rng.uniform(0.8, 1.2))
            plan = plan_move(
                self.placed(), self.total, self.node.id, self.rng, self.config.balance_margin,
                defer=deferred < MAX_DEFERRALS,
            )  # fmt: skip
            if plan.defer_to is not None:
                deferred += 1
                log.debug("placement: leaving the next move to %s", plan.defer_to[:10])
                continue
            deferred = 0
            move = plan.move
            if move is None:
                continue
            a = self.announcement
            log.info(
                "moving from blocks %s to %s: swarm %s -> %s%s", a.blocks, move.blocks,
                describe_balance(move.before), describe_balance(move.after),
                f" (expected {describe_balance(move.expected)} once others follow)" if move.neutral else "",
            )  # fmt: skip
            await self.move(move.blocks, load)

    async def move(self, span: BlockRange, load: Loader) -> None:
        fingerprints = self.known_fingerprints(span)
        if fingerprints is not None:
            self.announce_span(span, fingerprints, State.JOINING)
        old = self.gate.server
        if old is not None:
            await old.drain(self.config.drain_timeout)
        self.gate.server = None  # new requests get "busy" until the new span is loaded
        del old  # its weights and caches go (the compute thread stays: it is shared)
        self.gate.server = await load(span)
        self.announce_online()

    def announce_online(self) -> None:
        server = self.gate.server
        self.announcement.cache_tokens_free = server.budget.free_tokens
        self.announcement.adapters = tuple((a.name, a.digest) for a in server.info.adapters)
        self.announcement.compute = server.info.compute
        self.announce_span(server.info.blocks, server.info.fingerprints, State.ONLINE)
        for signed in self.announcement.records():
            self.service.publish(signed)

    async def track_cache(self) -> None:
        """Free cache changes with sessions: republish early when it moved by more than 10%. The
        batcher's queue is sampled every period too, and signed with the next record."""
        a = self.announcement
        while True:
            await asyncio.sleep(self.config.gossip.period)
            server = self.gate.server
            if server is None or a.state is not State.ONLINE:
                continue
            a.queued = server.backend.batcher.queued
            free = server.budget.free_tokens
            if abs(free - a.cache_tokens_free) > 0.1 * server.budget.capacity_tokens:
                a.cache_tokens_free = free
                self.publish()

    async def leave(self) -> None:
        """Publish the offline record to every peer at once (before draining)."""
        self.leaving = True
        if self.announced:
            await self.service.announce_to_all(self.announcement.set_state(State.OFFLINE))


def placeable(table: RecordTable, model: str, me: str, now: float) -> list[Placed]:
    """What placement weighs in ``table`` (:func:`~shoal.server.placement.counted`): every record of
    ``model``'s servers, those of them this peer (``me``) has reached, and whom the swarm's verdicts
    convict (a server's view: judges it has reached)."""
    records = table.servers(model, include_offline=True, include_unreachable=True)
    admitted = {r.peer for r in records if table.reach(r) is Reach.REACHABLE}
    return counted(records, now, admitted, convicted(table, model, now), me=me)


def describe_balance(balance: Balance) -> str:
    if balance.uncovered:
        return f"{balance.uncovered} uncovered blocks"
    return f"bottleneck {balance.bottleneck:.3g} tokens/s"


__all__ = ["MAX_DEFERRALS", "Loader", "LoadingGate", "Presence", "describe_balance", "placeable"]
