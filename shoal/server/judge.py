"""A server judging evidence that another server of its blocks lied (the ``evidence`` kind).

A client whose audits convicted a server (:mod:`shoal.client.audit`) sends the evidence
(:mod:`shoal.verify.evidence`: the liar's signed receipts of one session and the tensors they name)
to the other servers of those blocks. The :class:`Judge` of each checks it
(:func:`~shoal.verify.evidence.check_evidence`: malformed, not judged here, forged), refuses a
replay, recomputes the accused's session statelessly with its own blocks (a sub-span when it serves
more) at the lowest priority of the compute thread (:meth:`SpanBackend.recompute`: its own sessions
never wait for it), and compares the disputed step's rows within the tolerance the accused's signed
codec and the dtypes allow. Confirmed: the liar is banned from this server's pushes for
:data:`~shoal.verify.receipts.LIAR_BAN_SECONDS`, and an unsigned verdict goes to
:attr:`Judge.publish_verdict` (the server's swarm presence signs and gossips it; None outside a
swarm). Every finding is counted in the server's counters (``evidence_*``).

One piece of evidence is judged at a time (a replay is recognised even when sent twice at once);
the checks and the comparison run on the compute thread too (hashing and signatures of up to 8192
receipts take a while, and tensor work on the event loop would give it an OpenMP pool of its own).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from shoal.ids import BlockRange, PeerId
from shoal.server.backend import SpanBackend
from shoal.swarm.verdicts import verdict_for
from shoal.verify.compare import tolerance_of
from shoal.verify.evidence import Bench, Case, Ledger, Reason, Rejected, check_evidence, finding
from shoal.verify.receipts import LIAR_BAN_SECONDS
from shoal.wire import Message
from shoal.wire.schema import EvidenceReply, EvidenceRequest, ServerCounters, SpanInfo

log = logging.getLogger(__name__)


class Judge:
    """Judges evidence for the server of ``info``'s span (``backend`` computes), counting in
    ``counters``. ``peer_id`` (set when the server attaches its node) names the judge;
    ``publish_verdict`` and ``swarm`` are set by the swarm presence."""

    def __init__(self, backend: SpanBackend, info: SpanInfo, counters: ServerCounters):
        self.backend = backend
        self.info = info
        self.counters = counters
        self.peer_id: PeerId = PeerId("")
        self.publish_verdict: Callable[[Any], None] | None = None  # takes an unsigned VerdictRecord
        self.swarm = ""  # the swarm id a verdict names
        self.ledger = Ledger()
        self._liars: dict[PeerId, float] = {}  # convicted here: peer -> until (monotonic)
        self._lock = asyncio.Lock()

    def convicted(self, peer: PeerId) -> bool:
        """Whether this server convicted ``peer`` (recently): it never pushes a step to it."""
        until = self._liars.get(peer)
        if until is not None and until <= time.monotonic():
            del self._liars[peer]
            return False
        return until is not None

    async def judge(self, request: Message, draining: bool = False) -> Message:
        """The finding on an ``evidence`` request, as its result (:class:`EvidenceReply`)."""
        meta: EvidenceRequest = request.meta
        self.counters.evidence_received += 1
        try:
            if draining:
                raise Rejected(Reason.NOT_JUDGED, "this server is draining (leaving): it judges nothing")
            case, wrong = await self._judge(meta, request.tensors)
        except Rejected as exc:
            self.counters.evidence_rejected += 1
            name = f"evidence_{exc.reason.value}"
            setattr(self.counters, name, getattr(self.counters, name) + 1)
            log.info("evidence against %s rejected: %s", meta.accused[:10], exc)
            reply = EvidenceReply(confirmed=False, reason=exc.reason.value, detail=exc.detail[:4096])
            return Message("result", request.id, reply)
        self.counters.evidence_confirmed += 1
        self._convict(case)
        detail = f"wrong from position {wrong} on blocks {case.blocks}"
        log.warning("evidence confirmed: server %s lied: %s", case.accused[:10], detail)
        return Message("result", request.id, EvidenceReply(confirmed=True, detail=detail))

    async def _judge(self, meta: EvidenceRequest, tensors: list) -> tuple[Case, int]:
        """(the case, the first wrong position); raises :class:`Rejected`."""
        bench = Bench.of(self.info, self.peer_id)
        async with self._lock:
            case: Case = await self.backend.in_background(check_evidence, meta, tensors, bench)
            if case.key in self.ledger:
                raise Rejected(Reason.REPLAYED, "this evidence was judged here before")
            self.ledger.add(case.key)  # only now: evidence that fails its checks cannot pre-empt the real one
            try:
                recomputed = await self.backend.recompute(
                    case.hidden, case.position_ids, case.mask, case.blocks.start, case.blocks.end,
                    adapter=case.disputed.adapter or None,
                )  # fmt: skip
            except BaseException:
                self.ledger.discard(case.key)  # not judged after all (shutting down, a bad input)
                raise
            tolerance = tolerance_of(case.output.dtype, self.info.dtype, case.disputed.codec, self.backend.device)
            wrong = await self.backend.in_background(finding, case, recomputed, tolerance)
        return case, wrong

    def _convict(self, case: Case) -> None:
        """Ban the liar from this server's pushes; hand the verdict to the swarm (if any)."""
        self._liars[case.accused] = time.monotonic() + LIAR_BAN_SECONDS
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


__all__ = ["Judge"]
