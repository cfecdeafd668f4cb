"""Testifying: after a majority convicted a server, send the evidence to the servers that serve its blocks.

:meth:`Witness.report` is called by the audits (:mod:`shoal.client.auditors`) right after a
conviction, before the session rolls its history back: it builds the evidence there and then
(:func:`shoal.verify.evidence.build_evidence` copies what it needs) and sends it in the background
to at most :data:`MAX_JUDGES` other servers whose span covers the liar's blocks and that announce
:data:`~shoal.wire.schema.EVIDENCE`, in parallel, each within a timeout. Their judges
(:mod:`shoal.server.judge`) recompute and answer; the client counts ``evidence_sent``,
``evidence_confirmed`` and ``evidence_rejected`` in its :class:`~shoal.client.audit.Verification`.
Testimony is a service to the swarm, never a condition of generation: nothing here raises into it,
and what cannot be sent (no evidence, no judge, a judge that fails) is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shoal.client.audit import Verification
from shoal.client.history import SpanHistory
from shoal.errors import ShoalError
from shoal.ids import PeerId
from shoal.protocols import BLOCKS
from shoal.routing import ServerSpan
from shoal.transport import BaseNode
from shoal.verify.evidence import Evidence, NoEvidence, build_evidence
from shoal.wire.schema import EVIDENCE, EvidenceReply

log = logging.getLogger(__name__)

MAX_JUDGES = 8  # servers one piece of evidence goes to
#: seconds a judge may take per 1024 positions of evidence (it recomputes them at its lowest priority)
JUDGE_TIMEOUT = 30.0
CLOSE_TIMEOUT = 10.0  # seconds :meth:`Witness.close` waits for answers still on their way


class Witness:
    """Builds evidence of a settled lie and sends it, in the background, to every other server of
    the swarm that serves the liar's blocks; counts what the judges found in ``verification``."""

    def __init__(self, node: BaseNode, directory, verification: Verification):
        self.node = node
        self.directory = directory
        self.verification = verification
        self._tasks: set[asyncio.Task] = set()

    def judges(self, span: ServerSpan, liar: PeerId) -> list[ServerSpan]:
        """Who can judge a lie on ``span``'s blocks: other servers covering them that announce
        EVIDENCE (not the liar, nor anyone convicted), each once, at most :data:`MAX_JUDGES`."""
        banned = {liar, *self.verification.banned}
        found: dict[PeerId, ServerSpan] = {}
        for other in self.directory.spans:
            covers = other.start <= span.start and span.end <= other.end
            if covers and other.peer_id not in banned and other.supports(EVIDENCE) and other.ticket is not None:
                found.setdefault(other.peer_id, other)
        return list(found.values())[:MAX_JUDGES]

    def report(self, span: ServerSpan, liar: PeerId, position: int, history: SpanHistory) -> None:
        """``liar`` (the server of ``span``) answered wrong outputs from ``position`` on. Takes what
        the evidence needs from ``history`` now (the session rolls back right after), then testifies
        without blocking the session."""
        try:
            evidence = build_evidence(self.directory.model, span.blocks, liar, position, history)
        except NoEvidence as exc:
            log.warning("no evidence against %s on blocks %s to send: %s", liar[:10], span.blocks, exc)
            return
        except Exception:  # a bug here must not break generation
            log.exception("building evidence against %s failed", liar[:10])
            return
        judges = self.judges(span, liar)
        if not judges:
            log.info("nobody else serves blocks %s to judge the evidence against %s", span.blocks, liar[:10])
            return
        task = asyncio.get_running_loop().create_task(self._testify(evidence, judges))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _testify(self, evidence: Evidence, judges: list[ServerSpan]) -> None:
        timeout = JUDGE_TIMEOUT * max(1.0, evidence.positions / 1024)
        await asyncio.gather(*(self._send(evidence, judge, timeout) for judge in judges))

    async def _send(self, evidence: Evidence, judge: ServerSpan, timeout: float) -> None:
        self.verification.evidence_sent += 1
        accused = evidence.meta.accused[:10]
        try:
            reply = await self.node.request(judge.ticket, BLOCKS, evidence.message(), timeout=timeout)
            finding = reply.reply(EvidenceReply)
        except (ShoalError, TimeoutError) as exc:  # a bad reply is a WireError (a ShoalError)
            log.info("judge %s did not answer the evidence against %s: %s", judge.peer_id[:10], accused, exc)
            return
        if finding.confirmed:
            self.verification.evidence_confirmed += 1
            log.info("judge %s confirmed that %s lied", judge.peer_id[:10], accused)
        else:
            self.verification.evidence_rejected += 1
            log.warning("judge %s rejected the evidence against %s (%s): %s", judge.peer_id[:10], accused,
                        finding.reason, finding.detail)  # fmt: skip

    async def close(self) -> None:
        """Wait (bounded) for testimony still on its way, then stop."""
        tasks = list(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


__all__ = ["CLOSE_TIMEOUT", "JUDGE_TIMEOUT", "MAX_JUDGES", "Witness"]
