"""shoal's wire format: typed messages carrying tensors, as validated frames. No I/O."""

from shoal.wire.codecs import Codec
from shoal.wire.messages import (
    FRAME_DATA,
    FRAME_HEAD,
    FRAME_PREFIX,
    MAX_FRAME_PAYLOAD,
    WIRE_VERSION,
    Assembler,
    InvalidMessage,
    Limits,
    Message,
    encode,
    error_message,
    frames,
    parse_prefix,
    writes,
)
from shoal.wire.schema import CAPABILITIES, KINDS
from shoal.wire.tensors import CODECS, DTYPES

__all__ = [
    "CAPABILITIES",
    "CODECS",
    "DTYPES",
    "FRAME_DATA",
    "FRAME_HEAD",
    "FRAME_PREFIX",
    "KINDS",
    "MAX_FRAME_PAYLOAD",
    "WIRE_VERSION",
    "Assembler",
    "Codec",
    "InvalidMessage",
    "Limits",
    "Message",
    "encode",
    "error_message",
    "frames",
    "parse_prefix",
    "writes",
]
