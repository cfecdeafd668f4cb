"""Who the swarm convicts of lying: signed verdicts (:class:`~shoal.swarm.records.VerdictRecord`)
weighed by a quorum of the servers that could have judged.

A peer P is convicted for model M when distinct judges J != P, each an ONLINE server of M whose span
covers a verdict's blocks, signed verdicts against P on those blocks, and they are a strict majority
of the online servers of M covering those blocks other than P. Why each part:

* only a server of those blocks can recompute the evidence, so only its word counts; a verdict of
  any other key (a client, a server of other blocks) is held and shown, never counted;
* a strict majority of those who could judge: one malicious server cannot convict an honest one
  while two honest replicas cover its blocks (it needs more keys than the honest servers have;
  collusion of one owner's many keys is out of scope, as the issue states);
* only online judges count: a conviction lapses when its judges leave, and a verdict expires after
  its lifetime unless its judge, still online, re-signs it (:class:`VerdictKeeper`).

:func:`tally` and :func:`convicted` are pure (a table in, facts out): clients drop convicted peers
from routes, servers from their next hops, ``shoal swarm status`` shows the tallies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec

from shoal.ids import BlockRange, PeerId
from shoal.swarm.records import EVIDENCE_DIGEST_BYTES, ServerRecord, SignedRecord, State, VerdictRecord, sign
from shoal.swarm.table import RecordTable
from shoal.wire.schema import Receipt

#: how long a verdict lives after signing; its judge re-signs it at half that while online. Below a
#: table's default max lifetime (3600 s), with room for float rounding of ``expires - timestamp``.
VERDICT_LIFETIME = 1800.0

__all__ = ["VERDICT_LIFETIME", "Tally", "VerdictKeeper", "convicted", "covers", "tally", "verdict_for"]


@dataclass(frozen=True)
class Tally:
    """The verdicts against ``accused`` on ``blocks`` of ``model``: ``judges`` count (online servers
    covering the blocks), ``ignored`` do not; ``covering``: the online servers of the model covering
    the blocks other than the accused, the electorate of the majority."""

    accused: str
    model: str
    blocks: BlockRange
    judges: tuple[str, ...]
    ignored: tuple[str, ...]
    covering: int

    @property
    def convicts(self) -> bool:
        return 2 * len(self.judges) > self.covering

    def as_json(self) -> dict:
        return {
            "accused": self.accused,
            "model": self.model,
            "start": self.blocks.start,
            "end": self.blocks.end,
            "judges": list(self.judges),
            "ignored_judges": list(self.ignored),
            "covering_servers": self.covering,
            "convicts": self.convicts,
        }


def covers(record: ServerRecord, blocks: BlockRange) -> bool:
    return record.start <= blocks.start and blocks.end <= record.end


def tally(table: RecordTable, model: str, now: float | None = None) -> list[Tally]:
    """Every (accused, blocks) that verdicts of ``model`` name, weighed (see the module docstring)."""
    now = table.clock() if now is None else now
    online = [r for r in table.servers(model) if r.state is State.ONLINE and r.expires > now]
    grouped: dict[tuple[str, BlockRange], list[str]] = {}
    for verdict in table.verdicts(model):
        if verdict.expires > now:
            grouped.setdefault((verdict.accused, verdict.blocks), []).append(verdict.judge)
    out = []
    for (accused, blocks), judges in sorted(grouped.items(), key=lambda item: (item[0][0], item[0][1].start)):
        electorate = {r.peer for r in online if covers(r, blocks) and r.peer != accused}
        counted = tuple(sorted(j for j in set(judges) if j in electorate))
        ignored = tuple(sorted(j for j in set(judges) if j not in electorate))
        out.append(Tally(accused, model, blocks, counted, ignored, len(electorate)))
    return out


def convicted(table: RecordTable, model: str, now: float | None = None) -> dict[PeerId, Tally]:
    """The peers the swarm convicts for ``model`` now, each with a tally that convicts it."""
    out: dict[PeerId, Tally] = {}
    for result in tally(table, model, now):
        if result.convicts:
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


class VerdictKeeper:
    """A judge's verdicts: signed with its node key and published when given, re-signed (fresh
    timestamp and expiry) once half their lifetime passed, for as long as the judge asks for
    :meth:`due` records, that is while its swarm presence runs."""

    def __init__(
        self, secret_key: bytes, publish: Callable[[SignedRecord], None], clock: Callable[[], float] = time.time
    ):
        self._key = secret_key
        self._publish = publish
        self._clock = clock
        self._signed: dict[str, SignedRecord] = {}

    def __len__(self) -> int:
        return len(self._signed)

    def add(self, record: VerdictRecord) -> SignedRecord:
        """Sign ``record`` (``ValueError`` unless this keeper's key is its judge's) and publish it."""
        signed = sign(record, self._key)
        self._signed[record.key] = signed
        self._publish(signed)
        return signed

    def due(self, now: float | None = None) -> list[SignedRecord]:
        """Verdicts re-signed now because half their lifetime passed (the caller publishes them)."""
        now = self._clock() if now is None else now
        out = []
        for key, signed in list(self._signed.items()):
            record = signed.record
            lifetime = record.expires - record.timestamp
            if now - record.timestamp >= lifetime / 2:
                fresh = self._signed[key] = sign(replace(record, timestamp=now, expires=now + lifetime), self._key)
                out.append(fresh)
        return out
