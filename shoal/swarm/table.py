"""A peer's view of the swarm: the newest valid record per key, with every rejection counted.

Merging is the only way in, so gossip, clients and tests all go through the same checks:
signature, swarm, expiry, clock skew, lifetime, newer-than-held, size, (for server records)
fingerprints that match the swarm's model record, and (for verdicts, on decoding) a receipt the
accused signed. Verdicts are only held here; who they convict is :mod:`shoal.swarm.verdicts`.
What the swarm id says is enforced here too (:mod:`shoal.swarm.swarmid`): a model record must match
the model the swarm is pinned to (``model_pin``) unless the private swarm's owner signed it (a model it
added; it lives as long as the owner says), and in a private swarm every record must carry its
signer's valid member certificate (``not_member``) and a revocation must be the owner's
(``not_owner``); a revocation admitted drops the revoked member's records.

A table is bounded whoever signs (:class:`~shoal.limits.RegistryLimits`): a key holds one server
record (its key is the signer's), at most ``max_models_per_signer`` model records (a private
swarm's owner excepted) and ``max_verdicts_per_signer`` verdicts; a model at most
``max_servers_per_model`` server records; the table at most ``max_models`` model names,
``max_records`` records, ``max_table_bytes``. Server and model records live at most
``max_announce_lifetime`` (the owner's, again, as long as it says).

The rule past a cap: a record that would need room the cap has not is refused (reason ``full``);
nothing held is ever evicted to make room, and a record already held may always be replaced by a
newer one of its key. Keys cost nothing, so an attacker with many keys can fill a cap: what it
then holds back is newcomers (honest or not), never a record the table already had, and only for
as long as it keeps re-signing its records within ``max_announce_lifetime`` and getting them
through the senders' budgets (:mod:`shoal.swarm.quota`). Room frees as records lapse, so honest
servers that keep refreshing keep their places, and one that joins during a flood waits until
the flood's records expire. (Evicting anything instead, oldest or newest, would let the flood
choose its victims among the honest records.)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from shoal.limits import RegistryLimits, count_down
from shoal.swarm.liveness import Liveness, Reach
from shoal.swarm.members import refusal
from shoal.swarm.records import (
    ModelRecord,
    RecordError,
    RevocationRecord,
    ServerRecord,
    SignedRecord,
    State,
    VerdictRecord,
    decode,
)
from shoal.swarm.swarmid import owner_tag, parse_swarm_id, pin_refusal

log = logging.getLogger(__name__)
MAX_REVOCATION_LIFETIME = 400 * 86400.0  # a revocation must outlive the certificate it revokes


class RecordTable:
    def __init__(
        self,
        swarm: str,
        *,
        clock: Callable[[], float] = time.time,
        max_skew: float = 5.0,
        max_lifetime: float = 3600.0,
        limits: RegistryLimits = RegistryLimits(),
    ):
        self.swarm = swarm
        self.id = parse_swarm_id(swarm)  # its pin and owner, if any
        self.clock = clock
        self.max_skew = max_skew
        self.max_lifetime = max_lifetime
        self.limits = limits
        self._records: dict[str, SignedRecord] = {}
        # what the caps count, kept by _put and _drop
        self._bytes = 0
        self._signed: Counter[tuple[str, str]] = Counter()  # (kind tag, signer) -> records
        self._names: Counter[str] = Counter()  # model name -> records naming it (model or server)
        self._servers: Counter[str] = Counter()  # model name -> server records
        self.rejected: Counter[str] = Counter()
        self.accepted = 0
        self.liveness: Liveness | None = None  # whether servers answer (None: every record counts as reached)

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: str) -> SignedRecord | None:
        return self._records.get(key)

    def check(self, signed: SignedRecord, now: float | None = None) -> None:
        """Raise :class:`RecordError` if ``signed`` may not enter this table."""
        record, now = signed.record, self.clock() if now is None else now
        if record.swarm != self.swarm:
            raise RecordError("wrong_swarm", f"{record.key} belongs to swarm {record.swarm!r}")
        if record.expires <= now:
            raise RecordError("expired", record.key)
        if record.timestamp > now + self.max_skew:
            raise RecordError("future", f"{record.key} is dated {record.timestamp - now:.1f} s ahead")
        owners = isinstance(record, RevocationRecord) or self.signed_by_owner(record)  # live as long as the owner says
        if owners:
            cap = MAX_REVOCATION_LIFETIME
        elif isinstance(record, VerdictRecord):
            cap = self.max_lifetime
        else:  # a server or model record: re-signed every refresh (see RegistryLimits)
            cap = min(self.max_lifetime, self.limits.max_announce_lifetime)
        lifetime = record.expires - record.timestamp
        if lifetime > cap:
            raise RecordError("lifetime", f"{record.key} claims to live {lifetime:.0f} s")
        held = self._records.get(record.key)
        # a conflicting model definition is a forgery whatever its age: say so rather than "stale"
        if isinstance(record, ModelRecord) and held is not None and held.record.fingerprints != record.fingerprints:
            raise RecordError("fingerprint_mismatch", f"model {record.name} is already defined with other weights")
        if (
            isinstance(record, ModelRecord)
            and held is not None
            and held.record.manifest
            and record.manifest not in (b"", held.record.manifest)
        ):  # the chunk manifest is a model's too: the first one stands
            raise RecordError("manifest_mismatch", f"model {record.name} is already defined with another manifest")
        if held is not None and record.timestamp <= held.timestamp:
            raise RecordError("stale", f"{record.key} is not newer than the one held")
        self._check_admitted(signed, now)
        if isinstance(record, ServerRecord):
            self._check_server(record)
        self._check_room(signed, held)

    def _check_room(self, signed: SignedRecord, held: SignedRecord | None) -> None:
        """Refuse ``signed`` (``full``) if it needs room a cap has not (``held``: its key's record)."""
        record, limits = signed.record, self.limits
        if held is None and len(self._records) >= limits.max_records:
            raise RecordError("full", f"{record.key}: the table holds {limits.max_records} records")
        if self._bytes - (len(held.data) if held else 0) + len(signed.data) > limits.max_table_bytes:
            raise RecordError("full", f"{record.key}: the table holds {limits.max_table_bytes} bytes of records")
        same_signer = held is not None and held.record.signer == record.signer
        per_signer = {ModelRecord: limits.max_models_per_signer, VerdictRecord: limits.max_verdicts_per_signer}
        cap = per_signer.get(type(record))
        owners = self.signed_by_owner(record)  # a private swarm's owner adds models as it sees fit
        if cap is not None and not (same_signer or owners) and self._signed[record.TAG, record.signer] >= cap:
            raise RecordError("full", f"{record.key}: {record.signer[:10]} signs {cap} {record.TAG} records already")
        name = _model_name(record)
        if name is not None and name not in self._names and len(self._names) >= limits.max_models:
            raise RecordError("full", f"{record.key}: the table names {limits.max_models} models")
        if not isinstance(record, ServerRecord) or (held is not None and held.record.model == record.model):
            return
        if self._servers[record.model] >= limits.max_servers_per_model:
            raise RecordError("full", f"{record.key}: model {record.model} has {limits.max_servers_per_model} servers")

    def _put(self, signed: SignedRecord) -> None:
        held = self._records.get(signed.key)
        if held is not None:
            self._uncount(held)
        self._records[signed.key] = signed
        record = signed.record
        self._bytes += len(signed.data)
        self._signed[record.TAG, record.signer] += 1
        name = _model_name(record)
        if name is not None:
            self._names[name] += 1
        if isinstance(record, ServerRecord):
            self._servers[record.model] += 1

    def _drop(self, key: str) -> None:
        self._uncount(self._records.pop(key))

    def _uncount(self, signed: SignedRecord) -> None:
        record = signed.record
        self._bytes -= len(signed.data)
        count_down(self._signed, (record.TAG, record.signer), 1)
        name = _model_name(record)
        if name is not None:
            count_down(self._names, name, 1)
        if isinstance(record, ServerRecord):
            count_down(self._servers, record.model, 1)

    def _check_admitted(self, signed: SignedRecord, now: float) -> None:
        """What the swarm id demands: the pinned model, the private swarm's owner and members."""
        record, swarm = signed.record, self.id
        if isinstance(record, RevocationRecord):
            if swarm.owner is None or owner_tag(record.owner) != swarm.owner:
                raise RecordError("not_owner", f"{record.key} is not signed by the owner of swarm {self.swarm}")
            return
        if swarm.owner is not None and (why := refusal(signed.cert, record.signer, swarm, now, self.revoked)):
            raise RecordError("not_member", f"{record.key}: {why}")
        pinned = isinstance(record, ModelRecord) and not self.signed_by_owner(record)
        if pinned and (why := pin_refusal(swarm, record.name, record.num_blocks, record.fingerprints, record.manifest)):
            raise RecordError("model_pin", why)

    def signed_by_owner(self, record) -> bool:
        """A model record the private swarm's owner signed: a model it added beside the pinned one."""
        return (
            isinstance(record, ModelRecord) and self.id.owner is not None and owner_tag(record.signer) == self.id.owner
        )

    def _check_server(self, record: ServerRecord) -> None:
        model = self.model(record.model)
        if model is None:
            return  # checked once the model record arrives (see _purge_mismatching)
        if record.end > model.num_blocks or record.fingerprints != model.fingerprints[record.start : record.end]:
            raise RecordError("fingerprint_mismatch", f"{record.key} serves other weights than model {model.name}")

    def merge(self, data: bytes | SignedRecord) -> bool:
        """Take one record (bytes as gossiped, or already decoded). True if it was new."""
        try:
            signed = decode(data) if isinstance(data, bytes) else data
            self.check(signed)
        except RecordError as exc:
            self.rejected[exc.reason] += 1
            if exc.reason != "stale":  # stale copies are normal in gossip; the rest are worth a line
                log.info("rejected record: %s", exc)
            return False
        self._put(signed)
        self.accepted += 1
        if isinstance(signed.record, ModelRecord):
            self._purge_mismatching(signed.record)
        elif isinstance(signed.record, RevocationRecord):
            self._purge_revoked(signed.record.member)
        return True

    def merge_many(self, items: Iterable[bytes | SignedRecord]) -> list[str]:
        return [item.key if isinstance(item, SignedRecord) else decode(item).key for item in items if self.merge(item)]

    def _purge_mismatching(self, model: ModelRecord) -> None:
        for key, signed in list(self._records.items()):
            record = signed.record
            if isinstance(record, ServerRecord) and record.model == model.name:
                try:
                    self._check_server(record)
                except RecordError as exc:
                    self._drop(key)
                    self.rejected[exc.reason] += 1

    def _purge_revoked(self, member: str) -> None:
        for key, signed in list(self._records.items()):
            if not isinstance(signed.record, RevocationRecord) and signed.record.signer == member:
                self._drop(key)
                self.rejected["not_member"] += 1

    @property
    def revoked(self) -> _Revoked:
        """The members whose revocation this table holds (``peer in table.revoked``)."""
        return _Revoked(self._records)

    def expire(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        gone = [key for key, signed in self._records.items() if signed.record.expires <= now]
        for key in gone:
            self._drop(key)
        return gone

    @property
    def bytes(self) -> int:
        """Bytes of the records held, as signed."""
        return self._bytes

    def digest(self) -> list[tuple[str, float]]:
        return [(key, signed.timestamp) for key, signed in self._records.items()]

    def wanted(self, digest: Iterable[tuple[str, float]]) -> list[str]:
        """Keys of ``digest`` for which the peer holds something newer than we do."""
        out = []
        for key, timestamp in digest:
            held = self._records.get(key)
            if held is None or held.timestamp < timestamp:
                out.append(key)
        return out

    def newer_than(self, digest: Iterable[tuple[str, float]]) -> list[SignedRecord]:
        """Records we hold that the peer (whose digest this is) lacks or holds older."""
        theirs = dict(digest)
        return [s for key, s in self._records.items() if theirs.get(key, -1.0) < s.timestamp]

    def records(self) -> list[SignedRecord]:
        return list(self._records.values())

    def model(self, name: str) -> ModelRecord | None:
        signed = self._records.get(f"m:{name}")
        return signed.record if signed is not None else None

    def models(self) -> list[ModelRecord]:
        return [s.record for s in self._records.values() if isinstance(s.record, ModelRecord)]

    def reach(self, record: ServerRecord) -> Reach:
        """Whether this peer has reached ``record``'s server (:mod:`shoal.swarm.liveness`)."""
        return Reach.REACHABLE if self.liveness is None else self.liveness.reach(record)

    def servers(
        self, model: str | None = None, include_offline: bool = False, include_unreachable: bool = False
    ) -> list[ServerRecord]:
        """Server records (of ``model``), verified against its model record when there is one;
        without those a probe found unreachable unless ``include_unreachable``."""
        out = []
        for signed in self._records.values():
            record = signed.record
            if not isinstance(record, ServerRecord) or (model is not None and record.model != model):
                continue
            if record.state is State.OFFLINE and not include_offline:
                continue
            if not include_unreachable and self.reach(record) is Reach.UNREACHABLE:
                continue
            out.append(record)
        return sorted(out, key=lambda r: (r.model, r.start, r.peer))

    def admitted(self, model: str | None = None) -> list[ServerRecord]:
        """Server records (of ``model``) whose servers this peer has reached: the ones that may
        audit, judge or vote."""
        return [r for r in self.servers(model) if self.reach(r) is Reach.REACHABLE]

    def verdicts(self, model: str | None = None) -> list[VerdictRecord]:
        """Verdicts held (against servers of ``model``), by accused then judge."""
        out = [
            s.record
            for s in self._records.values()
            if isinstance(s.record, VerdictRecord) and (model is None or s.record.model == model)
        ]
        return sorted(out, key=lambda v: (v.model, v.accused, v.judge))


class _Revoked:
    def __init__(self, records: dict[str, SignedRecord]):
        self._records = records

    def __contains__(self, peer: object) -> bool:
        return f"r:{peer}" in self._records


def _model_name(record) -> str | None:
    """The model a record names, for the cap on model names (verdicts name one, but are capped
    per judge instead)."""
    if isinstance(record, ModelRecord):
        return record.name
    if isinstance(record, ServerRecord):
        return record.model
    return None
