"""Lean calls of the iroh binding's three hot stream methods: ``write_all``, ``read``, ``read_exact``.

Every message shoal sends or receives goes through these calls, and the binding's generated glue
around each one is heavy Python: a cloned handle and a bytes argument lowered through context
managers and a per-byte loop for the length prefix, a locked handle map for the continuation, a
context manager and a stream object to lift the result. On these machines the Python right after
a thread wake-up runs several times slower than warm, so that glue showed up whole in every round
trip. This module makes the same FFI calls with the least Python: same functions, same handles,
same error lifting (an ``IrohError`` comes out exactly as from the binding).

It relies on private names of the generated module (``_UniffiLib`` functions, ``_UniffiRustBuffer``,
``_UniffiRustCallStatus``). :func:`available` checks their shape once; if iroh changes shape the
binding's own methods are used instead and a warning says so. ``tests/transport/test_fastcall.py``
compares both paths call for call. ``SHOAL_FASTCALL=0`` turns the lean calls off (to measure them
side by side).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import os
import struct
import threading
from typing import Any

from iroh import iroh_ffi

from shoal.transport import binding

log = logging.getLogger(__name__)

_I32 = struct.Struct(">i")  # uniffi's length prefix of a lowered byte string


def _shape_ok() -> bool:
    lib = getattr(iroh_ffi, "_UniffiLib", None)
    needed = (
        "uniffi_iroh_ffi_fn_clone_sendstream",
        "uniffi_iroh_ffi_fn_clone_recvstream",
        "uniffi_iroh_ffi_fn_method_sendstream_write_all",
        "uniffi_iroh_ffi_fn_method_recvstream_read",
        "uniffi_iroh_ffi_fn_method_recvstream_read_exact",
        "ffi_iroh_ffi_rustbuffer_alloc",
        "ffi_iroh_ffi_rustbuffer_free",
        "ffi_iroh_ffi_rust_future_poll_void",
        "ffi_iroh_ffi_rust_future_complete_void",
        "ffi_iroh_ffi_rust_future_free_void",
        "ffi_iroh_ffi_rust_future_poll_rust_buffer",
        "ffi_iroh_ffi_rust_future_complete_rust_buffer",
        "ffi_iroh_ffi_rust_future_free_rust_buffer",
    )
    if lib is None or not all(hasattr(lib, name) for name in needed):
        return False
    buffer, status = iroh_ffi._UniffiRustBuffer, iroh_ffi._UniffiRustCallStatus
    return (
        binding.shape_ok()
        and dict(status._fields_).get("error_buf") is buffer
        and lib.uniffi_iroh_ffi_fn_method_sendstream_write_all.argtypes == (ctypes.c_uint64, buffer)
        and lib.uniffi_iroh_ffi_fn_method_recvstream_read.argtypes == (ctypes.c_uint64, ctypes.c_uint32)
        and lib.uniffi_iroh_ffi_fn_method_recvstream_read_exact.argtypes == (ctypes.c_uint64, ctypes.c_uint32)
        and lib.ffi_iroh_ffi_rust_future_complete_rust_buffer.restype is buffer
        and getattr(iroh_ffi, "_UNIFFI_RUST_FUTURE_POLL_READY", None) == 0
        and hasattr(iroh_ffi, "_UNIFFI_RUST_FUTURE_CONTINUATION_CALLBACK")
        and hasattr(iroh_ffi, "_UniffiFfiConverterTypeIrohError__as_error")
    )


_DISABLED = os.environ.get("SHOAL_FASTCALL", "1") == "0"  # for side-by-side measurements
_AVAILABLE = not _DISABLED and _shape_ok()
if not _AVAILABLE and not _DISABLED:
    log.warning("iroh binding changed shape; lean stream calls NOT used (every message costs more)")


def available() -> bool:
    return _AVAILABLE


# ---- continuations ----------------------------------------------------------------------------
# A Rust future calls back when it may have progressed: inline, from inside our poll call, or later
# from a tokio thread. Each pending poll is a handle in ``_pending``; dict operations are atomic
# under the GIL, so no lock. An inline callback resolves the asyncio future at once instead of
# waking the event loop through its self-pipe.
_pending: dict[int, asyncio.Future] = {}
_handles = itertools.count(1)
_polling = threading.local()


def _resolve(future: asyncio.Future, code: int) -> None:
    if not future.cancelled():
        future.set_result(code)


def _continue(handle: int, code: int) -> None:
    future = _pending.pop(handle, None)
    if future is None:
        return
    if getattr(_polling, "loop", None) is future.get_loop():  # inline, on the loop's own thread
        _resolve(future, code)
    else:
        try:
            future.get_loop().call_soon_threadsafe(_resolve, future, code)
        except RuntimeError:  # the loop closed (process shutting down): nobody awaits this any more
            pass


if _AVAILABLE:
    _lib = iroh_ffi._UniffiLib
    _Status = iroh_ffi._UniffiRustCallStatus
    _IrohErrorConverter = iroh_ffi._UniffiFfiConverterTypeIrohError__as_error
    _CALLBACK = iroh_ffi._UNIFFI_RUST_FUTURE_CONTINUATION_CALLBACK(_continue)


def _check(status: Any) -> None:
    if status.code:  # lifted and raised exactly as the binding does
        iroh_ffi._uniffi_check_call_status(_IrohErrorConverter, status)


async def _call(rust_future: int, poll: Any, complete: Any, free: Any) -> Any:
    """Drive one Rust future to completion (uniffi's protocol: poll until READY, complete, free)."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            future = loop.create_future()
            handle = next(_handles)
            _pending[handle] = future
            _polling.loop = loop
            try:
                poll(rust_future, _CALLBACK, handle)
            finally:
                _polling.loop = None
            code = future.result() if future.done() else await future
            if code == 0:  # READY
                break
        status = _Status()
        result = complete(rust_future, ctypes.byref(status))
        _check(status)
        return result
    finally:
        free(rust_future)


def _clone(clone_fn: Any, obj: Any) -> int:
    status = _Status()
    handle = clone_fn(obj._handle, ctypes.byref(status))
    _check(status)
    return handle


def _lower_bytes(data: bytes | memoryview) -> Any:
    """A Rust buffer holding ``data`` as uniffi lowers a byte string: i32 length, then the bytes."""
    size = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
    status = _Status()
    rbuf = _lib.ffi_iroh_ffi_rustbuffer_alloc(size + 4, ctypes.byref(status))
    _check(status)
    base = ctypes.cast(rbuf.data, ctypes.c_void_p).value
    ctypes.memmove(base, _I32.pack(size), 4)
    binding.memmove_into(base + 4, data)
    rbuf.len = size + 4
    return rbuf


def _lift_bytes(rbuf: Any) -> bytes:
    try:
        base = ctypes.cast(rbuf.data, ctypes.c_void_p).value
        if rbuf.len < 4:
            raise iroh_ffi.InternalError("byte string shorter than its length prefix")
        (size,) = _I32.unpack(ctypes.string_at(base, 4))
        if size < 0 or size + 4 != rbuf.len:
            raise iroh_ffi.InternalError(f"byte string of {size} bytes in a buffer of {rbuf.len}")
        return ctypes.string_at(base + 4, size)
    finally:
        status = _Status()
        _lib.ffi_iroh_ffi_rustbuffer_free(rbuf, ctypes.byref(status))


# ---- the three calls ----------------------------------------------------------------------------
async def write_all(send: Any, data: bytes | memoryview) -> None:
    """``await send.write_all(data)``; ``data`` may be any contiguous byte buffer."""
    if not _AVAILABLE:
        return await send.write_all(data if isinstance(data, bytes) else bytes(data))
    rust_future = _lib.uniffi_iroh_ffi_fn_method_sendstream_write_all(
        _clone(_lib.uniffi_iroh_ffi_fn_clone_sendstream, send), _lower_bytes(data)
    )
    await _call(
        rust_future,
        _lib.ffi_iroh_ffi_rust_future_poll_void,
        _lib.ffi_iroh_ffi_rust_future_complete_void,
        _lib.ffi_iroh_ffi_rust_future_free_void,
    )


async def read(recv: Any, size_limit: int) -> bytes:
    """``await recv.read(size_limit)``: what has arrived, at most ``size_limit`` bytes."""
    if not _AVAILABLE:
        return await recv.read(size_limit)
    return await _read(_lib.uniffi_iroh_ffi_fn_method_recvstream_read, recv, size_limit)


async def read_exact(recv: Any, size: int) -> bytes:
    """``await recv.read_exact(size)``."""
    if not _AVAILABLE:
        return await recv.read_exact(size)
    return await _read(_lib.uniffi_iroh_ffi_fn_method_recvstream_read_exact, recv, size)


async def _read(method: Any, recv: Any, size: int) -> bytes:
    if not 0 <= size < 2**32:
        raise ValueError(f"read size {size} out of range")
    rust_future = method(_clone(_lib.uniffi_iroh_ffi_fn_clone_recvstream, recv), size)
    rbuf = await _call(
        rust_future,
        _lib.ffi_iroh_ffi_rust_future_poll_rust_buffer,
        _lib.ffi_iroh_ffi_rust_future_complete_rust_buffer,
        _lib.ffi_iroh_ffi_rust_future_free_rust_buffer,
    )
    return _lift_bytes(rbuf)
