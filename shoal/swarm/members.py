"""Who may take part in a private swarm: member certificates, and the one decision over them.

A private swarm has an owner key (``shoal swarm new --private``); its id names the owner
(:func:`shoal.swarm.swarmid.owner_tag`). The owner signs a certificate for each member
(``shoal swarm invite``): the member's peer id (its node's ed25519 public key), whether it may only
serve, and when the certificate expires. A member presents it where it enters: its node hands it to
each peer it dials (``hello``, :attr:`shoal.transport.BaseNode.credential`), and its records carry
it (:func:`shoal.swarm.records.sign`). Revocation is an owner-signed record gossiped through the
swarm's table (:class:`~shoal.swarm.records.RevocationRecord`).

:func:`refusal` is the decision, pure: a certificate (or none), the peer, the swarm, the time and
the revoked peers in; why the peer may not take part, or None. Certificates verify once per bytes
(memoised).

    shoalcert1<base32 of msgpack [body, signature]>
    body = msgpack ["shoal/member/1", owner public key hex, member peer id hex, role, issued, expires]

``role``: ``"member"`` (serve and use the swarm) or ``"server"`` (serve only); ``expires`` 0: never.
"""

from __future__ import annotations

import base64
import functools
import math
import re
from collections.abc import Container
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shoal.errors import ShoalError
from shoal.swarm.swarmid import SwarmId, owner_tag

CONTEXT = "shoal/member/1"
PREFIX = "shoalcert1"
MAX_CERTIFICATE_BYTES = 512  # a certificate is about 200 bytes
ROLES = ("member", "server")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class MembershipError(ShoalError):
    """A certificate that does not parse or verify, or a peer a private swarm refuses."""


@dataclass(frozen=True)
class Certificate:
    owner: str  # the owner's public key, hex
    member: str  # the member's peer id, hex
    role: str  # "member" or "server" (serve only)
    issued: float
    expires: float  # 0: never

    @property
    def servers_only(self) -> bool:
        return self.role == "server"


def public_key(secret_key: bytes) -> str:
    """The peer id (public key, hex) of a 32-byte ed25519 secret key."""
    return Ed25519PrivateKey.from_private_bytes(secret_key).public_key().public_bytes_raw().hex()


def issue(owner_key: bytes, member: str, *, now: float, expires: float = 0.0, servers_only: bool = False) -> bytes:
    """A certificate, signed with ``owner_key``, that admits peer ``member`` (until ``expires``, 0: never)."""
    if not _HEX64.fullmatch(member):
        raise MembershipError(f"a member is a peer id (64 hex characters), got {member!r}")
    role = "server" if servers_only else "member"
    body = msgpack.packb([CONTEXT, public_key(owner_key), member, role, float(now), float(expires)])
    return msgpack.packb([body, Ed25519PrivateKey.from_private_bytes(owner_key).sign(body)])


@functools.lru_cache(maxsize=4096)
def read_certificate(data: bytes) -> Certificate:
    """The certificate ``data`` holds, its owner's signature checked; :class:`MembershipError` if not."""
    if not isinstance(data, bytes) or len(data) > MAX_CERTIFICATE_BYTES:
        raise MembershipError("certificate too large")
    try:
        body, signature = msgpack.unpackb(data)
        context, owner, member, role, issued, expires = msgpack.unpackb(body)
    except Exception:  # msgpack and unpacking raise many types: all mean a damaged certificate
        raise MembershipError("damaged certificate") from None
    ok = (
        context == CONTEXT and isinstance(owner, str) and _HEX64.fullmatch(owner) is not None
        and isinstance(member, str) and _HEX64.fullmatch(member) is not None and role in ROLES
        and all(isinstance(t, float) and math.isfinite(t) and t >= 0 for t in (issued, expires))
        and isinstance(signature, bytes)
    )  # fmt: skip
    if not ok:
        raise MembershipError("malformed certificate")
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(owner)).verify(signature, body)
    except (InvalidSignature, ValueError):
        raise MembershipError("certificate not signed by the owner it names") from None
    return Certificate(owner, member, role, issued, expires)


def certificate_text(data: bytes) -> str:
    return PREFIX + base64.b32encode(data).decode().rstrip("=").lower()


def parse_certificate(text: str) -> bytes:
    """The bytes of a ``shoalcert1...`` text, verified (:class:`MembershipError` if not)."""
    text = text.strip()
    if not text.startswith(PREFIX):
        raise MembershipError(f"not a shoal member certificate (expected {PREFIX}...): {text[:24]!r}")
    body = text[len(PREFIX) :].upper()
    try:
        data = base64.b32decode(body + "=" * (-len(body) % 8))
    except ValueError:
        raise MembershipError("damaged certificate text") from None
    read_certificate(data)
    return data


def refusal(
    presented: bytes | None,
    peer: str,
    swarm: SwarmId,
    now: float,
    revoked: Container[str] = (),
    *,
    serving: bool = True,
) -> str | None:
    """Why ``peer``, which presented ``presented`` (a certificate's bytes, or None), may not take part
    in ``swarm`` at ``now`` (``serving``: as a server; else as a client), or None if it may."""
    if swarm.owner is None:
        return None  # a public swarm: anyone
    if _is_owner(peer, swarm):
        return None  # the owner's own node (revoking, inspecting) needs no certificate
    where = f"private swarm {swarm}"
    if presented is None:
        return f"peer {peer[:10]} is not a member of {where}: it presented no certificate (see shoal swarm invite)"
    try:
        cert = read_certificate(presented)
    except MembershipError as exc:
        return f"peer {peer[:10]} presented a bad certificate for {where}: {exc}"
    if owner_tag(cert.owner) != swarm.owner:
        return f"peer {peer[:10]} is not a member of {where}: its certificate is for another swarm"
    if cert.member != peer:
        return f"peer {peer[:10]} presented the certificate of peer {cert.member[:10]} for {where}"
    if cert.expires and cert.expires <= now:
        return f"the certificate of peer {peer[:10]} for {where} expired {now - cert.expires:.0f} s ago"
    if peer in revoked:
        return f"the owner of {where} revoked the membership of peer {peer[:10]}"
    if not serving and cert.servers_only:
        return f"peer {peer[:10]} may only serve in {where}, not use it (its certificate is for servers only)"
    return None


def _is_owner(peer: str, swarm: SwarmId) -> bool:
    return _HEX64.fullmatch(peer) is not None and owner_tag(peer) == swarm.owner


__all__ = [
    "Certificate",
    "MembershipError",
    "certificate_text",
    "issue",
    "parse_certificate",
    "public_key",
    "read_certificate",
    "refusal",
]
