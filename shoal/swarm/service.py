"""Runs a :class:`~shoal.swarm.gossip.Gossiper` and the peer's :class:`~shoal.swarm.liveness.Liveness`
over the network (protocol ``shoal/swarm/2``).

Every gossip exchange is one request on a fresh stream of the pooled connection: a ``gossip``
message with metadata ``Gossip(op=...)`` and the payload (a :mod:`shoal.swarm.messages` struct as
msgpack) as one u8 tensor (payloads can exceed the header size limit). ``table`` answers a peer's
whole table (:class:`~shoal.swarm.messages.TableReply`), for clients and status tools, with the
servers it found unreachable or has not reached yet; ``ping`` and ``suspect`` are liveness's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from shoal.errors import RefusedError, RemoteError, ShoalError, TransportError
from shoal.swarm.gossip import GossipConfig, Gossiper, Outgoing
from shoal.swarm.liveness import MAX_REPORTED, PROBE_TIMEOUT_S, Liveness, Probe, Reach
from shoal.swarm.messages import (
    PushRequest,
    SuspectReply,
    SuspectRequest,
    TableReply,
    decode_payload,
    encode_payload,
)
from shoal.swarm.records import RecordError, ServerRecord, SignedRecord, decode
from shoal.swarm.table import RecordTable
from shoal.transport import BaseNode, MessageStream, Node, Protocol, Ticket, TransportConfig
from shoal.wire import InvalidMessage, Message, error_message
from shoal.wire.schema import Gossip

log = logging.getLogger(__name__)
SWARM = Protocol("swarm", 2)
MAX_FOLLOW_UPS = 4
MIN_WATCH_PERIOD = 0.5  # seconds: fast in-process gossip must not turn into a ping storm
MIN_LOOK_GAP = 0.05  # seconds between a report's wake-up and the probes it asks for
MAX_ADMIT = 64  # records :meth:`SwarmService.admit` probes at once at most
PULL_TRIES = 3  # rounds of syncs with the bootstrap peers while none answers (:meth:`SwarmService.pull`)
SMALL_SWARM = 16  # up to this many gossip peers, a server found unreachable is reported to all


def blob(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)


def blob_bytes(message: Message) -> bytes:
    if len(message.tensors) != 1 or message.tensors[0].dtype != torch.uint8 or message.tensors[0].dim() != 1:
        raise RecordError("malformed", "gossip payload must be one 1-d u8 tensor")
    return message.tensors[0].numpy().tobytes()


async def fetch_table(node: Node, ticket: Ticket, timeout: float) -> TableReply:
    """A peer's whole table: its records (as signed, not yet checked here) and its rejection counts;
    :class:`RecordError` if the answer does not validate."""
    reply = await node.request(ticket, SWARM, Message("gossip", 1, Gossip(op="table"), [blob(b"")]), timeout)
    return decode_payload(blob_bytes(reply), TableReply)


async def report_unreachable(node: BaseNode, tickets: Sequence[Ticket], peers: Sequence[str]) -> None:
    """Tell the swarm members of ``tickets`` that ``peers`` did not answer us (best effort: a member
    that does not answer is skipped)."""
    payload = encode_payload(SuspectRequest(peers=tuple(peers[:MAX_REPORTED])))

    async def one(ticket: Ticket) -> None:
        message = Message("gossip", 1, Gossip(op="suspect"), [blob(payload)])
        with contextlib.suppress(ShoalError, RemoteError):
            await node.request(ticket, SWARM, message, PROBE_TIMEOUT_S)

    await asyncio.gather(*(one(t) for t in tickets))


def table_from_reply(swarm: str, reply: TableReply) -> RecordTable:
    """A table of the records of ``reply`` that verify, with what its peer knows of whether their
    servers answer (:func:`adopt_reach`)."""
    table = RecordTable(swarm)
    table.merge_many(decode_table(reply))
    adopt_reach(table, reply)
    return table


def adopt_reach(table: RecordTable, reply: TableReply) -> None:
    """Take the answering peer's view of which servers of ``table`` answer: those it found
    unreachable are then left out of ``table.servers()``, as they are on that peer."""
    liveness = Liveness(self_id="")
    unreachable, unprobed = set(reply.unreachable), set(reply.unprobed)
    for record in table.servers(include_offline=True, include_unreachable=True):
        if record.peer not in unprobed:
            ok = record.peer not in unreachable
            liveness.probes[record.peer] = Probe(tuple(record.addrs), record.timestamp, ok, 0.0)
    table.liveness = liveness


async def reach_any(node: BaseNode, tickets: Sequence[Ticket], timeout: float) -> Ticket:
    """The first of ``tickets`` whose peer takes a swarm connection within ``timeout``, all dialled
    at once (the connection stays pooled for what follows). When none does, the first ticket's
    error: :class:`~shoal.errors.ConnectTimeout` for a peer that is gone."""
    if not tickets:
        raise ValueError("reach_any: no ticket given")

    async def dial(ticket: Ticket) -> Ticket:
        await node.connect(ticket, SWARM, timeout)
        return ticket

    dials = [asyncio.create_task(dial(ticket)) for ticket in tickets]
    try:
        for first_done in asyncio.as_completed(dials):
            with contextlib.suppress(ShoalError):
                return await first_done
        return await dials[0]  # every dial failed: raises the first one's error
    finally:
        for task in dials:
            task.cancel()
        await asyncio.gather(*dials, return_exceptions=True)


def join_failure(peers: Sequence[Ticket], timeout: float) -> ShoalError:
    """The one line a server whose ``--join`` peers did not answer within ``timeout`` exits with."""
    silence = "the --join peer did not answer" if len(peers) == 1 else f"none of the {len(peers)} --join peers answered"
    return ShoalError(
        f"cannot join the swarm: {silence} within {timeout:g} s (is it running, and is the "
        "ticket current? To start anyway, alone until a peer answers: --join-anyway)"
    )


async def check_join(tickets: Sequence[Ticket], transport: TransportConfig) -> None:
    """Before a server loads anything: does a peer of its ``--join`` tickets answer? Dialled from a
    throwaway endpoint (the server's own starts later), closed without lingering: a dead ticket
    fails in about the connect deadline. :func:`join_failure`'s error if none answers; a peer that
    answers and refuses raises its own error."""
    node = await Node.start(replace(transport, bind_addr=_any_port(transport.bind_addr), announce_addrs=()))
    try:
        await reach_any(node, tickets, transport.deadlines.connect)
    except RefusedError:
        raise
    except TransportError as exc:
        raise join_failure(tickets, transport.deadlines.connect) from exc
    finally:
        await node.close(linger=0.2)


def _any_port(bind_addr: str) -> str:
    host = bind_addr.rsplit(":", 1)[0] if ":" in bind_addr else bind_addr
    return f"{host}:0"


class SwarmService:
    """A peer's participation in a swarm: serve gossip, run rounds, refresh own records."""

    def __init__(
        self,
        node: Node,
        table: RecordTable,
        config: GossipConfig,
        bootstrap: list[Ticket],
        own_records: Callable[[], list[SignedRecord]] = list,
        rng: random.Random | None = None,
    ):
        self.node = node
        self.table = table
        self.config = config
        self.gossiper = Gossiper(table, node.id, config, rng)
        self.liveness = table.liveness = Liveness(node.id)
        self._look = asyncio.Event()  # a report came: probe without waiting for the round
        # watched servers are probed twice a gossip round: a crash shows within two rounds
        self.watch_period = max(config.period / 2, MIN_WATCH_PERIOD)
        self.bootstrap = {t.peer_id: t for t in bootstrap if t.peer_id != node.id}
        self.gossiper.extra_peers.update(self.bootstrap)
        self.own_records = own_records
        self._tasks: list[asyncio.Task] = []
        self._news = asyncio.Event()
        self._calls: set[asyncio.Task] = set()
        # A gossip call must not wait a whole request deadline on a peer that died with its
        # connection still pooled (QUIC notices only at its idle timeout).
        deadlines = node.config.deadlines
        self.call_timeout = min(deadlines.request, deadlines.connect + 2 * config.period)

    # ---- serving ------------------------------------------------------------------------------
    async def handle(self, stream: MessageStream, peer_id: str) -> None:
        while True:
            try:
                request = await stream.recv(self.node.config.deadlines.idle)
            except InvalidMessage as exc:  # well framed, bad metadata: answer, keep the stream
                self.table.rejected["malformed"] += 1
                await stream.send(error_message(exc.request_id, exc.code, exc.remote_message))
                continue
            try:
                if request.kind != "gossip":
                    raise RecordError("malformed", f"{request.kind!r} is not a swarm request")
                op = request.meta.op
                self.table.expire()  # never hand out records that have lapsed
                if op == "table":
                    reply = encode_payload(self._table_reply())
                elif op == "ping":
                    reply = b""
                elif op == "suspect":
                    reply = self._suspect(decode_payload(blob_bytes(request), SuspectRequest), peer_id)
                else:
                    reply = self.gossiper.handle(op, blob_bytes(request), peer_id)
                    self._wake()
            except RecordError as exc:
                self.table.rejected[exc.reason] += 1
                # past its budget a sender is told to come back later (BusyError), not that it erred
                code = "busy" if exc.reason == "rate_limited" else "bad_request"
                await stream.send(error_message(request.id, code, str(exc)))
                continue
            await stream.send(Message("result", request.id, tensors=[blob(reply)]))

    def _table_reply(self) -> TableReply:
        servers = self.table.servers(include_offline=True, include_unreachable=True)
        reach = {r.peer: self.table.reach(r) for r in servers}
        return TableReply(
            records=[s.data for s in self.table.records()],
            rejected=dict(self.table.rejected),
            unreachable=tuple(p for p, state in reach.items() if state is Reach.UNREACHABLE),
            unprobed=tuple(p for p, state in reach.items() if state is Reach.UNPROBED),
        )

    def _suspect(self, request: SuspectRequest, reporter: str) -> bytes:
        """``reporter`` says ``request.peers`` did not answer it: its word counts at once if this
        peer has reached it as a server, else it only makes this peer look (see :mod:`~shoal.swarm.liveness`)."""
        records = {r.peer: r for r in self.table.servers(include_offline=False, include_unreachable=True)}
        known = records.get(reporter)
        admitted = known is not None and self.table.reach(known) is Reach.REACHABLE
        self.liveness.reported(request.peers, reporter, admitted, records, time.monotonic())
        self._look.set()
        return encode_payload(SuspectReply())

    # ---- liveness ---------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Probe what :meth:`Liveness.due` says, every round or at once after a report."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._look.wait(), self.watch_period * random.uniform(0.8, 1.2))
            self._look.clear()
            await asyncio.sleep(MIN_LOOK_GAP)  # a burst of reports makes one round, not one each
            records = {r.peer: r for r in self.table.servers(include_offline=False, include_unreachable=True)}
            self.liveness.forget([p for p in list(self.liveness.probes) if p not in records])
            due = self.liveness.due(list(records.values()), time.monotonic())
            found = await asyncio.gather(*(self._probe(records[p]) for p in due))
            gone = [p for p, newly in zip(due, found, strict=True) if newly]
            if gone:
                log.info("servers not answering: %s", ", ".join(p[:10] for p in gone))
                self._tell_others(gone)

    async def admit(self, records: Sequence[ServerRecord], most: int = MAX_ADMIT) -> int:
        """Probe now, at once, those of ``records`` not reached yet (at most ``most``); how many it
        probed. A decision that counts only admitted servers (placement) need not wait for the
        watch rounds, which admit a big table a few records a round."""
        due = [r for r in records if self.table.reach(r) is Reach.UNPROBED and r.peer != self.node.id][:most]
        found = await asyncio.gather(*(self._probe(r) for r in due))
        gone = [r.peer for r, newly in zip(due, found, strict=True) if newly]
        if gone:
            log.info("servers not answering: %s", ", ".join(p[:10] for p in gone))
            self._tell_others(gone)
        return len(due)

    async def _probe(self, record: ServerRecord) -> bool:
        """Ping ``record``'s server; True when it newly found it unreachable."""
        ticket = Ticket(record.peer, record.addrs, record.relay, self.table.swarm)
        ok = False
        try:
            message = Message("gossip", 1, Gossip(op="ping"), [blob(b"")])
            await asyncio.wait_for(self.node.request(ticket, SWARM, message, PROBE_TIMEOUT_S), PROBE_TIMEOUT_S)
            ok = True
        except (ShoalError, RemoteError, TimeoutError) as exc:
            log.debug("probe of %s failed: %s", record.peer[:10], exc)
            if isinstance(exc, RemoteError):
                ok = True  # it answered, if only with an error: it is there
        return self.liveness.probed(record, ok, time.monotonic())

    def _tell_others(self, gone: list[str]) -> None:
        """Report ``gone`` to the gossip peers (all of a small swarm, else a few)."""
        peers = [p for p in self.gossiper.peers() if p not in gone]
        if len(peers) > SMALL_SWARM:
            peers = random.sample(peers, 2 * self.config.fanout)
        payload = encode_payload(SuspectRequest(peers=tuple(gone[:MAX_REPORTED])))
        for peer in peers:
            self._spawn_call(Outgoing(peer, "suspect", payload))

    # ---- calling --------------------------------------------------------------------------------
    def ticket_for(self, peer: str) -> Ticket | None:
        signed = self.table.get(f"s:{peer}")
        if signed is not None:
            record = signed.record
            return Ticket(peer, record.addrs, record.relay, self.table.swarm)
        return self.bootstrap.get(peer)

    async def call(self, out: Outgoing, depth: int = 0) -> bool:
        """Send ``out`` and take its reply (then its follow-ups); whether the peer answered."""
        ticket = self.ticket_for(out.peer)
        if ticket is None:
            return False
        try:
            message = Message("gossip", 1, Gossip(op=out.op), [blob(out.payload)])
            reply = await self.node.request(ticket, SWARM, message, self.call_timeout)
            if out.op == "suspect":
                return True
            follow_ups = self.gossiper.on_reply(out, blob_bytes(reply))
        except (ShoalError, RemoteError) as exc:
            log.debug("gossip %s to %s failed: %s", out.op, out.peer[:10], exc)
            return False
        self._wake()
        if depth < MAX_FOLLOW_UPS:
            await asyncio.gather(*(self.call(o, depth + 1) for o in follow_ups))
        return True

    def _wake(self) -> None:
        if self.gossiper.has_news():
            self._news.set()

    # ---- running --------------------------------------------------------------------------------
    def publish(self, signed: SignedRecord) -> None:
        self.gossiper.publish(signed)
        self._wake()

    async def pull(self, tries: int = PULL_TRIES) -> bool:
        """Sync with every bootstrap peer at once (the whole table on first contact, what changed
        after), again while none answered, ``tries`` rounds at most; whether one answered (True
        without bootstrap peers)."""
        for _ in range(tries):
            answered = await asyncio.gather(*(self.call(self.gossiper.join_sync(peer)) for peer in self.bootstrap))
            if any(answered):
                return True
        return not self.bootstrap

    async def join(self) -> bool:
        """Pull the whole table from the bootstrap peers (:meth:`pull`), then publish our records;
        whether a bootstrap peer answered."""
        answered = await self.pull()
        for signed in self.own_records():
            self.publish(signed)
        return answered

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._rounds()),
            asyncio.create_task(self._offers()),
            asyncio.create_task(self._watch()),
        ]

    async def _rounds(self) -> None:
        while True:
            await asyncio.sleep(self.config.period * random.uniform(0.8, 1.2))
            for signed in self.own_records():
                self.publish(signed)
            for out in self.gossiper.tick():
                self._spawn_call(out)

    def _spawn_call(self, out: Outgoing) -> None:
        task = asyncio.create_task(self.call(out))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _offers(self) -> None:
        while True:
            await self._news.wait()
            await asyncio.sleep(self.config.push_delay)
            self._news.clear()
            # not awaited: one offer to a peer that stopped answering must not hold back the next news
            for out in self.gossiper.take_offers():
                self._spawn_call(out)

    async def announce_to_all(self, signed: SignedRecord, timeout: float = 2.0) -> None:
        """Push ``signed`` straight to every known peer (used for the offline record at shutdown)."""
        self.gossiper.publish(signed)
        push = encode_payload(PushRequest(records=[signed.data]))
        outs = [Outgoing(peer, "push", push) for peer in self.gossiper.peers()]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(self.call(o) for o in outs)), timeout)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []


def decode_table(table: TableReply) -> list[SignedRecord]:
    """The records of ``table`` that decode and verify (a table's merge checks the rest)."""
    out = []
    for data in table.records:
        with contextlib.suppress(RecordError):
            out.append(decode(data))
    return out
