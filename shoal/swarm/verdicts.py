"""Who the swarm convicts of lying: signed verdicts (:class:`~shoal.swarm.records.VerdictRecord`)
weighed against every online server of the blocks, so that no single key decides.

A peer P is convicted for model M on blocks ``[a, b)`` when at least :data:`MIN_JUDGES` (2) distinct
judges signed verdicts against P on exactly ``[a, b)``, each an ONLINE server of M other than P whose
span COVERS ``[a, b)``, and those judges are a strict majority of the electorate: every ONLINE server
of M other than P whose span OVERLAPS ``[a, b)``. Why each part:

* a verdict's blocks are its receipt's blocks (checked when the record is decoded): a judge cannot
  pick blocks of its own (a sub-range it alone covers) to shrink the electorate to itself;
* only a server covering the blocks can recompute the evidence, so only its word counts; a verdict
  of any other key (a client, a server of other blocks or of part of them) is held and shown, never
  counted;
* the electorate is every server overlapping the blocks, not only those covering them: honest
  servers that split P's span (P on 0:16, H1 on 0:8, H2 on 8:16) cannot judge it, yet without their
  votes one attacker serving 0:16 would be the whole electorate and convict P alone. They never sign,
  so they weigh against a conviction, as an abstention does;
* a strict majority: one malicious server cannot convict an honest one that two honest servers
  overlap (it needs more keys than the honest servers have; collusion of one owner's many keys is out
  of scope, as the issue states);
* at least two judges: a strict majority of an electorate of one is that one key, and one key alone
  never convicts;
* only online judges and voters count: a conviction lapses when its judges leave, and a verdict
  expires after its lifetime unless its judge, still online, re-signs it (:class:`VerdictKeeper`).
  The accused's own absence lapses nothing: its judges keep re-signing for a day, so a liar that
  goes quiet until its records expire is convicted again the moment it comes back.

* for a client, only judges it has itself seen computing those blocks correctly (``vouched``: a hop
  its audits found clean, an auditor that agreed, a third replica in a settled majority). An
  admitted server is only one that answers probes, which costs a key nothing but an open port; a
  judge seen computing the blocks did the work. Verdicts of judges not seen yet are *advisory*
  (:func:`suspected`): the client routes around the accused where others serve its blocks, and
  audits it where it must use it. So any number of keys that serve nothing convict nobody, and a
  real liar is still dropped swarm-wide: by every client that has used its honest judges, and
  routed around by the others. Servers (next hops, ``shoal swarm status``) have no audits of their
  own and count admitted judges (``vouched=None``).

The price is liveness, never safety: a swarm where fewer than two other servers cover a span never
convicts that span's server swarm-wide, nor one whose blocks are mostly served in pieces (the
judges cannot outnumber the abstaining partial servers); the clients that caught it still ban it
locally (:mod:`shoal.client.verification.audit`) and its judges stop accepting its pushes.

:func:`tally` and :func:`convicted` are pure (a table in, facts out): clients drop convicted peers
from routes, servers from their next hops, ``shoal swarm status`` shows the tallies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import msgspec

from shoal.ids import BlockRange, PeerId
from shoal.swarm.records import EVIDENCE_DIGEST_BYTES, ServerRecord, SignedRecord, State, VerdictRecord, sign
from shoal.swarm.table import RecordTable
from shoal.wire.schema import Receipt

#: how long a verdict lives after signing; its judge re-signs it at half that while online. Below a
#: table's default max lifetime (3600 s), with room for float rounding of ``expires - timestamp``.
VERDICT_LIFETIME = 1800.0
#: judges it takes to convict however small the electorate: one key alone never convicts
MIN_JUDGES = 2

#: for each peer, the blocks a client has seen it compute correctly (its own audits): who may judge for it
Vouched = Mapping[str, Sequence[BlockRange]]

__all__ = [
    "MAX_KEPT_VERDICTS", "MIN_JUDGES", "VERDICT_LIFETIME", "VERDICT_MAX_AGE", "Tally", "VerdictKeeper", "Vouched",
    "convicted", "covers", "overlaps", "suspected", "tally", "verdict_for", "vouched_for",
]  # fmt: skip


@dataclass(frozen=True)
class Tally:
    """The verdicts against ``accused`` on ``blocks`` of ``model``: ``judges`` count (online servers
    covering the blocks), ``ignored`` do not; ``electorate``: how many online servers of the model
    other than the accused overlap the blocks, the whole of which the judges must be a majority."""

    accused: str
    model: str
    blocks: BlockRange
    judges: tuple[str, ...]
    ignored: tuple[str, ...]
    electorate: int
    advisory: tuple[str, ...] = ()  # judges able to judge that the deciding client has not seen compute the blocks

    @property
    def needed(self) -> int:
        """Judges it takes to convict: a strict majority of the electorate, and never fewer than two."""
        return max(MIN_JUDGES, self.electorate // 2 + 1)

    @property
    def convicts(self) -> bool:
        return len(self.judges) >= self.needed

    @property
    def suspects(self) -> bool:
        """Whether it would convict were its advisory judges seen computing the blocks too."""
        return not self.convicts and len(self.judges) + len(self.advisory) >= self.needed

    def as_json(self) -> dict:
        return {
            "accused": self.accused,
            "model": self.model,
            "start": self.blocks.start,
            "end": self.blocks.end,
            "judges": list(self.judges),
            "ignored_judges": list(self.ignored),
            "electorate": self.electorate,
            "needed": self.needed,
            "convicts": self.convicts,
            "advisory_judges": list(self.advisory),
        }


def covers(record: ServerRecord, blocks: BlockRange) -> bool:
    """Serves every one of ``blocks``: can recompute evidence about them, so may judge."""
    return record.start <= blocks.start and blocks.end <= record.end


def overlaps(record: ServerRecord, blocks: BlockRange) -> bool:
    """Serves at least one of ``blocks``: has a vote on a verdict about them."""
    return record.start < blocks.end and blocks.start < record.end


def vouched_for(vouched: Vouched, peer: str, blocks: BlockRange) -> bool:
    """Whether ``vouched`` saw ``peer`` compute every one of ``blocks`` correctly."""
    seen = vouched.get(peer, ())
    return all(any(r.start <= b < r.end for r in seen) for b in range(blocks.start, blocks.end))


def tally(table: RecordTable, model: str, now: float | None = None, vouched: Vouched | None = None) -> list[Tally]:
    """Every (accused, blocks) that verdicts of ``model`` name, weighed (see the module docstring).
    ``vouched``: a client's (only judges it saw compute the blocks count; the others are advisory);
    None: every admitted judge counts (a server's view)."""
    now = table.clock() if now is None else now
    # only servers this peer has reached may judge or vote (a record alone is free to make)
    online = [r for r in table.admitted(model) if r.state is State.ONLINE and r.expires > now]
    grouped: dict[tuple[str, BlockRange], set[str]] = {}
    for verdict in table.verdicts(model):
        if verdict.expires > now:
            grouped.setdefault((verdict.accused, verdict.blocks), set()).add(verdict.judge)
    out = []
    for (accused, blocks), signers in sorted(grouped.items(), key=lambda item: (item[0][0], item[0][1].start)):
        electorate = {r.peer for r in online if r.peer != accused and overlaps(r, blocks)}
        able = {r.peer for r in online if r.peer != accused and covers(r, blocks)}
        seen = {p for p in signers & able if vouched is None or vouched_for(vouched, p, blocks)}
        advisory = tuple(sorted((signers & able) - seen))
        ignored = tuple(sorted(signers - able))
        out.append(Tally(accused, model, blocks, tuple(sorted(seen)), ignored, len(electorate), advisory))
    return out


def convicted(
    table: RecordTable, model: str, now: float | None = None, vouched: Vouched | None = None
) -> dict[PeerId, Tally]:
    """The peers the swarm convicts for ``model`` now, each with a tally that convicts it (counting,
    given ``vouched``, only judges that client saw compute the blocks)."""
    out: dict[PeerId, Tally] = {}
    for result in tally(table, model, now, vouched):
        if result.convicts:
            out.setdefault(PeerId(result.accused), result)
    return out


def suspected(table: RecordTable, model: str, vouched: Vouched, now: float | None = None) -> dict[PeerId, Tally]:
    """The peers not convicted for a client with ``vouched`` whose verdicts would convict them were
    the advisory judges counted: that client routes around them where it can, and audits them."""
    out: dict[PeerId, Tally] = {}
    results = tally(table, model, now, vouched)
    guilty = {r.accused for r in results if r.convicts}
    for result in results:
        if result.suspects and result.accused not in guilty:
            out.setdefault(PeerId(result.accused), result)
    return out


def verdict_for(
    *,
    swarm: str,
    judge: str,
    accused: str,
    model: str,
    blocks: BlockRange,
    evidence: bytes,
    receipt: Receipt | bytes,
    now: float | None = None,
    lifetime: float = VERDICT_LIFETIME,
) -> VerdictRecord:
    """The unsigned verdict a judge hands to its presence (which signs and gossips it): ``evidence``
    the sha256 of the evidence it recomputed, ``receipt`` the accused's receipt of the disputed step."""
    if len(evidence) != EVIDENCE_DIGEST_BYTES:
        raise ValueError(f"evidence must be a {EVIDENCE_DIGEST_BYTES}-byte sha256, got {len(evidence)} bytes")
    now = time.time() if now is None else now
    data = receipt if isinstance(receipt, bytes) else msgspec.msgpack.encode(receipt)
    return VerdictRecord(swarm, judge, accused, model, blocks, evidence, data, now, now + lifetime)


#: seconds a judge keeps re-signing a verdict after it judged the evidence (then it lapses; new
#: evidence of a liar still lying convicts it again)
VERDICT_MAX_AGE = 24 * 3600.0
#: verdicts a judge keeps at most (the oldest judged dropped first): what it re-signs and gossips
#: stays bounded however many keys it convicts
MAX_KEPT_VERDICTS = 1024


class VerdictKeeper:
    """A judge's verdicts: signed with its node key and published when given, re-signed (fresh
    timestamp and expiry) once half their lifetime passed, for as long as the judge asks for
    :meth:`due` records, that is while its swarm presence runs.

    A verdict is kept :data:`VERDICT_MAX_AGE` after it was first signed whether or not its accused
    is in the swarm's table now: a liar that goes quiet until its server record expires (minutes)
    must not come back acquitted, so its absence never erases a verdict. What a judge keeps (and
    gossips) is bounded by count instead: at most ``max_kept`` (:data:`MAX_KEPT_VERDICTS`), the
    oldest judged dropped first, so a flood of convicted throwaway keys costs a bounded table."""

    def __init__(
        self,
        secret_key: bytes,
        publish: Callable[[SignedRecord], None],
        clock: Callable[[], float] = time.time,
        *,
        max_age: float = VERDICT_MAX_AGE,
        max_kept: int = MAX_KEPT_VERDICTS,
        cert: bytes | None = None,  # the judge's member certificate, carried by its verdicts (private swarms)
    ):
        self._key = secret_key
        self._cert = cert
        self._publish = publish
        self._clock = clock
        self._max_age = max_age
        self._max_kept = max_kept
        self._signed: dict[str, SignedRecord] = {}  # in the order first judged (oldest first)
        self._judged: dict[str, float] = {}  # key -> when first signed (re-signing keeps it)

    def __len__(self) -> int:
        return len(self._signed)

    def add(self, record: VerdictRecord) -> SignedRecord:
        """Sign ``record`` (``ValueError`` unless this keeper's key is its judge's) and publish it;
        the oldest verdicts beyond ``max_kept`` are dropped."""
        signed = sign(record, self._key, self._cert)
        self._signed.pop(record.key, None)  # judged again: now the newest
        self._signed[record.key] = signed
        self._judged[record.key] = record.timestamp
        while len(self._signed) > self._max_kept:
            oldest = next(iter(self._signed))
            del self._signed[oldest]
            self._judged.pop(oldest, None)
        self._publish(signed)
        return signed

    def due(self, now: float | None = None) -> list[SignedRecord]:
        """Verdicts re-signed now because half their lifetime passed (the caller publishes them);
        those past their age are dropped first."""
        now = self._clock() if now is None else now
        self._prune(now)
        out = []
        for key, signed in list(self._signed.items()):
            record = signed.record
            lifetime = record.expires - record.timestamp
            if now - record.timestamp >= lifetime / 2:
                renewed = replace(record, timestamp=now, expires=now + lifetime)
                fresh = self._signed[key] = sign(renewed, self._key, self._cert)
                out.append(fresh)
        return out

    def _prune(self, now: float) -> None:
        for key in list(self._signed):
            if now - self._judged.get(key, now) > self._max_age:
                del self._signed[key]
                self._judged.pop(key, None)
