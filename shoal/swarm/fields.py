"""Checks of a swarm record's decoded fields: each one passes a well-formed value through or raises
:class:`RecordError` ``malformed`` naming the field (:mod:`shoal.swarm.records` re-exports the error)."""

from __future__ import annotations

import math
import re

from shoal.errors import ShoalError

MAX_FIELD_LEN = 512  # strings, lists


class RecordError(ShoalError):
    """A record was rejected. ``reason`` is a short tag counted by tables."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise RecordError("malformed", what)


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x) -> bool:
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)


def is_str(x) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_FIELD_LEN


_PEER_ID = re.compile(r"[0-9a-f]{64}")


def is_peer(x) -> bool:
    return isinstance(x, str) and _PEER_ID.fullmatch(x) is not None


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # as shoal.wire.schema.AdapterName


def is_adapter(x) -> bool:
    """``[name, digest]``: a LoRA adapter's name and the sha256 hex of its tensors."""
    return (
        isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and _ADAPTER_NAME.fullmatch(x[0]) is not None
        and is_peer(x[1])  # 64 lowercase hex digits, like a peer id
    )  # fmt: skip


def as_str(x) -> str:
    expect(is_str(x), "string field")
    return x


def as_peer(x) -> str:
    expect(is_peer(x), "peer id")
    return x


def as_swarm(x) -> str:
    expect(is_str(x) and len(x) <= 64, "swarm id")
    return x


def as_times(ts, exp) -> tuple[float, float]:
    expect(is_num(ts) and is_num(exp) and 0 < ts < exp, "timestamp/expiry")
    return float(ts), float(exp)
