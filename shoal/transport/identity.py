"""A peer's persistent identity: a 32-byte ed25519 secret key in a file only its owner can read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shoal.errors import IdentityError

KEY_BYTES = 32


def generate_key() -> bytes:
    return os.urandom(KEY_BYTES)


def load_or_create_identity(path: str | os.PathLike) -> bytes:
    """Read the key at ``path``, or create it (mode 0600) if the file does not exist.

    A file of the wrong size is an error, never silently replaced: replacing it would give the
    peer a new id and orphan everything the swarm knows about it.
    """
    path = Path(path)
    if path.exists():
        try:
            key = path.read_bytes()
        except OSError as exc:
            raise IdentityError(f"cannot read identity file {path}: {exc}") from exc
        if len(key) != KEY_BYTES:
            raise IdentityError(
                f"identity file {path} is corrupt: {len(key)} bytes, expected {KEY_BYTES}. "
                "Restore it from a backup, or delete it to start with a new peer id."
            )
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            os.chmod(path, 0o600)
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = generate_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key
