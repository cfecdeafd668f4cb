"""The I/O of audit mode: a session's auditors, their audit rounds, and the third replica that settles a dispute.

What is decided (who lied, when an audit is due, what a new hop's track inherits) is in
:mod:`shoal.client.verification.audit`, with the design; this module opens the sessions, sends the steps and
forwards, and compares the answers. In redundant mode (``verification.redundant``) the auditors
are the second chain: no server of the session's chain is ever taken as an auditor, and one that
joins the chain (a repair put it there) is replaced. Everything runs on the client's event loop, called
by the session (:mod:`shoal.client.remote.session`), which does the repair a
:class:`~shoal.client.verification.audit.Conviction` asks for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from shoal.client.remote.feedback import RouteFeedback, RoutePlanner
from shoal.client.remote.history import SpanHistory
from shoal.client.remote.hops import Hop, close_all
from shoal.client.remote.recovery import RECOVERY_TIMEOUT, ChainRecovery, Replay
from shoal.client.verification.audit import (
    Conviction,
    Track,
    Verdict,
    Verification,
    audit_due,
    majority,
    successor,
    take_spare,
    tolerance_of,
)
from shoal.client.verification.witness import Witness
from shoal.errors import ShoalError
from shoal.ids import BlockRange, PeerId
from shoal.protocols import BLOCKS
from shoal.routing import ServerSpan
from shoal.transport import BaseNode
from shoal.verify.compare import Tolerance, first_disagreement
from shoal.wire import Codec, Message
from shoal.wire.schema import ForwardRequest

log = logging.getLogger(__name__)

STAFF_TRIES = 3  # servers tried to open an auditor on, per hop
SETTLE_TRIES = 3  # third replicas tried to settle one dispute

__all__ = ["Audits"]


@dataclass(frozen=True)
class _Dispute:
    index: int  # of the hop in the chain
    track: Track
    position: int  # the first position where auditor and audited server disagree
    start: int  # the audit covered [start, end)
    end: int
    auditor_out: Tensor = field(repr=False)  # [B, end - start, H]


class Audits:
    """The audits of one session: a :class:`Track` per hop of its chain. ``replay`` runs one step on
    a hop (``position`` where it starts); ``compression``: the session's codec (it loosens the
    tolerance where lossy)."""

    def __init__(
        self,
        node: BaseNode,
        planner: RoutePlanner,
        feedback: RouteFeedback,
        recovery: ChainRecovery,
        replay: Replay,
        verification: Verification,
        *,
        compression: Codec,
        request_deadline: float,
        adapter: str | None = None,
        witness: Witness | None = None,
    ):
        self.node = node
        self.witness = witness  # testifies against the servers convicted here
        self.planner = planner
        self.feedback = feedback
        self.recovery = recovery
        self.replay = replay
        self.verification = verification
        self.every = verification.audit_every
        self.compression = compression
        self.request_deadline = request_deadline
        self.adapter = adapter
        self.tracks: list[Track] = []
        self._warned = False  # unverified spans are logged once a session, not at every chain change

    # ---- following the chain -------------------------------------------------------------------

    async def follow(self, hops: Sequence[Hop], history: SpanHistory, position: int, adopted: Collection[int]) -> None:
        """Tracks for a chain just installed: kept for hops that stay, new for new hops. A new hop's
        outputs for ``[0, position)`` were thrown away (the history kept the old chain's), unless a
        replay's output became a boundary's history (its end block in ``adopted``): then those are
        audited too. An auditor whose hop left audits its replacement if it can."""
        staying = {id(h) for h in hops}
        kept = {id(t.hop): t for t in self.tracks if id(t.hop) in staying}
        left = [t for t in self.tracks if id(t.hop) not in staying]
        spare = [t.auditor for t in left if t.auditor is not None]
        tracks, staff = [], []
        shunned = {*self.verification.banned, *self._chain_peers(hops)}
        for hop in hops:
            track = kept.get(id(hop))
            if track is not None and track.auditor is not None and track.auditor.span.peer_id in shunned:
                spare.append(track.auditor)  # redundant: it joined the main chain, so it checks nothing
                track.auditor = None
                staff.append(track)
            if track is None:
                track = successor(hop, left, position, hop.span.end in adopted)
                track.auditor = take_spare(spare, hop, shunned)
                if track.auditor is None:
                    staff.append(track)
            tracks.append(track)
        self.tracks = tracks
        await close_all(spare)
        await asyncio.gather(*(self._staff(track, history) for track in staff))
        self._report()

    async def _staff(self, track: Track, history: SpanHistory, exclude: Collection[str] = ()) -> None:
        """Open an auditor for ``track`` and bring its cache to ``track.audited`` (a replay of the
        recorded inputs); none to be had: the track is unverified."""
        span = track.hop.span
        tried = {span.peer_id, *exclude, *self.verification.banned, *self._chain_peers(t.hop for t in self.tracks)}
        for _ in range(STAFF_TRIES):
            replica = self.planner.route_replica(span, exclude=tried, cache_tokens=self.recovery.cache_tokens,
                                                 needs=self.recovery.needs)  # fmt: skip
            if replica is None:
                break
            tried.add(replica.peer_id)
            try:
                auditor = await self.recovery.open_hop(replica, RECOVERY_TIMEOUT)
            except ShoalError as exc:
                self.feedback.failed(replica.peer_id)
                log.info("could not open an auditor on %s: %s", replica.peer_id[:10], exc)
                continue
            if track.audited:
                try:
                    await self.replay(auditor, history.window(span.start, 0, track.audited), track.audited, 0)
                except (ShoalError, TimeoutError) as exc:
                    self.feedback.failed(replica.peer_id)
                    await auditor.abort()
                    log.info("auditor %s failed its replay: %s", replica.peer_id[:10], exc)
                    continue
            track.auditor = auditor
            return
        track.unverified = True

    def _chain_peers(self, hops: Iterable[Hop]) -> set[PeerId]:
        """The servers no auditor may be: in redundant mode, every server of the main chain."""
        return {hop.span.peer_id for hop in hops} if self.verification.redundant else set()

    def rolled_back(self, position: int) -> None:
        """Positions from ``position`` on are gone: the hops will compute them again, themselves."""
        for track in self.tracks:
            track.audited = min(track.audited, position)
            track.since = min(track.since, position)

    def _report(self) -> None:
        blocks = tuple(b for t in self.tracks if not t.checked for b in t.hop.span.blocks.blocks())
        self.verification.unverified, self.verification.unverified_blocks = blocks, len(blocks)
        if blocks and not self._warned:
            self._warned = True
            spans = ", ".join(str(t.hop.span.blocks) for t in self.tracks if not t.checked)
            log.warning("blocks %s are unverified in this session: no second server checks them", spans)

    def verified(self) -> dict[tuple[int, int], bool]:
        """Whether each hop's span ``(start, end)`` is checked by an auditor."""
        return {(t.hop.span.start, t.hop.span.end): t.checked for t in self.tracks}

    def checked_up_to(self, position: int) -> int:
        """Positions ``[0, result)`` every checked hop has been audited for (a streamer holding
        tokens back releases those)."""
        return min((t.audited for t in self.tracks if t.checked), default=position)

    def due(self, position: int) -> bool:
        return any(t.checked and audit_due(t.audited, position, self.every) for t in self.tracks)

    def pending(self, position: int) -> bool:
        return any(t.checked and t.audited < position for t in self.tracks)

    async def close(self) -> None:
        await close_all([t.auditor for t in self.tracks if t.auditor is not None])  # not the witness: the client's

    def _tolerance(self, span: ServerSpan, recorded: Tensor) -> Tolerance:
        return tolerance_of(recorded.dtype, span.info.dtype, self.compression)

    # ---- audit rounds --------------------------------------------------------------------------

    async def round(self, history: SpanHistory, position: int) -> Conviction | None:
        """Audit every checked hop up to ``position`` (in parallel: the auditors are different
        servers), then settle the disputes, earliest position first. Returns the first lie of an
        audited server (the session repairs it; later disputes are moot: they are at or after it)."""
        for track in self.tracks:  # an auditor convicted meanwhile (as another hop's server) is replaced
            if track.auditor is not None and track.auditor.span.peer_id in self.verification.banned:
                auditor, track.auditor = track.auditor, None
                await auditor.abort()
                await self._staff(track, history)
        due = [(i, t) for i, t in enumerate(self.tracks) if t.checked and t.audited < position]
        found = await asyncio.gather(*(self._audit(i, t, history, position) for i, t in due))
        disputes = sorted((d for d in found if d is not None), key=lambda d: (d.position, d.index))
        try:
            for dispute in disputes:
                verdict, wrong, peer = await self._settle(dispute, history)
                track = dispute.track
                if verdict is Verdict.AUDITED:
                    self.verification.settled += 1
                    liar = track.producer(wrong)
                    if liar is not None:
                        self.convict(liar, track.hop.span.blocks, wrong)
                        if self.witness is not None:  # before the session rolls its history back
                            self.witness.report(track.hop.span, liar, wrong, history)
                    replace = wrong >= track.since
                    return Conviction(dispute.index, liar, track.hop.span.blocks, wrong, replace)
                if verdict is Verdict.AUDITOR:
                    self.verification.settled += 1
                    self.convict(peer, track.hop.span.blocks, dispute.position)
                    auditor, track.auditor = track.auditor, None
                    if auditor is not None:
                        await auditor.abort()
                    await self._staff(track, history)  # its hop's positions since `audited` are audited again
                else:
                    self.verification.unsettled += 1
                    track.unverified = True
                    log.warning("dispute over blocks %s at position %d unsettled: they are unverified from now on",
                                track.hop.span.blocks, dispute.position)  # fmt: skip
            return None
        finally:
            self._report()

    def convict(self, peer: PeerId, blocks: BlockRange | None = None, position: int | None = None) -> None:
        """Ban ``peer`` for good and count it (once), with the blocks and position it was caught at."""
        if peer not in self.verification.banned:
            self.verification.convicted(peer, blocks, position)
        self.feedback.convicted(peer)

    async def _audit(self, index: int, track: Track, history: SpanHistory, end: int) -> _Dispute | None:
        """One auditor step over ``[track.audited, end)``; a dispute if its outputs differ."""
        span, auditor = track.hop.span, track.auditor
        start = track.audited
        tensors = history.window(span.start, start, end)
        try:
            out = await self.replay(auditor, tensors, end - start, start)
        except (ShoalError, TimeoutError) as exc:  # a dead auditor is no evidence: find another
            log.info("auditor %s failed (%s); replacing it", auditor.span.peer_id[:10], exc)
            self.feedback.failed(auditor.span.peer_id)
            track.auditor = None
            await auditor.abort()
            await self._staff(track, history, exclude=(auditor.span.peer_id,))
            return None
        self.verification.audits += 1
        self.verification.audited_positions += end - start
        mask = _window_mask(tensors, start)
        recorded = history.hidden(span.end, start, end)
        first = first_disagreement(recorded, out, self._tolerance(span, recorded), mask)
        if first is None:
            track.audited = end
            return None
        self.verification.disagreements += 1
        log.warning("auditor %s disagrees with %s on blocks %s at position %d", auditor.span.peer_id[:10],
                    span.peer_id[:10], span.blocks, start + first)  # fmt: skip
        return _Dispute(index, track, start + first, start, end, out)

    async def _settle(self, dispute: _Dispute, history: SpanHistory) -> tuple[Verdict, int, PeerId | None]:
        """(verdict, the liar's first wrong position, the auditor's peer): a third replica recomputes
        ``[0, end)`` statelessly; compared with both at ``[position, end)``."""
        track, p, end = dispute.track, dispute.position, dispute.end
        span, auditor = track.hop.span, track.auditor
        auditor_peer = auditor.span.peer_id if auditor is not None else None
        tried = {span.peer_id, *([auditor_peer] if auditor_peer else []), *self.verification.banned}
        tensors = history.window(span.start, 0, end)
        mask = _window_mask(tensors, 0)
        mask = mask[:, p:] if mask is not None else None
        for _ in range(SETTLE_TRIES):
            third = self.planner.route_replica(span, exclude=tried, needs=self.recovery.needs)
            if third is None:
                break
            tried.add(third.peer_id)
            try:
                recomputed = (await self._recompute(third, tensors))[:, p:end]
            except (ShoalError, TimeoutError) as exc:
                self.feedback.failed(third.peer_id)
                log.info("third replica %s failed: %s", third.peer_id[:10], exc)
                continue
            recorded = history.hidden(span.end, p, end)
            tolerance = self._tolerance(span, recorded)
            vs_audited = first_disagreement(recomputed, recorded, tolerance, mask)
            vs_auditor = first_disagreement(recomputed, dispute.auditor_out[:, p - dispute.start :], tolerance, mask)
            verdict = majority(vs_audited, vs_auditor)
            log.warning("third replica %s on blocks %s at position %d: %s lied", third.peer_id[:10], span.blocks, p,
                        verdict.value)  # fmt: skip
            return verdict, p + (vs_audited or 0), auditor_peer
        return Verdict.UNSETTLED, p, auditor_peer

    async def _recompute(self, span: ServerSpan, tensors: list[Tensor]) -> Tensor:
        """A stateless forward of ``tensors`` on ``span``'s server (raw: exactly the recorded inputs)."""
        tensors = list(tensors)
        prompts = self.recovery.prompts
        if prompts is not None:
            tensors.append(prompts[span.start : span.end].contiguous())
        meta = ForwardRequest(prompts=prompts is not None, adapter=self.adapter)
        timeout = self.request_deadline * max(1.0, tensors[0].shape[1] / 256)
        reply = await self.node.request(span.ticket, BLOCKS, Message("forward", 1, meta, tensors), timeout=timeout)
        return reply.tensors[0]


def _window_mask(tensors: Sequence[Tensor], start: int) -> Tensor | None:
    """The real-token mask ``[B, n]`` of a window's positions (its step mask covers ``[0, end)``)."""
    return tensors[2][:, start:] if len(tensors) > 2 else None
