"""Testifying: after a majority convicted a server, send the evidence to the servers that serve its blocks.

:meth:`Witness.report` is called by the audits (:mod:`shoal.client.verification.auditors`) right after a
conviction, before the session rolls its history back. It only copies, there and then, the part of
the history the evidence can need (:class:`Snapshot`: sized from the shapes first, nothing copied
when too large; one serial numpy copy each; no signature or digest work on the event loop, which
would stall generation for up to a second on a long session); a worker thread of the witness then
builds the evidence (:func:`shoal.verify.evidence.build_evidence`:
signature checks and digests, hashlib and cryptography calls, no torch parallel ops, so that thread
never opens an OpenMP pool of its own) and the evidence goes, in parallel and each within a
timeout, to at most :data:`MAX_JUDGES` other servers whose span covers the liar's blocks and that
announce :data:`~shoal.wire.schema.EVIDENCE` (one piece at a time to each: a judge refuses a
sender's second piece while the first is judged); a judge that does not answer, or is busy or
draining, is replaced by the next such server (:data:`MAX_CANDIDATES` in all). Their judges
(:mod:`shoal.server.judge`) recompute and answer; the client counts ``evidence_sent``,
``evidence_confirmed`` and ``evidence_rejected`` in its :class:`~shoal.client.verification.audit.Verification`.

One witness serves a whole client (:class:`~shoal.client.remote.sequence.RemoteSequence`), not a session:
testimony outlives the session that caught the lie (a lie found at generate()'s final audit is
still testified to and counted), and closing the client waits for it, at most
:data:`CLOSE_TIMEOUT`. Testimony is a service to the swarm, never a condition of generation:
nothing here raises into it, and what cannot be sent (no evidence, no judge, a judge that fails)
is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from torch import Tensor

from shoal.client.remote.history import SpanHistory
from shoal.client.verification.audit import Verification
from shoal.errors import ShoalError
from shoal.ids import BlockRange, PeerId
from shoal.protocols import BLOCKS
from shoal.routing import ServerSpan
from shoal.transport import BaseNode
from shoal.verify.evidence import MAX_EVIDENCE_BYTES, MAX_EVIDENCE_POSITIONS, Evidence, NoEvidence, build_evidence
from shoal.wire.schema import EVIDENCE, EvidenceReply, Receipt
from shoal.wire.tensors import serial_copy

log = logging.getLogger(__name__)

MAX_JUDGES = 8  # servers one piece of evidence goes to (at once)
#: servers tried at most for one piece of evidence: a judge that does not answer, or is busy or
#: draining, is replaced by the next one covering the blocks
MAX_CANDIDATES = 2 * MAX_JUDGES
#: seconds a judge may take per 1024 positions of evidence (it recomputes them at its lowest priority)
JUDGE_TIMEOUT = 30.0
#: seconds closing the client waits for testimony still on its way (then it is abandoned)
CLOSE_TIMEOUT = 30.0


class Snapshot:
    """What evidence against a liar on ``blocks`` for ``position`` can need from a session's
    history, copied (the session truncates it right after): the receipts of the hop, and the inputs
    of ``blocks.start`` and outputs at ``blocks.end`` up to the end of the latest receipt covering
    the position. Answers as the history does (:class:`shoal.verify.evidence.History`).

    It runs on the event loop, so it sizes the evidence from the history's shapes first and copies
    nothing when the evidence would be refused anyway (past :data:`MAX_EVIDENCE_POSITIONS`, or more
    than :data:`MAX_EVIDENCE_BYTES` of inputs alone): no gigabyte copy for nothing. Then every tensor
    is copied once, by numpy; a slice handed to the builder that is not contiguous is copied by numpy
    on the builder's thread, never by torch (``.contiguous()`` there would open an OpenMP pool)."""

    def __init__(self, history: SpanHistory, blocks: BlockRange, position: int, through: int | None = None):
        self.blocks = blocks
        self._receipts: list[Receipt] = history.receipts(blocks.start)  # a new list of frozen receipts
        last = position if through is None else max(position, through - 1)  # the comparison's last position
        covering = [r for r in self._receipts if (r.start, r.end) == (blocks.start, blocks.end)
                    and r.position <= last and position < r.position + r.n]  # fmt: skip
        here = [r.position + r.n for r in covering if r.position <= position]
        if not here:
            raise NoEvidence(f"no receipt covers position {position} of blocks {blocks}")
        shortest = min(here)  # the disputed step ends here or later
        if shortest > MAX_EVIDENCE_POSITIONS:
            raise NoEvidence(f"the lie at position {position} is in a step ending past the evidence's "
                             f"{MAX_EVIDENCE_POSITIONS} positions")  # fmt: skip
        least = least_evidence_bytes(history, blocks.start, shortest)
        if least > MAX_EVIDENCE_BYTES:
            raise NoEvidence(f"at least {least} bytes of evidence, past {MAX_EVIDENCE_BYTES}")
        self.end = min(max(r.position + r.n for r in covering), MAX_EVIDENCE_POSITIONS)
        self.begin = min(r.position for r in covering)  # the disputed step starts here or later
        try:
            window = history.window(blocks.start, 0, self.end)
            output = history.hidden(blocks.end, self.begin, self.end)
        except ShoalError as exc:
            raise NoEvidence(f"the history lacks the evidence's tensors: {exc}") from None
        self._inputs = [serial_copy(t) for t in window]  # one copy each, by numpy
        self._output = serial_copy(output)

    def receipts(self, block: int) -> list[Receipt]:
        return list(self._receipts) if block == self.blocks.start else []

    def window(self, block: int, start: int, end: int) -> list[Tensor]:
        if block != self.blocks.start or not 0 <= start <= end <= self.end:
            raise ShoalError(f"the snapshot holds no inputs of block {block} at {start}:{end}")
        hidden, position_ids = self._inputs[0][:, start:end], self._inputs[1][:, start:end]
        if len(self._inputs) == 2 or np.all(self._inputs[2][:, :end].numpy()):
            return [hidden, position_ids]
        return [hidden, position_ids, self._inputs[2][:, :end]]

    def hidden(self, block: int, start: int, end: int) -> Tensor:
        if block != self.blocks.end or not self.begin <= start <= end <= self.end:
            raise ShoalError(f"the snapshot holds no outputs at block {block} at {start}:{end}")
        rows = self._output[:, start - self.begin : end - self.begin]
        return rows if rows.is_contiguous() else serial_copy(rows)  # digested as is: numpy copies


def _unheard(finding: EvidenceReply) -> bool:
    """A judge's answer that judged nothing for the moment: busy or draining (another may judge it)."""
    return (
        not finding.confirmed
        and finding.reason == "not_judged"
        and finding.detail.startswith(("busy", "this server is draining"))
    )


def least_evidence_bytes(history: SpanHistory, block: int, end: int) -> int:
    """The fewest bytes evidence over ``[0, end)`` at ``block`` carries (its hidden states and
    position ids), from the history's shapes alone; 0 when there is no history there (the copy
    finds that out)."""
    recorded = history.recorded(block)
    if recorded is None:
        return 0
    _, hidden_size, dtype = recorded
    return history.batch_size * end * (hidden_size * dtype.itemsize + 8)


class Witness:
    """Builds evidence of a settled lie and sends it, in the background, to every other server of
    the swarm that serves the liar's blocks; counts what the judges found in ``verification``. One
    per client; :meth:`close` it with the client."""

    def __init__(self, node: BaseNode, directory, verification: Verification):
        self.node = node
        self.directory = directory
        self.verification = verification
        self._tasks: set[asyncio.Task] = set()
        self._builder: ThreadPoolExecutor | None = None  # started with the first testimony
        self._at_judge: dict[PeerId, asyncio.Lock] = {}  # one piece at a time per judge (it refuses more)
        self._closed = False

    def judges(self, span: ServerSpan, liar: PeerId) -> list[ServerSpan]:
        """Who can judge a lie on ``span``'s blocks: other servers covering them that announce
        EVIDENCE (not the liar, nor anyone convicted), each once, at most :data:`MAX_CANDIDATES`
        (:data:`MAX_JUDGES` asked at once, the rest in reserve)."""
        banned = {liar, *self.verification.banned}
        found: dict[PeerId, ServerSpan] = {}
        for other in self.directory.spans:
            covers = other.start <= span.start and span.end <= other.end
            if covers and other.peer_id not in banned and other.supports(EVIDENCE) and other.ticket is not None:
                found.setdefault(other.peer_id, other)
        return list(found.values())[:MAX_CANDIDATES]

    def report(
        self, span: ServerSpan, liar: PeerId, position: int, history: SpanHistory, through: int | None = None
    ) -> None:
        """``liar`` (the server of ``span``) answered wrong outputs from ``position`` on, as a
        comparison up to ``through`` found (its steps there are disputed too). Copies what the
        evidence needs from ``history`` now (the session rolls back right after), then builds and
        sends it without blocking the session."""
        if self._closed:
            return
        judges = self.judges(span, liar)
        if not judges:
            log.info("nobody else serves blocks %s to judge the evidence against %s", span.blocks, liar[:10])
            return
        try:
            snapshot = Snapshot(history, span.blocks, position, through)
        except NoEvidence as exc:
            log.warning("no evidence against %s on blocks %s to send: %s", liar[:10], span.blocks, exc)
            return
        except Exception:  # a bug here must not break generation
            log.exception("copying the evidence against %s failed", liar[:10])
            return
        testimony = self._testify(span.blocks, liar, position, snapshot, judges, through)
        task = asyncio.get_running_loop().create_task(testimony)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _testify(
        self, blocks: BlockRange, liar: PeerId, position: int, snapshot: Snapshot, judges: list[ServerSpan],
        through: int | None = None,
    ) -> None:  # fmt: skip
        if self._builder is None:
            self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-witness")
        build = (build_evidence, self.directory.model, blocks, liar, position, snapshot, through)
        try:
            evidence = await asyncio.get_running_loop().run_in_executor(self._builder, *build)
        except NoEvidence as exc:
            log.warning("no evidence against %s on blocks %s to send: %s", liar[:10], blocks, exc)
            return
        except Exception:  # a bug here must not break generation
            log.exception("building evidence against %s failed", liar[:10])
            return
        timeout = JUDGE_TIMEOUT * max(1.0, evidence.positions / 1024)
        reserve = list(judges)

        async def lane() -> None:  # one judge at a time; the next in reserve when it gives no finding
            while reserve:
                judge = reserve.pop(0)
                if await self._send(evidence, judge, timeout):
                    return
                if reserve:
                    log.info("retrying the evidence against %s with judge %s", liar[:10], reserve[0].peer_id[:10])

        await asyncio.gather(*(lane() for _ in range(min(MAX_JUDGES, len(reserve)))))

    async def _send(self, evidence: Evidence, judge: ServerSpan, timeout: float) -> bool:
        """Sends ``evidence`` to ``judge`` once this client's previous piece there was answered: a
        judge takes one piece of each sender at a time (a second one at once would be ``busy``).
        Whether it gave a finding: False when it did not answer or was busy or draining (another
        judge is tried instead)."""
        accused = evidence.meta.accused[:10]
        lock = self._at_judge.setdefault(judge.peer_id, asyncio.Lock())
        async with lock:
            self.verification.evidence_sent += 1
            try:
                reply = await self.node.request(judge.ticket, BLOCKS, evidence.message(), timeout=timeout)
                finding = reply.reply(EvidenceReply)
            except (ShoalError, TimeoutError) as exc:  # a bad reply is a WireError (a ShoalError)
                log.info("judge %s did not answer the evidence against %s: %s", judge.peer_id[:10], accused, exc)
                return False
        if _unheard(finding):
            log.info("judge %s could not take the evidence against %s now: %s", judge.peer_id[:10], accused,
                     finding.detail)  # fmt: skip
            return False
        if finding.confirmed:
            self.verification.evidence_confirmed += 1
            log.info("judge %s confirmed that %s lied", judge.peer_id[:10], accused)
        else:
            self.verification.evidence_rejected += 1
            log.warning("judge %s rejected the evidence against %s (%s): %s", judge.peer_id[:10], accused,
                        finding.reason, finding.detail)  # fmt: skip
        return True

    async def settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the testimony on its way; whether none is left."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        return not self._tasks

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Wait (at most ``timeout``) for testimony still on its way, then stop; later reports are ignored."""
        self._closed = True
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._builder is not None:
            self._builder.shutdown(wait=False, cancel_futures=True)


__all__ = [
    "CLOSE_TIMEOUT",
    "JUDGE_TIMEOUT",
    "MAX_CANDIDATES",
    "MAX_JUDGES",
    "Snapshot",
    "Witness",
    "least_evidence_bytes",
]
