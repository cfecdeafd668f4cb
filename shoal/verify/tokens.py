"""Push tokens bound to the peer that may use them, and to the one step it may push with each.

A session's server issues a secret at ``open`` (:class:`~shoal.wire.schema.OpenReply` ``token``)
that only the session's client learns. For every step it pushes, the client hands the server before
that hop in its chain :func:`push_token` of the secret, that server's peer id and the step (its id,
position, number of positions, and whether a receipt is asked), and the session's server accepts a
push only with the token of the pushing stream's peer, which the transport authenticates, for the
step pushed (:func:`push_allowed`). So a token is worth something to one peer, for one step: a
server that sees a later hop's token (a push route carries the rest of the chain on) can neither
push into that session nor pass for the hop before it; the hop before it cannot push the step at
another position, under another id, or without the receipt the client asked for (which would make
the client blame the honest server pushed to); and nobody derives another session's token. Only the
tensors a pusher sends stay its own: the receipt of the server pushed to shows them to the client
(:class:`~shoal.verify.receipts.Equivocation`).
"""

from __future__ import annotations

import hashlib
import hmac

PUSH_TOKEN_CONTEXT = b"shoal/push-token/1\0"
PUSH_TOKEN_CHARS = 32  # 128 bits, in hex
MIGRATE_TOKEN_CONTEXT = b"shoal/migrate-token/1\0"


def push_token(secret: str, previous: str, *, step: int, position: int, n: int, receipt: bool) -> str:
    """The token that lets peer ``previous`` (a peer id) push step ``step`` (``n`` positions at
    ``position``, asking a receipt or not) into the session of ``secret``."""
    what = f"{previous}\0{step}\0{position}\0{n}\0{int(receipt)}".encode()
    return hmac.new(secret.encode(), PUSH_TOKEN_CONTEXT + what, hashlib.sha256).hexdigest()[:PUSH_TOKEN_CHARS]


def push_allowed(secret: str, token: str, pusher: str, *, step: int, position: int, n: int, receipt: bool) -> bool:
    """Whether ``token`` lets ``pusher`` (the pushing stream's peer id) push that step into the
    session of ``secret`` (compared in constant time)."""
    expected = push_token(secret, pusher, step=step, position=position, n=n, receipt=receipt)
    return hmac.compare_digest(expected.encode(), token.encode())


def migrate_token(secret: str, source: str, *, step: int, position: int) -> str:
    """The token that lets peer ``source`` (the session's draining server) hand its KV pages of
    positions ``[0, position)`` to the session of ``secret`` in migration ``step`` (never a push token:
    another context)."""
    what = f"{source}\0{step}\0{position}".encode()
    return hmac.new(secret.encode(), MIGRATE_TOKEN_CONTEXT + what, hashlib.sha256).hexdigest()[:PUSH_TOKEN_CHARS]


def migrate_allowed(secret: str, token: str, source: str, *, step: int, position: int) -> bool:
    """Whether ``token`` lets ``source`` (the sending stream's peer id) hand those pages over."""
    expected = migrate_token(secret, source, step=step, position=position)
    return hmac.compare_digest(expected.encode(), token.encode())


__all__ = [
    "MIGRATE_TOKEN_CONTEXT",
    "PUSH_TOKEN_CHARS",
    "PUSH_TOKEN_CONTEXT",
    "migrate_allowed",
    "migrate_token",
    "push_allowed",
    "push_token",
]
