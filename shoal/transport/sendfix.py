"""The one workaround for a defect of the iroh 1.2.0 Python binding's send path.

The generated ``iroh_ffi._UniffiRustBufferBuilder.write`` copies a ``bytes`` argument into the Rust
buffer with a Python loop over every byte, which caps sending at a few MB/s. We replace that one
method with a single ``memmove`` into the same reserved region. The replacement relies on the
private class's shape (``rbuf`` with ``data``/``len``, a ``_reserve`` context manager); if the
binding changes shape we refuse to patch and say so rather than corrupt memory, and
``tests/transport/test_node.py::test_send_path_fix_is_active_and_far_faster_than_stock`` fails.
:mod:`shoal.transport.fastcall` lowers the bytes of its hot calls with the same :func:`memmove_into`.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
from iroh import iroh_ffi

log = logging.getLogger(__name__)

_Builder = iroh_ffi._UniffiRustBufferBuilder
STOCK_WRITE = _Builder.write


def memmove_into(address: int, value: bytes | memoryview) -> int:
    """Copy ``value`` (bytes, or any contiguous byte buffer such as a tensor's memoryview) to
    ``address`` with one memmove; return the byte count."""
    if isinstance(value, bytes):
        ctypes.memmove(address, value, len(value))
        return len(value)
    array = np.frombuffer(value, dtype=np.uint8)
    ctypes.memmove(address, array.ctypes.data, array.nbytes)
    return array.nbytes


def _memmove_write(self, value) -> None:
    """The replacement of ``_UniffiRustBufferBuilder.write``: one memmove into the reserved region."""
    size = len(value) if isinstance(value, bytes) else memoryview(value).nbytes
    with self._reserve(size):
        memmove_into(ctypes.cast(self.rbuf.data, ctypes.c_void_p).value + self.rbuf.len, value)


def shape_ok() -> bool:
    """Whether the binding's Rust buffer still has the layout both workarounds write into."""
    fields = dict(iroh_ffi._UniffiRustBuffer._fields_)
    return (
        hasattr(_Builder, "_reserve")
        and fields.get("data") == ctypes.POINTER(ctypes.c_char)
        and fields.get("len") == ctypes.c_uint64
    )


def apply() -> bool:
    """Install the fix (idempotent). Returns whether it is active."""
    if _Builder.write is _memmove_write:
        return True
    if not shape_ok():
        log.warning("iroh binding changed shape; send-path fix NOT applied (sending will be slow)")
        return False
    _Builder.write = _memmove_write
    return True


def is_active() -> bool:
    return _Builder.write is _memmove_write
