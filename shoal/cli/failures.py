"""The one place where the ``shoal`` command turns an exception into what the user sees.

Every failure ends as exactly one line on standard error, ``shoal: error: WHAT (FIX)``, nothing on
standard output, and an exit status: :data:`USAGE` (2) when the command asked for something that cannot
be (a bad flag value or block range, an unknown model, a malformed ticket), :data:`RUNTIME` (1) when
something went wrong while doing it (a port in use, a peer that does not answer, no route). The
traceback is printed above that line only with ``-v``.
"""

from __future__ import annotations

import errno
import sys
import traceback
from dataclasses import dataclass

from shoal.errors import (
    BindError,
    ConnectTimeout,
    IdentityError,
    ProtocolMismatch,
    RefusedError,
    RemoteError,
    ShoalError,
    TicketError,
    TransportError,
    UsageError,
)

USAGE = 2
RUNTIME = 1
INTERRUPTED = 130

__all__ = ["INTERRUPTED", "RUNTIME", "USAGE", "Failure", "explain", "report"]


@dataclass(frozen=True)
class Failure:
    status: int
    message: str  # one line, without the "shoal: error: " prefix


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "(no message)"


def _os_error(exc: OSError) -> Failure:
    where = f": {exc.filename}" if exc.filename else ""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        return Failure(RUNTIME, f"address already in use{where}: stop what listens there or choose another --port")
    if exc.errno == errno.ECONNREFUSED:
        return Failure(RUNTIME, f"connection refused{where}: is the server running, and is the address right?")
    if isinstance(exc, FileNotFoundError):
        return Failure(RUNTIME, f"no such file or directory{where}")
    if isinstance(exc, PermissionError):
        return Failure(RUNTIME, f"permission denied{where}")
    return Failure(RUNTIME, f"{reason}{where}")


def explain(exc: BaseException) -> Failure:
    """What to tell the user about ``exc``, and the exit status."""
    message = _one_line(str(exc))
    if isinstance(exc, TicketError):
        return Failure(USAGE, f"malformed ticket: {message} (copy the whole `ticket: shoal1...` line a server printed)")
    if isinstance(exc, UsageError):
        return Failure(USAGE, message)
    if isinstance(exc, BindError):
        return Failure(RUNTIME, f"{message} (stop what listens there or choose another --port)")
    if isinstance(exc, IdentityError):
        return Failure(RUNTIME, f"identity file: {message}")
    if isinstance(exc, ProtocolMismatch):
        return Failure(RUNTIME, f"{message} (the peer runs an incompatible shoal version)")
    if isinstance(exc, ConnectTimeout | RefusedError):
        return Failure(RUNTIME, f"cannot reach the peer: {message} (is it running, and is the ticket current?)")
    if isinstance(exc, TransportError):
        return Failure(RUNTIME, f"connection failed: {message}")
    if isinstance(exc, RemoteError):
        return Failure(RUNTIME, f"the server refused: {message}")
    if isinstance(exc, ShoalError):  # NoRouteError, record and checkpoint errors, ...: their text says what
        return Failure(RUNTIME, message)
    if isinstance(exc, OSError):
        return _os_error(exc)
    return Failure(RUNTIME, f"unexpected {type(exc).__name__}: {message} (rerun with -v for the traceback)")


def report(exc: BaseException, *, verbose: bool) -> int:
    """Print ``exc`` as the one error line (after its traceback with ``verbose``); return the status."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    failure = explain(exc)
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"shoal: error: {failure.message}", file=sys.stderr)
    return failure.status
