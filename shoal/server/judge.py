"""A server judging evidence that another server of its blocks lied (the ``evidence`` kind).

A client whose audits convicted a server (:mod:`shoal.client.verification.audit`) sends the evidence
(:mod:`shoal.verify.evidence`: the liar's signed receipts of one session and the tensors they name)
to the other servers of those blocks. The :class:`Judge` of each checks it
(:func:`~shoal.verify.evidence.check_evidence`: malformed, not judged here, forged), refuses a
replay, recomputes the accused's session statelessly with its own blocks (a sub-span when it serves
more) at the lowest priority of the compute thread (:meth:`SpanBackend.recompute`: its own sessions
never wait for it), and compares the disputed step's rows within the tolerance the accused's signed
codec and the dtypes allow. Confirmed: the liar is banned from this server's pushes for
:data:`~shoal.verify.receipts.LIAR_BAN_SECONDS`, and an unsigned verdict goes to
the :class:`Jurisdiction`'s ``publish`` (the server's swarm presence signs and gossips it; none outside a
swarm). Every finding is counted in the server's counters (``evidence_*``), every request exactly
once (received = confirmed + rejected): an error the checks did not foresee is a rejection too
(``malformed`` for a bad input, ``not_judged`` otherwise), never a dropped stream.

Judging costs a recompute, so strangers must not be able to make a judge work or remember without
bound: in a swarm (its :class:`Jurisdiction` gives the table) only an accused that the swarm's table
lists as an online server of this model covering the blocks is judged (a throwaway key that lies
to itself is not); at most :data:`MAX_WAITING` pieces of evidence wait or are judged at once, and
at most one of each sender (more are ``not_judged``: busy), so one sender cannot keep the judge from
everyone else's evidence; evidence against (or from) a peer this judge convicted already waits
last and is displaced by other evidence when the queue is full (:class:`Turns`), so valid evidence
against throwaway liars cannot keep the judge busy; at most :data:`MAX_LIARS` convictions are
remembered. In a swarm the accused is held to its table record: the pinned fingerprints (whatever
weights its receipts sign) and its announced compute label (the tolerance of no other). Evidence found
``forged`` or ``malformed`` never enters the ledger (it must not pre-empt the genuine evidence), so
its digest (every byte of it: :func:`blob_digest`) is remembered instead, the latest
:data:`MAX_FORGERIES`: the same blob again is answered at once with the same finding, counted as it
was, without its checks. Outside a swarm (no table) every accused is judged: the ban is this
server's alone.

The checks come cheapest first: the blob's digest with the structure, sizes and the disputed
output's digest against its receipt (one task), then the signatures, input digests and cache states
of at most :data:`RECEIPTS_PER_TASK` receipts per task (hashing and signatures of up to 8192 receipts
take a while). They hold no lock: a forgery is answered without waiting for another piece's
recompute. One piece of evidence that passed them is recomputed at a time (a replay is recognised
even when sent twice at once), in chunks of positions, then compared. All the work runs on the
compute thread at its lowest priority, in short tasks (tensor work on the event loop would give it
an OpenMP pool of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from torch import Tensor

from shoal.errors import BadRequest
from shoal.ids import BlockRange, PeerId
from shoal.server.backend import SpanBackend
from shoal.swarm.records import State
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import covers, verdict_for
from shoal.verify.compare import tolerance_of
from shoal.verify.evidence import (
    Announced,
    Bench,
    Case,
    Ledger,
    Reason,
    Rejected,
    check_evidence,
    check_part,
    finding,
)
from shoal.verify.receipts import LIAR_BAN_SECONDS, weights_digest
from shoal.wire import Message
from shoal.wire.schema import EvidenceReply, EvidenceRequest, ServerCounters, SpanInfo

log = logging.getLogger(__name__)
_encode = msgspec.msgpack.Encoder().encode

#: pieces of evidence waiting for this judge or being judged, at most (each may hold 64 MiB of tensors)
MAX_WAITING = 4
#: convicted peers remembered at most (the first to be released go first)
MAX_LIARS = 4096
#: receipts whose signatures and input digests one compute task checks at most
RECEIPTS_PER_TASK = 256
#: digests of evidence found forged or malformed remembered at most (the least recently seen go first)
MAX_FORGERIES = 1024
#: findings that depend on the evidence alone (not on the judge's state): a repeat is answered from memory
REMEMBERED = (Reason.FORGED, Reason.MALFORMED)
#: errors of an input the checks let through (shapes, values): ``malformed``; any other: ``not_judged``
BAD_INPUTS = (BadRequest, ValueError, IndexError, TypeError, KeyError)


@dataclass(frozen=True)
class Jurisdiction:
    """A judge's swarm (from the server's swarm presence): what its verdicts name, who it judges,
    where they go."""

    swarm: str  # the swarm id a verdict names
    table: RecordTable  # the swarm's servers: only those of them are judged
    publish: Callable[[Any], None]  # takes an unsigned VerdictRecord: signs and gossips it


class Judge:
    """Judges evidence for the server of ``info``'s span (``backend`` computes), counting in
    ``counters``; ``peer_id`` (the server's node) names the judge in its verdicts. Without a
    ``jurisdiction`` (outside a swarm) every accused is judged and no verdict is published."""

    def __init__(
        self,
        backend: SpanBackend,
        info: SpanInfo,
        counters: ServerCounters,
        peer_id: PeerId = PeerId(""),
        jurisdiction: Jurisdiction | None = None,
    ):
        self.backend = backend
        self.info = info
        self.counters = counters
        self.peer_id = peer_id
        self.publish_verdict = jurisdiction.publish if jurisdiction is not None else None
        self.swarm = jurisdiction.swarm if jurisdiction is not None else ""
        self.table = jurisdiction.table if jurisdiction is not None else None
        self.ledger = Ledger()
        self._liars: dict[PeerId, float] = {}  # convicted here: peer -> until (monotonic), soonest first
        self._lock = Turns()  # one piece recomputed at a time: evidence worth judging first
        self._entries: list[_Entry] = []  # requests in judge(), the one being judged included
        self._senders: set[PeerId] = set()  # who has a piece of evidence in judge() now (one each)
        self._forgeries: OrderedDict[bytes, Rejected] = OrderedDict()  # blob digest -> its finding

    def convicted(self, peer: PeerId) -> bool:
        """Whether this server convicted ``peer`` (recently): it never pushes a step to it."""
        until = self._liars.get(peer)
        if until is not None and until <= time.monotonic():
            del self._liars[peer]
            return False
        return until is not None

    async def judge(self, request: Message, sender: PeerId, draining: bool = False) -> Message:
        """The finding on an ``evidence`` request from ``sender``, as its result (:class:`EvidenceReply`)."""
        meta: EvidenceRequest = request.meta
        self.counters.evidence_received += 1
        try:
            if draining:
                raise Rejected(Reason.NOT_JUDGED, "this server is draining (leaving): it judges nothing")
            if sender in self._senders:
                raise Rejected(Reason.NOT_JUDGED, "busy: a piece of evidence of this sender is being judged already")
            entry = self._admit(meta, sender)
            self._senders.add(sender)
            try:
                case, wrong = await self._judge(meta, request.tensors, entry)
            finally:
                self._entries.remove(entry)
                self._senders.discard(sender)
        except Rejected as exc:
            return self._rejected(request, meta, exc)
        except asyncio.CancelledError:  # the server is going: counted, still
            self._count(Reason.NOT_JUDGED)
            raise
        except Exception as exc:  # unforeseen: a rejection all the same, the stream answered
            reason = Reason.MALFORMED if isinstance(exc, BAD_INPUTS) else Reason.NOT_JUDGED
            log.warning("judging the evidence against %s failed", meta.accused[:10], exc_info=True)
            return self._rejected(request, meta, Rejected(reason, f"{type(exc).__name__}: {exc}"))
        self.counters.evidence_confirmed += 1
        self._convict(case)
        detail = f"wrong from position {wrong} on blocks {case.blocks}"
        log.warning("evidence confirmed: server %s lied: %s", case.accused[:10], detail)
        return Message("result", request.id, EvidenceReply(confirmed=True, detail=detail))

    @property
    def _waiting(self) -> int:
        """Pieces of evidence in the queue (waiting or judged), displaced ones (leaving) not counted."""
        return sum(not e.displaced for e in self._entries)

    def _admit(self, meta: EvidenceRequest, sender: PeerId) -> _Entry:
        """A place in the bounded queue (:data:`MAX_WAITING`) or ``busy``. Evidence against a peer
        this judge convicted already, or from one it convicted, is *low*: it gains nothing (the
        liar is banned here already) and is what throwaway keys would send to keep a judge busy. A
        full queue takes other evidence by displacing a low piece not yet recomputed (answered
        ``busy``); low evidence finds a full queue busy."""
        low = self.convicted(meta.accused) or self.convicted(sender)
        if self._waiting >= MAX_WAITING:
            victim = None if low else next((e for e in self._entries if e.low and not e.started and not e.displaced),
                                           None)  # fmt: skip
            if victim is None:
                raise Rejected(Reason.NOT_JUDGED, f"busy: {self._waiting} pieces of evidence are waiting already")
            self._lock.displace(victim, Rejected(Reason.NOT_JUDGED, DISPLACED))
        entry = _Entry(low)
        self._entries.append(entry)
        return entry

    def _count(self, reason: Reason) -> None:
        self.counters.evidence_rejected += 1
        name = f"evidence_{reason.value}"
        setattr(self.counters, name, getattr(self.counters, name) + 1)

    def _rejected(self, request: Message, meta: EvidenceRequest, exc: Rejected) -> Message:
        self._count(exc.reason)
        log.info("evidence against %s rejected: %s", meta.accused[:10], exc)
        reply = EvidenceReply(confirmed=False, reason=exc.reason.value, detail=exc.detail[:4096])
        return Message("result", request.id, reply)

    def _check_accused(self, meta: EvidenceRequest) -> Announced | None:
        """``not_judged`` unless the swarm's table (if this judge has one) lists the accused as an
        online server of the model covering the blocks: anyone else costs a recompute for nothing.
        Returns what the table holds it to there (the pinned model record's fingerprints in its
        announced quantization, its announced compute label); None outside a swarm."""
        table = self.table
        if table is None:
            return None
        now, blocks = table.clock(), BlockRange(meta.start, meta.end)
        listed = next((
            r for r in table.servers(meta.model)
            if r.peer == meta.accused and r.state is State.ONLINE and r.expires > now and covers(r, blocks)
        ), None)  # fmt: skip
        if listed is not None:  # its record's fingerprints are the model record's (the table checks them)
            first = blocks.start - listed.start
            pinned = tuple(f.hex() for f in listed.fingerprints[first : first + len(blocks)])
            return Announced(weights_digest(pinned, listed.quantization.value), listed.compute)
        raise Rejected(Reason.NOT_JUDGED, f"the accused is no online server of blocks {blocks} of {meta.model!r} "
                       "in this server's swarm table")  # fmt: skip

    async def _judge(self, meta: EvidenceRequest, tensors: list, entry: _Entry | None = None) -> tuple[Case, int]:
        """(the case, the first wrong position); raises :class:`Rejected`. The checks run outside the
        lock (they are stateless): a forgery is found without waiting for another piece's recompute."""
        entry = entry if entry is not None else _Entry(False)
        announced = self._check_accused(meta)
        case = await self._checked(meta, tensors, announced)
        background = self.backend.in_background
        async with self._lock.turn(entry):
            if case.key in self.ledger:  # after the forged checks: a tampered copy of judged evidence is forged
                raise Rejected(Reason.REPLAYED, "this evidence was judged here before")
            self.ledger.add(case.key)  # only now: evidence that fails its checks cannot pre-empt the real one
            try:
                recomputed = await self.backend.recompute(
                    case.hidden, case.position_ids, case.mask, case.blocks.start, case.blocks.end,
                    adapter=case.adapter,
                )  # fmt: skip
                tolerance = tolerance_of(case.output.dtype, self.info.dtype, case.disputed.codec, self.backend.device,
                                         other=case.compute)  # fmt: skip
                wrong = await background(finding, case, recomputed, tolerance)
            except Rejected:  # judged (framing): a replay is one
                raise
            except BaseException:
                self.ledger.discard(case.key)  # not judged after all (shutting down, a bad input)
                raise
        return case, wrong

    async def _checked(self, meta: EvidenceRequest, tensors: list, announced: Announced | None = None) -> Case:
        """The evidence through every check (cheap ones first, in one task with its digest; then the
        signatures and digests in parts), or the finding remembered for this very blob."""
        background = self.backend.in_background
        bench = Bench.of(self.info, self.peer_id)
        known = self._forgeries.__contains__
        digest, outcome = await background(_intake, meta, tensors, bench, known, announced)
        try:
            known = self._forgeries.get(digest)
            if known is not None:  # seen before: the same finding, without its checks
                self._forgeries.move_to_end(digest)
                raise Rejected(known.reason, known.detail)
            if outcome is None:  # forgotten since the task looked: checked after all
                outcome = await background(_cheap_checks, meta, tensors, bench, announced)
            if isinstance(outcome, Rejected):
                raise outcome
            steps = len(outcome.receipts)
            for first in range(0, steps, RECEIPTS_PER_TASK):
                await background(check_part, outcome, first, min(first + RECEIPTS_PER_TASK, steps))
        except Rejected as exc:
            if exc.reason in REMEMBERED:
                self._remember(digest, exc)
            raise
        return outcome

    def _remember(self, digest: bytes, finding: Rejected) -> None:
        self._forgeries[digest] = finding
        self._forgeries.move_to_end(digest)
        while len(self._forgeries) > MAX_FORGERIES:
            self._forgeries.popitem(last=False)

    def _convict(self, case: Case) -> None:
        """Ban the liar from this server's pushes; hand the verdict to the swarm (if any)."""
        now, liars = time.monotonic(), self._liars
        for peer in [p for p, until in liars.items() if until <= now]:  # every ban lasts as long: by age
            del liars[peer]
        liars.pop(case.accused, None)
        liars[case.accused] = now + LIAR_BAN_SECONDS
        while len(liars) > MAX_LIARS:
            del liars[next(iter(liars))]
        if self.publish_verdict is None:
            return
        record = verdict_for(
            swarm=self.swarm, judge=self.peer_id, accused=case.accused, model=case.model,
            blocks=BlockRange(case.blocks.start, case.blocks.end), evidence=case.digest, receipt=case.disputed,
        )  # fmt: skip
        try:
            self.publish_verdict(record)
        except Exception:  # the verdict stands here; the swarm hears of it from another judge
            log.exception("could not publish the verdict against %s", case.accused[:10])


#: what a piece of evidence displaced from the queue is told
DISPLACED = "busy: displaced by evidence against a server not convicted here (this one's accused or sender is)"


@dataclass(eq=False)
class _Entry:
    """A piece of evidence in a judge's queue: ``low`` priority or not, whether its recompute
    ``started``, whether it was ``displaced`` (it leaves ``busy``)."""

    low: bool
    started: bool = False
    displaced: Rejected | None = None
    future: asyncio.Future | None = None  # while it waits for its turn


class Turns:
    """Whose recompute is next: one at a time, every other piece of evidence before a low one, then
    in arrival order. ``acquire``/``release`` take a turn as a plain lock would (at normal priority)."""

    def __init__(self) -> None:
        self._held = False
        self._queue: list[tuple[bool, int, _Entry]] = []
        self._arrivals = itertools.count()

    def locked(self) -> bool:
        return self._held

    async def acquire(self, entry: _Entry | None = None) -> None:
        entry = entry if entry is not None else _Entry(False)
        if entry.displaced is not None:
            raise entry.displaced
        if not self._held:  # free: nobody waits either (release hands the turn to a waiter first)
            self._held, entry.started = True, True
            return
        entry.future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (entry.low, next(self._arrivals), entry))
        try:
            await entry.future
        except asyncio.CancelledError:
            if entry.future.done() and not entry.future.cancelled() and entry.future.exception() is None:
                self.release()  # handed the turn as it was cancelled: pass it on
            raise
        entry.started = True

    def release(self) -> None:
        while self._queue:
            _, _, entry = heapq.heappop(self._queue)
            if entry.future is not None and not entry.future.done():
                entry.future.set_result(None)  # the turn passes on, still held
                return
        self._held = False

    def displace(self, entry: _Entry, reason: Rejected) -> None:
        """``entry`` leaves with ``reason`` instead of waiting for its turn (now, or when it asks)."""
        entry.displaced = reason
        if entry.future is not None and not entry.future.done():
            entry.future.set_exception(reason)

    @contextlib.asynccontextmanager
    async def turn(self, entry: _Entry):
        await self.acquire(entry)
        try:
            yield
        finally:
            self.release()


def blob_digest(meta: EvidenceRequest, tensors: Sequence[Tensor]) -> bytes:
    """sha256 of every byte of a piece of evidence (metadata, each tensor's dtype, shape and data):
    only the very same blob is answered from memory, so a forged copy of genuine receipts never
    stands for the genuine evidence. On the compute thread (a torch view of any dtype as bytes)."""
    digest = hashlib.sha256(_encode(meta))
    for tensor in tensors:
        digest.update(f"{tensor.dtype}{list(tensor.shape)}".encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy())
    return digest.digest()


def _cheap_checks(
    meta: EvidenceRequest, tensors: Sequence[Tensor], bench: Bench, announced: Announced | None = None
) -> Case | Rejected:
    """:func:`check_evidence` but the signatures and input digests; its finding returned, not raised."""
    try:
        return check_evidence(meta, tensors, bench, costly=False, announced=announced)
    except Rejected as exc:
        return exc


def _intake(
    meta: EvidenceRequest,
    tensors: Sequence[Tensor],
    bench: Bench,
    known: Callable[[bytes], bool],
    announced: Announced | None = None,
) -> tuple[bytes, Case | Rejected | None]:
    """One compute task: the blob's digest and, unless ``known`` (found forged or malformed before:
    a lookup in the judge's memory, one atomic dict read from this thread), the cheap checks."""
    digest = blob_digest(meta, tensors)
    return digest, None if known(digest) else _cheap_checks(meta, tensors, bench, announced)


__all__ = [
    "BAD_INPUTS",
    "MAX_FORGERIES",
    "MAX_LIARS",
    "MAX_WAITING",
    "RECEIPTS_PER_TASK",
    "Judge",
    "Jurisdiction",
    "blob_digest",
]
