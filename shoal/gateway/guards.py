"""What the gateway refuses before any route runs, against web pages that use a browser as their proxy.

The gateway usually listens on loopback with no API key, so any page its user opens could try to
reach it. Two pure ASGI middlewares (no buffering: streams and disconnects pass through untouched)
close the ways in; :func:`shoal.gateway.app.build_app` stacks them, outermost first:

    HostGuard     421 unless the ``Host`` header names this gateway: DNS rebinding (a page of
                  evil.example whose name then resolves to 127.0.0.1 talks to us same-origin, but its
                  requests still say ``Host: evil.example``)
    (CORS)        Starlette's CORSMiddleware, only for the origins ``--cors-origin`` names; without it
                  no response carries ``Access-Control-Allow-Origin``, so no other page reads one
    JsonOnly      415 for a POST whose body is not ``application/json``: a cross-site form or
                  ``fetch`` may send text/plain without asking first (a CORS "simple request"); JSON
                  needs a preflight, which nobody but ``--cors-origin`` passes

Refusals are OpenAI's error shape, like every other error of the gateway. ``?ticket=`` (the
dashboard dialling another swarm) is guarded in the app itself: it needs the API key.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.gateway.engine import GatewayError

__all__ = ["ANY_HOST", "LOOPBACK_HOSTS", "HostGuard", "JsonOnly", "allowed_hosts", "host_name"]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"  # --allowed-host '*': no Host check
WILDCARD_BINDS = ("", "0.0.0.0", "::")  # bind addresses that name no one host


def host_name(value: str) -> str:
    """The host of a ``Host`` header, without port or IPv6 brackets, lower case, no trailing dot:
    ``[::1]:8000`` -> ``::1``, ``LocalHost.:80`` -> ``localhost``."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1 : value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def allowed_hosts(bind: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The host names the gateway answers to when bound to ``bind``: loopback's, ``bind`` itself when
    it is one address (not 0.0.0.0 or ::), this machine's name, and ``extra`` (``--allowed-host``);
    ``("*",)`` when ``extra`` holds ``*``. (Any IP address is also accepted, see :class:`HostGuard`.)"""
    extra = tuple(extra)
    if ANY_HOST in extra:
        return (ANY_HOST,)
    names = [*LOOPBACK_HOSTS, *([] if bind in WILDCARD_BINDS else [bind]), socket.gethostname(), *extra]
    return tuple(dict.fromkeys(host_name(name) for name in names if name))


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


async def _refuse(error: GatewayError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


class HostGuard:
    """Refuses an HTTP request whose ``Host`` is not an allowed name (or is missing) with
    **421 Misdirected Request**, health checks and the dashboard included.

    421 rather than 403: the request is not forbidden to its sender, it reached a server that does not
    serve that name (RFC 9110, 15.5.20: "not able to produce a response for the target URI's
    authority"); the same client is welcome under an allowed name. An IP address is always allowed:
    rebinding needs a DNS name, and a page whose origin is an address is served by that address.
    """

    def __init__(self, app: ASGIApp, hosts: Iterable[str]):
        self.app = app
        self.hosts = frozenset(host_name(h) if h != ANY_HOST else h for h in hosts)

    def allows(self, header: str | None) -> bool:
        if ANY_HOST in self.hosts:
            return True
        name = host_name(header or "")
        return bool(name) and (name in self.hosts or _is_address(name))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = Headers(scope=scope).get("host")
            if not self.allows(header):
                shown = f"`{header}`" if header else "no Host header"
                message = (
                    f"this gateway does not answer to {shown} (a guard against DNS rebinding); "
                    "start it with --allowed-host NAME to accept that name, or --allowed-host '*' for any"
                )
                return await _refuse(GatewayError(421, message, code="host_not_allowed"), scope, receive, send)
        await self.app(scope, receive, send)


class JsonOnly:
    """Refuses a POST whose ``Content-Type`` is not ``application/json`` (parameters such as
    ``charset`` allowed) with **415**, before the route (and its API key check) runs."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = Headers(scope=scope).get("content-type", "")
            if kind.partition(";")[0].strip().lower() != "application/json":
                shown = f"`{kind}`" if kind else "none"
                message = f"the body must be JSON, sent with 'Content-Type: application/json' (this one: {shown})"
                error = GatewayError(415, message, code="unsupported_media_type")
                return await _refuse(error, scope, receive, send)
        await self.app(scope, receive, send)
