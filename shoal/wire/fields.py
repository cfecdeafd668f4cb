"""The bounded field types every kind's metadata is built from, and its base struct
(:mod:`shoal.wire.schema` re-exports them): one place for the limits a decoder enforces."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shoal.ids import SessionId

MAX_SESSION_LENGTH = 1 << 20
MAX_BATCH = 1024
MAX_STEP_ID = 1 << 32

Position = Annotated[int, msgspec.Meta(ge=0, le=MAX_SESSION_LENGTH)]
StepId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_STEP_ID)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Session = Annotated[SessionId, msgspec.Meta(max_length=64)]
#: a LoRA adapter's name as servers announce it and clients select it
AdapterName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Digest = Annotated[str, msgspec.Meta(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]
Capabilities = Annotated[frozenset[Annotated[str, msgspec.Meta(max_length=64)]], msgspec.Meta(max_length=64)]
Digest16 = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
Signature = Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]


class Meta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Base of every kind's metadata."""


class Empty(Meta):
    """No metadata (``info`` requests, ``close``, a bare ``result``)."""
