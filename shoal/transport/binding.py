"""Workarounds for two defects of the iroh 1.2.0 Python binding: its send path, and finalizers
that deadlock the endpoint.

**The send path.** The generated ``iroh_ffi._UniffiRustBufferBuilder.write`` copies a ``bytes``
argument into the Rust buffer with a Python loop over every byte, which caps sending at a few MB/s.
We replace that one method with a single ``memmove`` into the same reserved region. The replacement relies on the
private class's shape (``rbuf`` with ``data``/``len``, a ``_reserve`` context manager); if the
binding changes shape we refuse to patch and say so rather than corrupt memory, and
``tests/transport/test_node.py::test_send_path_fix_is_active_and_far_faster_than_stock`` fails.
:mod:`shoal.transport.fastcall` lowers the bytes of its hot calls with the same :func:`memmove_into`.

**Finalizers on iroh's threads.** A binding object (a stream half, a connection) frees its Rust
side in ``__del__``, and dropping a stream half locks its connection. iroh wakes a waiting call
from a tokio thread while that thread holds the connection's lock (``ConnectionDriver::poll``), and
the wake runs Python there (the continuation callback). Any allocation in that Python may start a
garbage collection, which runs the ``__del__`` of whatever unreachable binding objects it finds (a
stream half kept in a cycle by an exception's traceback, say): the free takes the lock its own
thread holds, the tokio thread waits forever, and the endpoint stops answering anyone (issue #32's
fuzz found it: 100,000 frames wedged a server in about half the runs; ``gdb`` showed exactly that
stack). :func:`apply` makes every binding class's ``__del__`` hand its handle to
:func:`release_deferred` when it runs on a thread Python did not start (iroh's), which the event
loop then runs (asked at once; the transport also calls it before each new stream and when a node
closes).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import inspect
import logging
import re
import threading
from typing import Any

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


def apply(loop: asyncio.AbstractEventLoop | None = None) -> bool:
    """Install both workarounds (idempotent); ``loop`` (the transport's) frees what iroh's threads
    finalize. Returns whether the send-path fix is active."""
    global _loop
    _loop = loop or _loop
    _defer_foreign_frees()
    if _Builder.write is _memmove_write:
        return True
    if not shape_ok():
        log.warning("iroh binding changed shape; send-path fix NOT applied (sending will be slow)")
        return False
    _Builder.write = _memmove_write
    return True


def is_active() -> bool:
    return _Builder.write is _memmove_write


# ---- finalizers on iroh's threads ---------------------------------------------------------------
#: (free function, handle) of binding objects finalized on a thread Python did not start.
_deferred: collections.deque[tuple[Any, int]] = collections.deque()
_FREE_CALL = re.compile(r"_UniffiLib\.(uniffi_iroh_ffi_fn_free_\w+), handle")
_DEFERRING = "_shoal_defers_foreign_frees"
_loop: asyncio.AbstractEventLoop | None = None  # where deferred frees are released
_installed = False


def _on_foreign_thread() -> bool:
    """Whether this thread was started outside Python (a tokio worker calling back into Python)."""
    return isinstance(threading.current_thread(), threading._DummyThread)


def _deferring_del(free: Any):
    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is None:  # a partly built instance, as the binding's own ``__del__`` checks
            return
        if _on_foreign_thread():
            _deferred.append((free, handle))
            if _loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: the next stream or close frees it
                    _loop.call_soon_threadsafe(release_deferred)
        else:
            iroh_ffi._uniffi_rust_call(free, handle)

    setattr(__del__, _DEFERRING, True)
    return __del__


def binding_classes() -> dict[type, Any]:
    """Every binding class whose ``__del__`` frees a handle, with its free function (read from the
    generated ``__del__``'s own source, so a class the binding adds is covered too)."""
    found = {}
    for cls in vars(iroh_ffi).values():
        finalizer = vars(cls).get("__del__") if isinstance(cls, type) else None
        if finalizer is None:
            continue
        original = getattr(finalizer, "__wrapped_binding_del__", finalizer)
        match = _FREE_CALL.search(inspect.getsource(original))
        if match and hasattr(iroh_ffi._UniffiLib, match.group(1)):
            found[cls] = getattr(iroh_ffi._UniffiLib, match.group(1))
    return found


def _defer_foreign_frees() -> None:
    global _installed
    if _installed:
        return
    for cls, free in binding_classes().items():
        replacement = _deferring_del(free)
        replacement.__wrapped_binding_del__ = vars(cls)["__del__"]
        cls.__del__ = replacement
    _installed = True


def release_deferred() -> int:
    """Free the handles finalized on iroh's threads since the last call (from a thread of ours: an
    event loop's; several loops may call it at once); returns how many this call freed."""
    released = 0
    while True:
        try:
            free, handle = _deferred.popleft()
        except IndexError:
            return released
        iroh_ffi._uniffi_rust_call(free, handle)
        released += 1
