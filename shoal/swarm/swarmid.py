"""What a swarm id says: its name, the model it is pinned to, and (private swarms) its owner.

    NAME                  a public swarm, unpinned (its first model record defines each model)
    NAME~mPIN             a public swarm pinned to one model: PIN is :func:`model_digest` of it
    NAME~oOWNER~mPIN      a private swarm: OWNER is :func:`owner_tag` of the owner's public key

Everything that knows a swarm (tickets, records, every table) holds its id, so a pin in the id
cannot be redefined by a record: a model record whose digest differs is refused by every table
(``model_pin``), whoever signed it and whenever it came. A pinned swarm serves its one model (run a
swarm per model); an unpinned one (an id without ``~m``) keeps first-come model records. Digests are
96 bits (24 hex): matching one takes a second preimage.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

import msgpack

from shoal.errors import UsageError

DIGEST_HEX = 24
MAX_SWARM_ID = 64  # as records bound it
_TAG = re.compile(f"[0-9a-f]{{{DIGEST_HEX}}}")


@dataclass(frozen=True)
class SwarmId:
    name: str
    pin: str | None = None  # model_digest of the founding model (24 hex)
    owner: str | None = None  # owner_tag of the private swarm's owner key (24 hex)

    def __str__(self) -> str:
        owner = f"~o{self.owner}" if self.owner else ""
        pin = f"~m{self.pin}" if self.pin else ""
        return f"{self.name}{owner}{pin}"

    @property
    def private(self) -> bool:
        return self.owner is not None


def parse_swarm_id(text: str) -> SwarmId:
    """The parts of a swarm id; an id without ``~`` is a plain public name (as before pins)."""
    name, *tags = text.split("~")
    owner = pin = None
    for tag in tags:
        kind, value = tag[:1], tag[1:]
        if kind == "o" and owner is None and _TAG.fullmatch(value):
            owner = value
        elif kind == "m" and pin is None and _TAG.fullmatch(value):
            pin = value
        else:
            raise UsageError(f"swarm id {text!r}: unknown or repeated part {tag!r}")
    if not name or len(text) > MAX_SWARM_ID:
        raise UsageError(f"swarm id {text!r}: needs a name and at most {MAX_SWARM_ID} characters")
    return SwarmId(name, pin=pin, owner=owner)


def new_swarm_id(pin: str | None, owner: str | None = None) -> str:
    """A fresh swarm's id: a random name, the pin of its founding model, its owner (private)."""
    return str(SwarmId(secrets.token_hex(8 if owner is None else 6), pin=pin, owner=owner))


def model_digest(
    name: str, num_blocks: int, fingerprints: tuple[bytes, ...] | list[bytes], manifest: bytes = b""
) -> str:
    """What pins a model: its name, its block count, every block's fingerprint and, when the founder
    holds every file, the BLAKE3 of their chunk manifest (24 hex). Without a manifest the digest is
    as before manifests (``shoal/model/1``)."""
    if manifest:
        fields = ["shoal/model/2", name, num_blocks, list(fingerprints), manifest]
    else:
        fields = ["shoal/model/1", name, num_blocks, list(fingerprints)]
    return hashlib.sha256(msgpack.packb(fields, use_bin_type=True)).hexdigest()[:DIGEST_HEX]


def owner_tag(owner: str) -> str:
    """A private swarm's owner, as its id names it: of the owner's public key (64 hex)."""
    return hashlib.sha256(b"shoal/owner/1\0" + bytes.fromhex(owner)).hexdigest()[:DIGEST_HEX]


def pin_refusal(
    swarm: SwarmId, name: str, num_blocks: int, fingerprints: tuple[bytes, ...], manifest: bytes = b""
) -> str | None:
    """Why a model record (``name``, its blocks, its chunk ``manifest``) may not define a model of
    ``swarm``, or None. A pinned swarm serves the model it is pinned to: the pin is a digest, which
    names no model, so a record of any other digest (another name too) could be a forgery of it, and
    is refused. A pin with the manifest in it takes only that manifest (so every file a member
    fetches from peers is the founder's: the config and tokenizer too, which no fingerprint covers);
    a pin without one takes any (the first model record's stands, :mod:`shoal.swarm.table`)."""
    if swarm.pin is None or swarm.pin in (
        model_digest(name, num_blocks, fingerprints, manifest),
        model_digest(name, num_blocks, fingerprints),
    ):
        return None
    return f"model {name} (its weights or its chunk manifest) is not the model swarm {swarm} is pinned to"


__all__ = ["SwarmId", "model_digest", "new_swarm_id", "owner_tag", "parse_swarm_id", "pin_refusal"]
