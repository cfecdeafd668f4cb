"""Push tokens bound to the peer that may use them: a server that learns one cannot push with it.

A session's server issues a secret at ``open`` (:class:`~shoal.wire.schema.OpenReply` ``token``)
that only the session's client learns. The client hands the server before that hop in its chain
``push_token(secret, that server's peer id)`` (:class:`~shoal.wire.schema.PushHop`), and the
session's server accepts a push only with the token of the pushing stream's peer, which the
transport authenticates (:func:`push_allowed`). So a token is worth something to one peer only: a
server that sees a later hop's token (a push route carries the rest of the chain on) can neither
push into that session nor pass for the hop before it, and nobody derives another session's token.
"""

from __future__ import annotations

import hashlib
import hmac

PUSH_TOKEN_CONTEXT = b"shoal/push-token/1\0"
PUSH_TOKEN_CHARS = 32  # 128 bits, in hex


def push_token(secret: str, previous: str) -> str:
    """The token that lets peer ``previous`` (a peer id) push into the session of ``secret``."""
    mac = hmac.new(secret.encode(), PUSH_TOKEN_CONTEXT + previous.encode(), hashlib.sha256)
    return mac.hexdigest()[:PUSH_TOKEN_CHARS]


def push_allowed(secret: str, token: str, pusher: str) -> bool:
    """Whether ``token`` lets ``pusher`` (the pushing stream's peer id) push into the session of
    ``secret`` (compared in constant time)."""
    return hmac.compare_digest(push_token(secret, pusher).encode(), token.encode())


__all__ = ["PUSH_TOKEN_CHARS", "PUSH_TOKEN_CONTEXT", "push_allowed", "push_token"]
