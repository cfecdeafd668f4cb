"""shoal's wire format: typed messages carrying tensors, as validated frames. No I/O."""

from shoal.wire.messages import (
    FRAME_DATA,
    FRAME_HEAD,
    FRAME_PREFIX,
    KINDS,
    MAX_FRAME_PAYLOAD,
    WIRE_VERSION,
    Assembler,
    Limits,
    Message,
    encode,
    error_message,
    frames,
    parse_prefix,
    writes,
)
from shoal.wire.tensors import DTYPES

__all__ = [
    "DTYPES",
    "FRAME_DATA",
    "FRAME_HEAD",
    "FRAME_PREFIX",
    "KINDS",
    "MAX_FRAME_PAYLOAD",
    "WIRE_VERSION",
    "Assembler",
    "Limits",
    "Message",
    "encode",
    "error_message",
    "frames",
    "parse_prefix",
    "writes",
]
