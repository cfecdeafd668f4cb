"""Audit mode (``verify="audit"``, the default): a second server checks each hop of a session, a third a dispute.

For each hop ``[a, b)`` of a session's chain the client keeps an *auditor*: an ordinary inference
session on another server whose span is exactly ``[a, b)`` and which computes what the hop's server
does (same weight format and adapters, :func:`shoal.client.remote.directory.replicas`). Every ``K`` new
positions (``audit_every``), and once more before ``generate`` returns, each auditor gets ONE step
with the positions it has not seen, ``[audited, position)``: the audited hop's recorded inputs there
(the session's history at block ``a``). Its outputs are compared with what the audited server
returned for the same positions (the history at block ``b``) within the calibrated tolerance
(:mod:`shoal.verify.compare`). The audited server cannot tell an audit from other traffic: it is a
session elsewhere. The cost is one step per ``K`` positions per hop, on other servers. This module
holds the decisions; :mod:`shoal.client.verification.auditors` the sessions, steps and forwards.

A disagreement at position ``p`` is settled by a third replica: a stateless ``forward`` of positions
``[0, end)`` of the recorded inputs (no cache needed), compared at ``[p, end)`` with both. The two
that agree are the majority; the third is the liar, banned for good
(:meth:`~shoal.client.remote.feedback.RouteFeedback.convicted`). A lying auditor is replaced (nothing was
computed from its outputs). A lying hop is repaired by the session: it rolls back to the first wrong
position, replaces the hop and raises :class:`LieDetected` for ``generate`` to regenerate from there
(:mod:`shoal.client.verification.repair`). Without a third replica the dispute is *unsettled*: nobody is banned,
and the span is reported unverified from then on (its auditor closed), as is a span for which no
second replica exists at all. Generation never waits for a replica to appear.

Redundant mode (``verify="redundant"``) is this machinery with an audit after EVERY step
(``audit_every`` is 1: it must be left unset or be 1) and auditors that form a second chain
disjoint from the main one: no server of the session's chain audits any hop (a replica is never
its own check, nor the check of a hop whose neighbour it serves). So every step also runs on the
second chain, the hops' outputs are compared on the same inputs (all hops in parallel), the first
disagreement is settled by a third replica, and a lie is caught at the step that told it, before
the next token is chosen from it. A ``hold_back`` streamer lags by one step at most.

``verify="off"`` checks nothing (the client logs so once). Limits: stateless forwards
(``use_cache=False``, training forwards and backwards) are not audited; a span's auditor is an
exact replica (same span, announced compute dtype, quantisation and adapter:
:func:`shoal.client.remote.directory.replicas`), so a span nobody else serves alike goes unaudited; the
receipts of a pushed hop (:mod:`shoal.client.remote.driver`) are what makes its recorded inputs the ones
it computed on, so without them the session does not push (:meth:`RemoteSession._install`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from shoal.client.remote.hops import Hop
from shoal.errors import ShoalError, UsageError
from shoal.ids import BlockRange, PeerId
from shoal.verify.compare import tolerance_of

VERIFY_MODES = ("off", "audit", "redundant")
DEFAULT_VERIFY = "audit"  # what a client runs unless told otherwise (from_pretrained, ClientConfig, shoal chat/api)
DEFAULT_AUDIT_EVERY = 8  # positions between audits of a hop in audit mode (bench.verify measures the cost of each K)

__all__ = [
    "DEFAULT_AUDIT_EVERY",
    "DEFAULT_VERIFY",
    "VERIFY_MODES",
    "Caught",
    "Conviction",
    "LieDetected",
    "Track",
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
    receipt) proved wrong."""

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

    @property
    def auditing(self) -> bool:
        """Whether sessions have auditors (audit and redundant mode)."""
        return self.mode in ("audit", "redundant")

    @property
    def redundant(self) -> bool:
        """Whether every step is checked, on a second chain disjoint from the main one."""
        return self.mode == "redundant"

    def convicted(self, peer: PeerId, blocks: BlockRange | None = None, position: int | None = None) -> None:
        self.bans += 1
        self.banned = (*self.banned, peer)
        if blocks is not None and position is not None:
            self.caught = (*self.caught, Caught(peer, blocks, position))


@dataclass(frozen=True)
class Caught:
    """A conviction: ``peer``'s outputs of ``blocks`` were wrong from cache position ``position`` on."""

    peer: PeerId
    blocks: BlockRange
    position: int


class LieDetected(ShoalError):
    """A server of the session's chain returned wrong hidden states from ``position`` on (a majority
    of replicas said so). The session is rolled back to ``position`` and the liar replaced; the token
    at ``position`` (computed from honest logits before it) and everything before stand. ``generate``
    handles it (it regenerates from there); a caller stepping a session by hand re-sends from there."""

    def __init__(self, position: int, peer: PeerId | None, blocks: BlockRange):
        who = f"server {peer[:10]}" if peer is not None else "a server since replaced"
        super().__init__(f"{who} lied on blocks {blocks} from position {position}: rolled back there")
        self.position = position
        self.peer = peer
        self.blocks = blocks


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
    """The audit of one hop: its auditor (None: nobody checks it) and the positions ``[0, audited)``
    checked so far (the auditor's cache holds at least those). ``unverified``: no auditor could be
    had, or a dispute stayed unsettled; the span is reported unverified and no longer audited.

    The history at the hop's end block holds its own outputs from ``since`` on; before that, those
    of the hop it replaced (``before``: that server, when it had exactly this span; None when the
    chain had other boundaries there, and a lie cannot be pinned on one server)."""

    hop: Hop
    audited: int
    since: int = 0
    before: PeerId | None = None
    auditor: Hop | None = None
    unverified: bool = False

    @property
    def checked(self) -> bool:
        return self.auditor is not None and not self.unverified

    def producer(self, position: int) -> PeerId | None:
        """The server whose output the history holds at ``position`` of the hop's end block."""
        return self.hop.span.peer_id if position >= self.since else self.before


@dataclass(frozen=True)
class Conviction:
    """An audit proved the outputs of hop ``index``'s span wrong from ``position`` on: the session
    rolls back there and, if they are the hop's own (``replace``), replaces the hop. ``peer``: who
    computed them (None: not one server, see :attr:`Track.before`); convicted already."""

    index: int
    peer: PeerId | None
    blocks: BlockRange
    position: int
    replace: bool


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
    return Track(hop, audited=min(audited, position), since=position, before=before)


def take_spare(spare: list[Hop], hop: Hop, banned: Collection[str]) -> Hop | None:
    """An auditor of a hop that left whose span is ``hop``'s and that is neither ``hop``'s server nor banned."""
    for auditor in spare:
        peer = auditor.span.peer_id
        if auditor.span.blocks == hop.span.blocks and peer != hop.span.peer_id and peer not in banned:
            spare.remove(auditor)
            return auditor
    return None
