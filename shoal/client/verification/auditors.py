"""The I/O of audit mode: a session's checkers (auditor sessions, or stateless covers of pieces), their
audit rounds, and the third opinion that settles a dispute.

What is decided (who lied, when an audit is due, what a new hop's track inherits) is in
:mod:`shoal.client.verification.audit`, with the design; this module opens the sessions, sends the steps and
forwards, and compares the answers. In redundant mode (``verification.redundant``) the auditors
are the second chain: no server of the session's chain is ever taken as an auditor, and one that
joins the chain (a repair put it there) is replaced. A dispute nobody settles takes both of its
servers off this client's routes (:meth:`Audits._route_around`). Everything runs on the client's event
loop, called by the session (:mod:`shoal.client.remote.session`), which does the repair a
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
    Disputed,
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
from shoal.errors import BusyError, ShoalError
from shoal.ids import BlockRange, PeerId
from shoal.protocols import BLOCKS
from shoal.routing import ServerSpan
from shoal.routing.audits import Piece
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
        shunned = {*self._distrusted(), *self._chain_peers(hops)}
        for hop in hops:
            track = kept.get(id(hop))
            if track is not None and track.checkers() & shunned:
                if track.auditor is not None:
                    spare.append(track.auditor)  # disputed, or (redundant) it joined the main chain
                track.auditor, track.pieces = None, ()
                staff.append(track)
            if track is None:
                track = successor(hop, left, position, hop.span.end in adopted)
                track.trusted = self.node.is_local(hop.span.peer_id)  # the client's own span
                track.auditor = None if track.trusted else take_spare(spare, hop, shunned)
                if track.auditor is None and not track.trusted:
                    staff.append(track)
            tracks.append(track)
        self.tracks = tracks
        await close_all(spare)
        await asyncio.gather(*(self._staff(track, history) for track in staff))
        self._report()

    async def staff_unchecked(self, history: SpanHistory) -> None:
        """Look for checkers again for the hops that have none (a server able to check them may have
        joined since the chain was installed)."""
        lacking = [t for t in self.tracks if t.unverified]
        for track in lacking:
            track.unverified = False
        await asyncio.gather(*(self._staff(track, history) for track in lacking))
        self._report()

    async def _staff(self, track: Track, history: SpanHistory, exclude: Collection[str] = ()) -> None:
        """Find a checker for ``track``: an auditor session on an exact replica, its cache brought
        to ``track.audited`` (a replay of the recorded inputs); failing that (no replica, or none
        opens a session: a full cache, a throwaway client holding it), a stateless checker, the
        pieces of a cover (:meth:`~shoal.client.remote.directory.ServerDirectory.route_cover`; a
        lone replica is a cover of one piece). None to be had: the track is unverified."""
        span = track.hop.span
        tried = {span.peer_id, *exclude, *self._distrusted(), *self._chain_peers(t.hop for t in self.tracks)}
        shunned = set(tried)  # never a checker, session or stateless
        track.pieces = ()
        for _ in range(STAFF_TRIES):
            replica = self.planner.route_replica(span, exclude=tried, cache_tokens=self.recovery.cache_tokens,
                                                 needs=self.recovery.needs)  # fmt: skip
            if replica is None:
                break
            tried.add(replica.peer_id)
            try:
                auditor = await self.recovery.open_hop(replica, RECOVERY_TIMEOUT)
            except BusyError as exc:  # alive and honest as far as we know: it may still run forwards
                log.info("no auditor session on %s (%s): auditing statelessly", replica.peer_id[:10], exc)
                continue
            except ShoalError as exc:
                self.feedback.failed(replica.peer_id)
                shunned.add(replica.peer_id)
                log.info("could not open an auditor on %s: %s", replica.peer_id[:10], exc)
                continue
            if track.audited:
                try:
                    await self.replay(auditor, history.window(span.start, 0, track.audited), track.audited, 0)
                except (ShoalError, TimeoutError) as exc:
                    self.feedback.failed(replica.peer_id)
                    shunned.add(replica.peer_id)
                    await auditor.abort()
                    log.info("auditor %s failed its replay: %s", replica.peer_id[:10], exc)
                    continue
            track.auditor = auditor
            return
        pieces = self._cover(span, shunned)
        if pieces is not None:
            track.pieces = tuple(pieces)
            log.info("blocks %s are audited statelessly through %s", span.blocks,
                     ", ".join(f"{p.server.peer_id[:10]}[{p.blocks}]" for p in pieces))  # fmt: skip
            return
        track.unverified = True

    def _cover(self, span: ServerSpan, exclude: Collection[str]) -> list[Piece] | None:
        """A stateless checker of ``span``: pieces of other servers (whole spans only where the
        session has deep prompts: a piece's share of them is the whole span's)."""
        pieces = self.planner.route_cover(span, exclude=exclude, needs=self.recovery.needs)
        if pieces is None or (self.recovery.prompts is not None and not all(p.whole for p in pieces)):
            return None
        return pieces

    def _distrusted(self) -> set[PeerId]:
        """Servers no auditor or third replica may be: the convicted, and both sides of unsettled disputes."""
        return {*self.verification.banned, *self.verification.excluded}

    def _chain_peers(self, hops: Iterable[Hop]) -> set[PeerId]:
        """The servers no auditor may be: in redundant mode, every server of the main chain."""
        return {hop.span.peer_id for hop in hops} if self.verification.redundant else set()

    def rolled_back(self, position: int) -> None:
        """Positions from ``position`` on are gone: the hops will compute them again, themselves."""
        for track in self.tracks:
            track.audited = min(track.audited, position)
            track.since = min(track.since, position)

    def _report(self) -> None:
        blocks = tuple(b for t in self.tracks if not t.verified for b in t.hop.span.blocks.blocks())
        self.verification.unverified, self.verification.unverified_blocks = blocks, len(blocks)
        if blocks and not self._warned:
            self._warned = True
            spans = ", ".join(str(t.hop.span.blocks) for t in self.tracks if not t.checked)
            log.warning("blocks %s are unverified in this session: no other server can check them", spans)

    def verified(self) -> dict[tuple[int, int], bool]:
        """Whether each hop's span ``(start, end)`` is checked by an auditor (or is the client's own)."""
        return {(t.hop.span.start, t.hop.span.end): t.verified for t in self.tracks}

    def checked_up_to(self, position: int) -> int:
        """Positions ``[0, result)`` every hop has been audited for (a streamer holding tokens back
        releases those). A hop nobody can check (``unverified``: no replica) holds nothing back; one
        whose auditor is gone for now (a dispute, a replacement being opened) holds back what its
        auditor has not confirmed."""
        return min((t.audited for t in self.tracks if not t.unverified), default=position)

    def due(self, position: int) -> bool:
        return any(t.checked and audit_due(t.audited, position, self.every) for t in self.tracks)

    def pending(self, position: int) -> bool:
        return any(t.checked and t.audited < position for t in self.tracks)

    async def close(self) -> None:
        await close_all([t.auditor for t in self.tracks if t.auditor is not None])  # not the witness: the client's

    def _tolerance(self, track: Track, recorded: Tensor, third: Sequence[Piece] = (), start: int = 0) -> Tolerance:
        """The coarsest of the tolerances between the hop's compute dtype and each checker's (an
        fp32 server checked by a bf16 one is compared within the bf16 tolerance); positions from
        ``start`` on are compared, so where they begin before ``track.since`` the old hops' dtypes
        count too (they computed the history there)."""
        dtypes = [q.server.info.dtype for q in (*track.pieces, *third)]
        if track.auditor is not None:
            dtypes.append(track.auditor.span.info.dtype)
        if start < track.since:
            dtypes.extend(track.before_dtypes)
        hop = track.hop.span.info.dtype
        found = [tolerance_of(recorded.dtype, hop, self.compression, other=d) for d in dtypes if d] or [
            tolerance_of(recorded.dtype, hop, self.compression)
        ]
        return max(found, key=lambda t: t.relative)

    # ---- audit rounds --------------------------------------------------------------------------

    async def round(self, history: SpanHistory, position: int) -> Conviction | None:
        """Audit every checked hop up to ``position`` (in parallel: the auditors are different
        servers), then settle the disputes, earliest position first. Returns the first lie of an
        audited server, or the first dispute no third opinion settles (the session repairs it; later
        disputes are moot: they are at or after it)."""
        distrusted = self._distrusted()
        for track in self.tracks:  # a checker convicted or disputed meanwhile (elsewhere) is replaced
            if track.checkers() & distrusted:
                auditor, track.auditor = track.auditor, None
                if auditor is not None:
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
                            self.witness.report(track.hop.span, liar, wrong, history, dispute.end)
                    replace = wrong >= track.since
                    return Conviction(dispute.index, liar, track.hop.span.blocks, wrong, replace)
                if verdict is Verdict.AUDITOR:
                    self.verification.settled += 1
                    dropped = track.checkers()
                    if peer is not None:  # one checker: the liar (several pieces: which one is not known)
                        self.convict(peer, track.hop.span.blocks, dispute.position)
                    auditor, track.auditor = track.auditor, None
                    if auditor is not None:
                        await auditor.abort()
                    # its hop's positions since `audited` are audited again, by others
                    await self._staff(track, history, exclude=dropped)
                else:
                    return await self._route_around(dispute, history)
            return None
        finally:
            self._report()

    async def _route_around(self, dispute: _Dispute, history: SpanHistory) -> Conviction:
        """An unsettled dispute: both servers leave this client's routes (neither is convicted: nobody
        knows which lied) and the session rolls back to where they first disagree. The hop is
        replaced if the disputed outputs are its own; else the track gets another auditor."""
        self.verification.unsettled += 1
        track, position = dispute.track, dispute.position
        checkers = sorted(track.checkers())  # an auditor, or the servers of a cover's pieces
        auditor, track.auditor, track.pieces = track.auditor, None, ()
        track.audited = position  # before it they agreed, and one of them is honest
        peers = [track.producer(position), *checkers]
        disputed = Disputed(tuple(dict.fromkeys(p for p in peers if p is not None)), track.hop.span.blocks, position)
        self.verification.disputed(disputed)
        for peer in disputed.peers:
            self.feedback.disputed(peer, disputed.reason)
        log.warning("servers %s: routing around both, rolling back to position %d", disputed.reason, position)
        if auditor is not None:
            await auditor.abort()
        replace = position >= track.since
        if not replace:  # the outputs were an earlier server's: this hop stays, with another auditor
            await self._staff(track, history)
        return Conviction(dispute.index, None, track.hop.span.blocks, position, replace, disputed)

    def convict(self, peer: PeerId, blocks: BlockRange | None = None, position: int | None = None) -> None:
        """Ban ``peer`` for good and count it (once), with the blocks and position it was caught at."""
        if peer not in self.verification.banned:
            self.verification.convicted(peer, blocks, position)
        self.feedback.convicted(peer)

    async def _audit(self, index: int, track: Track, history: SpanHistory, end: int) -> _Dispute | None:
        """One check over ``[track.audited, end)``: an auditor step over those positions, or (pieces)
        a stateless forward of the recorded inputs over ``[0, end)`` (no cache: every position again;
        the pieces' outputs at ``[audited, end)`` are compared). A dispute if the outputs differ."""
        span, auditor = track.hop.span, track.auditor
        start = track.audited
        tensors = history.window(span.start, start if auditor is not None else 0, end)
        try:
            if auditor is not None:
                out = await self.replay(auditor, tensors, end - start, start)
            else:
                out = (await self._recompute(track.pieces, tensors))[:, start:end]
        except (ShoalError, TimeoutError) as exc:  # a dead checker is no evidence: find another
            gone = {auditor.span.peer_id} if auditor is not None else track.checkers()
            log.info("checker %s failed (%s); replacing it", ", ".join(p[:10] for p in gone), exc)
            for peer in gone:
                self.feedback.failed(peer)
            track.auditor = None
            if auditor is not None:
                await auditor.abort()
            await self._staff(track, history, exclude=gone)
            return None
        self.verification.audits += 1
        self.verification.audited_positions += end - start
        mask = _window_mask(tensors, start)
        recorded = history.hidden(span.end, start, end)
        first = first_disagreement(recorded, out, self._tolerance(track, recorded, start=start), mask)
        if first is None:
            track.audited = end
            self.verification.vouch(span.peer_id, span.blocks)  # both sides seen computing correctly
            self._vouch_checkers(track, auditor)
            return None
        self.verification.disagreements += 1
        log.warning("checker %s disagrees with %s on blocks %s at position %d",
                    ", ".join(p[:10] for p in track.checkers()), span.peer_id[:10], span.blocks,
                    start + first)  # fmt: skip
        return _Dispute(index, track, start + first, start, end, out)

    async def _settle(self, dispute: _Dispute, history: SpanHistory) -> tuple[Verdict, int, PeerId | None]:
        """(verdict, the liar's first wrong position, the checker's peer: None if several pieces):
        a third opinion, from servers that are neither the hop's nor the checker's (a replica or a
        cover), recomputes ``[0, end)`` statelessly; compared with both at ``[position, end)``.
        Pieces are never convicted together: a verdict against several of them (who of them lied is
        not known) only drops them as checkers (:meth:`round`)."""
        track, p, end = dispute.track, dispute.position, dispute.end
        span = track.hop.span
        checkers = track.checkers()
        checker = next(iter(checkers)) if len(checkers) == 1 else None
        tried = {span.peer_id, *checkers, *self._distrusted()}
        tensors = history.window(span.start, 0, end)
        mask = _window_mask(tensors, 0)
        mask = mask[:, p:] if mask is not None else None
        for _ in range(SETTLE_TRIES):
            third = self.planner.route_replica(span, exclude=tried, needs=self.recovery.needs)
            pieces = [Piece(third, third.blocks)] if third is not None else self._cover(span, tried)
            if not pieces:
                break
            tried.update(q.server.peer_id for q in pieces)
            try:
                recomputed = (await self._recompute(pieces, tensors))[:, p:end]
            except (ShoalError, TimeoutError) as exc:
                for q in pieces:
                    self.feedback.failed(q.server.peer_id)
                log.info("third opinion %s failed: %s", ", ".join(q.server.peer_id[:10] for q in pieces), exc)
                continue
            recorded = history.hidden(span.end, p, end)
            tolerance = self._tolerance(track, recorded, pieces, start=p)
            vs_audited = first_disagreement(recomputed, recorded, tolerance, mask)
            vs_auditor = first_disagreement(recomputed, dispute.auditor_out[:, p - dispute.start :], tolerance, mask)
            verdict = majority(vs_audited, vs_auditor)
            if verdict in (Verdict.AUDITED, Verdict.AUDITOR):  # the third opinion sided with the honest one
                for q in pieces:
                    self.verification.vouch(q.server.peer_id, q.blocks)
                if verdict is Verdict.AUDITOR:
                    self.verification.vouch(span.peer_id, span.blocks)
                else:
                    self._vouch_checkers(track, track.auditor)
            log.warning("third opinion %s on blocks %s at position %d: %s lied",
                        ", ".join(q.server.peer_id[:10] for q in pieces), span.blocks, p, verdict.value)  # fmt: skip
            return verdict, p + (vs_audited or 0), checker
        return Verdict.UNSETTLED, p, checker

    def _vouch_checkers(self, track: Track, auditor: Hop | None) -> None:
        """The checkers of ``track`` computed correctly: its ``auditor`` the hop's blocks, or each
        piece of its cover its own blocks (who may judge for this client, :mod:`shoal.swarm.verdicts`)."""
        if auditor is not None:
            self.verification.vouch(auditor.span.peer_id, track.hop.span.blocks)
            return
        for piece in track.pieces:
            self.verification.vouch(piece.server.peer_id, piece.blocks)

    async def _recompute(self, pieces: Sequence[Piece], tensors: list[Tensor]) -> Tensor:
        """A stateless forward of ``tensors`` (raw: exactly the recorded inputs) through ``pieces``,
        one after the other (a piece that is part of its server's span asks for just those blocks)."""
        prompts = self.recovery.prompts
        hidden, rest = tensors[0], list(tensors[1:])
        timeout = self.request_deadline * max(1.0, hidden.shape[1] / 256)
        for piece in pieces:
            blocks = None if piece.whole else piece.blocks
            sent = [hidden, *rest]
            if prompts is not None:
                sent.append(prompts[piece.blocks.start : piece.blocks.end].contiguous())
            meta = ForwardRequest(prompts=prompts is not None, adapter=self.adapter, blocks=blocks)
            reply = await self.node.request(piece.server.ticket, BLOCKS, Message("forward", 1, meta, sent),
                                            timeout=timeout)  # fmt: skip
            hidden = reply.tensors[0]
        return hidden


def _window_mask(tensors: Sequence[Tensor], start: int) -> Tensor | None:
    """The real-token mask ``[B, n]`` of a window's positions (its step mask covers ``[0, end)``)."""
    return tensors[2][:, start:] if len(tensors) > 2 else None
