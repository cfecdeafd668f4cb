"""Audit mode (``verify="audit"``, the default): other servers check each hop of a session; a third opinion, a dispute.

For each hop ``[a, b)`` of a session's chain the client keeps a *checker*. The first choice is an
*auditor*: an ordinary inference session on another server whose span is exactly ``[a, b)`` and which
computes what the hop's server does (same weight format and adapters; its compute dtype may differ,
see below: :func:`shoal.routing.audits.replicas`). Every ``K`` new positions (``audit_every``), and once
more before ``generate`` returns, each auditor gets ONE step with the positions it has not seen,
``[audited, position)``: the audited hop's recorded inputs there (the session's history at block
``a``). Its outputs are compared with what the audited server returned for the same positions (the
history at block ``b``) within the calibrated tolerance (:mod:`shoal.verify.compare`). The audited
server cannot tell an audit from other traffic: it is a session elsewhere. The cost is one step per
``K`` positions per hop, on other servers. This module holds the decisions;
:mod:`shoal.client.verification.auditors` the sessions, steps and forwards.

When no auditor session can be had (no exact replica; or none opens one: busy, e.g. a throwaway
client holds the replicas' caches) the checker is *stateless*: a *cover* of ``[a, b)`` by pieces of
other servers' spans (:func:`shoal.routing.audits.plan_cover`: a lone replica, or e.g. blocks
``[0, 2)`` of a ``[0, 3)`` server for a liar alone on ``[0, 2)``, or ``[2, 3)`` of one server then
``[3, 6)`` of another), each run as a stateless ``forward`` of just those blocks
(``ForwardRequest.blocks``, capability ``sub-span``). Having no cache, it re-runs positions
``[0, position)`` of the recorded inputs at each audit (the only correct stateless pass: attention
needs every earlier position) and its outputs at ``[audited, position)`` are compared: quadratic in
the session's length, which is why a session auditor is preferred. Servers listed but never reached
by the client (banned after its measurement) are never checkers, so fake records use up no tries.
Checkers may compute in another dtype than the hop (fp32 beside bf16): the comparison then uses
the coarser tolerance (:func:`~shoal.verify.compare.tolerance_of`), and where the history was made by
a hop since replaced, that hop's dtype counts too. An auditing client's routes avoid hops nobody
can check (:data:`~shoal.routing.audits.UNAUDITED_PENALTY_MS`), and with ``require_verified`` a
session with a block nobody checks fails (:class:`UnverifiedBlocks`) instead of generating, once
its open has waited ``route_wait`` seconds for a server able to check it to join.

A disagreement at position ``p`` is settled by a third opinion: a stateless ``forward`` of positions
``[0, end)`` of the recorded inputs (no cache needed) on servers that are neither the hop's nor the
checker's (an exact replica, else a cover), compared at ``[p, end)`` with both. The two that agree
are the majority (:func:`majority`); the odd one out lied. If that is the hop, its server is banned
for good (:meth:`~shoal.client.remote.feedback.RouteFeedback.convicted`): two independent
computations by other servers agreed with each other against it. If it is the checker, a single
server (an auditor, a one-piece cover) is banned likewise; a cover of several pieces is only dropped
(which piece lied is not known, and an honest server must never be convicted) and the hop is
checked again by others. A lying auditor is replaced (nothing was computed from its outputs). A lying
hop is repaired by the session: it rolls back to the first wrong position, replaces the hop and
raises :class:`LieDetected` for ``generate`` to regenerate from there
(:mod:`shoal.client.verification.repair`).

Without a third opinion (or when it agrees with neither) the dispute is *unsettled*, and a lie that
was detected is never kept: nobody knows which side lied, so nobody is convicted nor reported to
judges, but this client routes around the hop's server and its checker(s) for good (:class:`Disputed`,
kept with its reason by :meth:`~shoal.client.remote.feedback.RouteFeedback.disputed`: an exclusion
from its own routes, not a ban anyone testifies to). The session rolls back to ``p`` exactly as for
a conviction, replaces the hop and ``generate`` regenerates from there; when no route is left without
them, it fails with :class:`UnsettledDispute` rather than generate on over either. A span no other
server can check at all is reported unverified. Generation never waits for a checker to appear
(only the open of a session under ``require_verified`` does).

Redundant mode (``verify="redundant"``) is this machinery with an audit after EVERY step
(``audit_every`` is 1: it must be left unset or be 1) and auditors that form a second chain
disjoint from the main one: no server of the session's chain audits any hop (a replica is never
its own check, nor the check of a hop whose neighbour it serves). So every step also runs on the
second chain, the hops' outputs are compared on the same inputs (all hops in parallel), the first
disagreement is settled by a third replica, and a lie is caught at the step that told it, before
the next token is chosen from it. A ``hold_back`` streamer lags by one step at most.

The span a client serves itself (``local_blocks``) is its own computation: its hop has no auditor
and counts as verified for that client, while other clients audit it as they audit any server.

``verify="off"`` checks nothing (the client logs so once). Limits: stateless forwards (``use_cache=False``,
training forwards and backwards) are not audited; a span is checked only
if some other servers compute it alike (same quantisation and adapters) and, for pieces of longer
spans, announce ``sub-span``: a span nobody else serves alike goes unaudited (and is priced as such by
routing); a cover of several pieces that lies is dropped, not convicted; a stateless check re-runs
the whole prefix at each audit (a session longer than a piece's ``--max-forward-positions`` loses
that check); with deep prompts only whole spans are pieces; the receipts of a
pushed hop (:mod:`shoal.client.remote.driver`) are what makes its recorded inputs the ones it
computed on, so without them the session does not push (:meth:`RemoteSession._install`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from shoal.client.remote.hops import Hop
from shoal.errors import ShoalError, UsageError
from shoal.ids import BlockRange, PeerId
from shoal.routing import NoRouteError, format_blocks
from shoal.routing.audits import Piece
from shoal.verify.compare import tolerance_of

VERIFY_MODES = ("off", "audit", "redundant")
DEFAULT_VERIFY = "audit"  # what a client runs unless told otherwise (from_pretrained, ClientConfig, shoal chat/api)
DEFAULT_AUDIT_EVERY = 16  # positions between audits of a hop: the smallest K bench.verify measured at >= 0.9x of off

__all__ = [
    "DEFAULT_AUDIT_EVERY",
    "DEFAULT_VERIFY",
    "VERIFY_MODES",
    "Caught",
    "Conviction",
    "Disputed",
    "LieDetected",
    "Track",
    "UnsettledDispute",
    "UnverifiedBlocks",
    "Verdict",
    "Verification",
    "audit_due",
    "check_verify",
    "majority",
    "successor",
    "take_spare",
    "tolerance_of",
    "verification_for",
]


def check_verify(verify: str, audit_every: int | None = None) -> str:
    """``verify`` if it is a mode this client runs with ``audit_every`` (None: the mode's default);
    raises :class:`UsageError` otherwise. Redundant mode checks every step: an ``audit_every``
    other than 1 contradicts it."""
    if verify not in VERIFY_MODES:
        raise UsageError(f"verify must be one of 'off', 'audit', 'redundant', not {verify!r}")
    if audit_every is not None and audit_every < 1:
        raise UsageError(f"audit_every must be at least 1 position, got {audit_every}")
    if verify == "redundant" and audit_every not in (None, 1):
        raise UsageError(f"verify='redundant' checks every step: audit_every={audit_every} contradicts it (omit it)")
    return verify


def verification_for(verify: str, audit_every: int | None = None) -> Verification:
    """The counters of a client in mode ``verify`` (checked by :func:`check_verify`); audits every
    ``audit_every`` positions (audit mode, default :data:`DEFAULT_AUDIT_EVERY`) or every step (redundant)."""
    mode = check_verify(verify, audit_every)
    every = 1 if mode == "redundant" else audit_every if audit_every is not None else DEFAULT_AUDIT_EVERY
    return Verification(mode, every)


#: block ranges remembered per vouched-for server (the latest)
MAX_VOUCHED_RANGES = 8


@dataclass
class Verification:
    """What audits did, over every session of one client (``model.verification``). Counts: ``audits``
    (auditor steps), ``audited_positions`` (positions they covered), ``disagreements`` (audits whose
    outputs differed beyond tolerance), ``settled`` / ``unsettled`` (disputes a third replica decided,
    or could not), ``bans`` (servers convicted: ``banned`` names them), ``rollbacks`` (repairs of a
    session). ``unverified_blocks``: how many blocks of the latest session's chain nothing checks
    (``unverified`` lists them). Evidence of a conviction (:mod:`shoal.client.verification.witness`): pieces
    ``evidence_sent`` to judges, and the judges' findings, ``evidence_confirmed`` / ``evidence_rejected``.
    ``caught``: each conviction, with the blocks and the first position its comparison (or its
    receipt) proved wrong. ``disputes``: the unsettled ones, whose servers this client routes around
    (``excluded`` names them)."""

    mode: str = DEFAULT_VERIFY
    audit_every: int = DEFAULT_AUDIT_EVERY
    audits: int = 0
    audited_positions: int = 0
    disagreements: int = 0
    settled: int = 0
    unsettled: int = 0
    bans: int = 0
    rollbacks: int = 0
    unverified_blocks: int = 0
    evidence_sent: int = 0
    evidence_confirmed: int = 0
    evidence_rejected: int = 0
    banned: tuple[PeerId, ...] = ()
    unverified: tuple[int, ...] = ()
    caught: tuple[Caught, ...] = ()
    disputes: tuple[Disputed, ...] = ()
    #: the blocks this client's own audits saw each server compute correctly (a hop audited clean, a
    #: checker that agreed, a third opinion in a settled majority): only such servers' verdicts count
    #: for this client (:func:`shoal.swarm.verdicts.tally`)
    vouched: dict[PeerId, list[BlockRange]] = field(default_factory=dict, repr=False)

    @property
    def auditing(self) -> bool:
        """Whether sessions have auditors (audit and redundant mode)."""
        return self.mode in ("audit", "redundant")

    @property
    def redundant(self) -> bool:
        """Whether every step is checked, on a second chain disjoint from the main one."""
        return self.mode == "redundant"

    @property
    def excluded(self) -> tuple[PeerId, ...]:
        """The servers of unsettled disputes: out of this client's routes, convicted of nothing."""
        return tuple(dict.fromkeys(peer for dispute in self.disputes for peer in dispute.peers))

    def disputed(self, dispute: Disputed) -> None:
        self.disputes = (*self.disputes, dispute)

    def vouch(self, peer: PeerId, blocks: BlockRange) -> None:
        """``peer`` was seen computing ``blocks`` correctly (bounded: a few ranges per peer)."""
        if peer in self.banned:
            return
        seen = self.vouched.setdefault(peer, [])
        if blocks not in seen:
            seen.append(blocks)
            del seen[:-MAX_VOUCHED_RANGES]

    def convicted(self, peer: PeerId, blocks: BlockRange | None = None, position: int | None = None) -> None:
        self.bans += 1
        self.banned = (*self.banned, peer)
        self.vouched.pop(peer, None)
        if blocks is not None and position is not None:
            self.caught = (*self.caught, Caught(peer, blocks, position))


@dataclass(frozen=True)
class Caught:
    """A conviction: ``peer``'s outputs of ``blocks`` were wrong from cache position ``position`` on."""

    peer: PeerId
    blocks: BlockRange
    position: int


@dataclass(frozen=True)
class Disputed:
    """A dispute no third replica settled: ``peers`` (the audited server, when the disputed outputs
    are one server's, and its auditor) disagree on ``blocks`` from cache position ``position``.
    One of them lied and nobody can tell which: the client routes around both."""

    peers: tuple[PeerId, ...]
    blocks: BlockRange
    position: int

    @property
    def reason(self) -> str:
        """Why the servers are out of this client's routes, in one line."""
        who = " and ".join(peer[:10] for peer in self.peers)
        return (f"{who} disagree on blocks {format_blocks(list(self.blocks.blocks()))} from position "
                f"{self.position} and no third replica settled it")  # fmt: skip


class UnsettledDispute(NoRouteError):
    """A dispute no third replica settled (:class:`Disputed`) left no route for its blocks without
    both of its servers: generating on over either could keep the lie, so the generation stops."""

    def __init__(self, dispute: Disputed, missing: list[int]):
        super().__init__(f"servers {dispute.reason}; no route is left without both for blocks "
                         f"{format_blocks(missing)}: not generating on over either", missing)  # fmt: skip
        self.dispute = dispute


class LieDetected(ShoalError):
    """A server of the session's chain returned wrong hidden states from ``position`` on (a majority
    of replicas said so). The session is rolled back to ``position`` and the liar replaced; the token
    at ``position`` (computed from honest logits before it) and everything before stand. ``generate``
    handles it (it regenerates from there); a caller stepping a session by hand re-sends from there."""

    def __init__(self, position: int, peer: PeerId | None, blocks: BlockRange, disputed: tuple[PeerId, ...] = ()):
        who = f"server {peer[:10]}" if peer is not None else "a server since replaced"
        if disputed:  # an unsettled dispute: one of them lied, both are routed around
            who = f"one of {' and '.join(p[:10] for p in disputed)} (no third replica to tell which)"
        super().__init__(f"{who} lied on blocks {blocks} from position {position}: rolled back there")
        self.position = position
        self.peer = peer
        self.blocks = blocks
        self.disputed = disputed


class UnverifiedBlocks(ShoalError):
    """``require_verified=True`` and no other server can check ``blocks`` (no replica, no cover of
    pieces, or a dispute over them that nobody could settle): nothing is generated with them."""

    def __init__(self, blocks: Sequence[int]):
        super().__init__(f"require_verified: no other server can check blocks {list(blocks)}, so nothing is "
                         "generated with them (add servers of those blocks, or drop require_verified)")  # fmt: skip
        self.blocks = tuple(blocks)


class Verdict(enum.Enum):
    AUDITED = "audited"  # the audited server is the odd one out: it lied
    AUDITOR = "auditor"  # the auditor did
    UNSETTLED = "unsettled"  # no majority (or no third replica)


def audit_due(audited: int, position: int, every: int) -> bool:
    """Whether a hop checked up to ``audited`` needs an audit now that the session holds ``position``."""
    return position - audited >= every


def majority(audited_vs_third: int | None, auditor_vs_third: int | None) -> Verdict:
    """Who lied, from where a third replica first disagrees with the audited server and with the
    auditor (None: agrees throughout): the one it disagrees with, if it agrees with the other."""
    if audited_vs_third is not None and auditor_vs_third is None:
        return Verdict.AUDITED
    if auditor_vs_third is not None and audited_vs_third is None:
        return Verdict.AUDITOR
    return Verdict.UNSETTLED


@dataclass
class Track:
    """The audit of one hop: its auditor (a session on an exact replica) or, when no auditor session
    opens, ``pieces`` (a cover of the span by other servers, run statelessly; see
    :mod:`shoal.routing.audits`), and the positions ``[0, audited)`` checked so far. ``unverified``:
    no checker could be had; the span is reported unverified and no
    longer audited. ``trusted``: the hop's server is the span this client serves itself
    (``local_blocks``): its own computation, verified without a checker (other clients audit it as
    any server).

    The history at the hop's end block holds its own outputs from ``since`` on; before that, those
    of the hop it replaced (``before``: that server, when it had exactly this span; None when the
    chain had other boundaries there, and a lie cannot be pinned on one server)."""

    hop: Hop
    audited: int
    since: int = 0
    before: PeerId | None = None
    before_dtypes: tuple[str, ...] = ()  # how the old hops computed the history before ``since`` (its tolerance)
    auditor: Hop | None = None
    unverified: bool = False
    pieces: tuple[Piece, ...] = ()
    trusted: bool = False  # its server is this client's own span (local_blocks): nothing to audit

    @property
    def verified(self) -> bool:
        """Checked, or the client's own computation."""
        return self.trusted or self.checked

    @property
    def checked(self) -> bool:
        return (self.auditor is not None or bool(self.pieces)) and not self.unverified

    def checkers(self) -> set[PeerId]:
        """The servers that check this hop now."""
        peers = {p.server.peer_id for p in self.pieces}
        return peers | {self.auditor.span.peer_id} if self.auditor is not None else peers

    def producer(self, position: int) -> PeerId | None:
        """The server whose output the history holds at ``position`` of the hop's end block."""
        return self.hop.span.peer_id if position >= self.since else self.before


@dataclass(frozen=True)
class Conviction:
    """An audit proved the outputs of hop ``index``'s span wrong from ``position`` on: the session
    rolls back there and, if they are the hop's own (``replace``), replaces the hop. ``peer``: who
    computed them (None: not one server, see :attr:`Track.before`); convicted already. ``dispute``:
    instead, an unsettled dispute put the outputs in doubt; its servers are routed around already,
    and a hop it leaves without a route fails the session (:class:`UnsettledDispute`)."""

    index: int
    peer: PeerId | None
    blocks: BlockRange
    position: int
    replace: bool
    dispute: Disputed | None = None


def successor(hop: Hop, left: Sequence[Track], position: int, adopted: bool) -> Track:
    """The track of a new hop. Its replay's output became its end block's history (``adopted``):
    everything is its own and is audited from 0. Else the history there is the old chain's up to
    ``position``: what the tracks that left had not audited of it is audited still (the tokens
    stand on it), and pinned on the old server if it had exactly this span."""
    if adopted:
        return Track(hop, audited=0)
    span = hop.span
    overlapping = [t for t in left if t.hop.span.start < span.end and span.start < t.hop.span.end]
    audited = min((t.audited for t in overlapping), default=position)
    before = next((t.hop.span.peer_id for t in overlapping if t.hop.span.blocks == span.blocks), None)
    dtypes = tuple(d for t in overlapping for d in (t.hop.span.info.dtype, *t.before_dtypes) if d)
    return Track(hop, audited=min(audited, position), since=position, before=before, before_dtypes=dtypes)


def take_spare(spare: list[Hop], hop: Hop, banned: Collection[str]) -> Hop | None:
    """An auditor of a hop that left whose span is ``hop``'s and that is neither ``hop``'s server nor banned."""
    for auditor in spare:
        peer = auditor.span.peer_id
        if auditor.span.blocks == hop.span.blocks and peer != hop.span.peer_id and peer not in banned:
            spare.remove(auditor)
            return auditor
    return None
