"""Attacks on the HTTP gateway (``shoal api`` / ``shoal dashboard``) by web pages its user opens.

The gateway listens on loopback, usually without an API key, so a hostile page can make the user's
browser send it requests: a text/plain form POST (CSRF: a "simple request" needs no preflight), a
page whose name rebinds to 127.0.0.1 (DNS rebinding: same-origin, but its requests carry its own
``Host``), a dashboard URL with ``?ticket=`` that makes the gateway dial any address, and reading
answers cross-origin (CORS). Each test runs the app of :func:`shoal.gateway.app.build_app` in
process (Starlette's TestClient) over a stand-in engine that counts generations and stand-in
watchers that record every swarm they are asked to dial: no model, no network, milliseconds each.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from shoal.cli.main import build_parser
from shoal.gateway.app import build_app
from shoal.gateway.engine import Completion
from shoal.gateway.guards import allowed_hosts
from shoal.gateway.swarm import Watchers
from shoal.transport import Ticket, TransportConfig

pytestmark = pytest.mark.timeout(30)

KEY = "attack-test-key"
MODEL = "fake"
TICKET = str(Ticket("0f" * 32, ("127.0.0.1:9",), None, "another-swarm"))
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class CountingEngine:
    """What the app asks of an :class:`~shoal.gateway.engine.Engine`; each generation is counted."""

    model_id = MODEL
    model = SimpleNamespace(verification=None)

    def __init__(self):
        self.generated = 0

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return [1, 2, 3]

    def text_prompt(self, prompt) -> list[int]:
        return [1, 2, 3]

    def budget(self, prompt, max_tokens: int | None, param: str) -> int:
        return max_tokens or 2

    def complete(self, prompt, sampling, on_text=None, cancel=None) -> Completion:
        self.generated += 1
        return Completion("ok", "length", len(prompt), 1)

    def routes(self) -> list:
        return []


class FakeWatcher:
    table = SimpleNamespace(swarm="another-swarm")

    async def status(self) -> dict:
        return {"swarm": "another-swarm", "models": [], "unverified_servers": [], "via": "peer", "error": None}

    async def history(self, since=None) -> dict:
        return {"samples": []}


class RecordingWatchers(Watchers):
    """Records each swarm it is asked for (``None``: the gateway's own); dials nothing."""

    def __init__(self):
        super().__init__(TransportConfig(bind_addr="127.0.0.1:0"))
        self.asked: list[str | None] = []

    def get(self, ticket: str | None) -> FakeWatcher:
        self.asked.append(ticket)
        return FakeWatcher()


@contextmanager
def gateway(host: str = "localhost:8000", **options):
    """(client, engine, watchers) of an app built as ``shoal api`` on 127.0.0.1 builds it (its
    default allowed hosts), the client's requests saying ``Host: host``."""
    engine, watchers = CountingEngine(), RecordingWatchers()
    options.setdefault("allowed_hosts", allowed_hosts("127.0.0.1"))
    api_key = options.pop("api_key", None)
    app = build_app(engine, watchers, api_key, 2, **options)
    with TestClient(app, base_url=f"http://{host}") as client:
        yield client, engine, watchers


def assert_error(reply, status: int, code: str, *fragments: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    for fragment in fragments:
        assert fragment in error["message"], error


def test_csrf_text_plain_post_is_refused_415_and_nothing_is_generated():
    """A cross-site form (or ``fetch`` with ``mode: no-cors``) can POST text/plain, or a form
    encoding, without a preflight; its body may well parse as JSON. Refused before the route runs."""
    body = '{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    with gateway() as (client, engine, _):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/anything"):
            for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
                reply = client.post(path, content=body, headers={"Content-Type": kind})
                assert_error(reply, 415, "unsupported_media_type", "Content-Type: application/json")
            reply = client.post(path, content=body)  # no Content-Type at all
            assert_error(reply, 415, "unsupported_media_type")
        assert engine.generated == 0
        # JSON (with a charset, in any case) is served: the refusal above was the content type alone
        for kind in ("application/json", "Application/JSON; charset=utf-8"):
            reply = client.post("/v1/chat/completions", content=body, headers={"Content-Type": kind})
            assert reply.status_code == 200, reply.text
        assert engine.generated == 2


def test_dns_rebinding_host_is_refused_on_every_route_and_localhost_works():
    """A page of evil.example rebound to 127.0.0.1 reaches the gateway same-origin, but says
    ``Host: evil.example``: 421 on every route (health checks included), nothing generated."""
    with gateway("evil.example") as (client, engine, watchers):
        for path in ("/healthz", "/readyz", "/metrics", "/dashboard", "/api/swarm", "/v1/models"):
            assert_error(client.get(path), 421, "host_not_allowed", "evil.example", "--allowed-host")
        assert_error(client.post("/v1/chat/completions", json=CHAT), 421, "host_not_allowed")
        assert_error(client.get("/healthz", headers={"Host": "evil.example:8000"}), 421, "host_not_allowed")
        assert (engine.generated, watchers.asked) == (0, [])
        # the names the gateway has: loopback's, this machine's, any address (rebinding needs a name)
        for host in ("localhost:8000", "LOCALHOST", "127.0.0.1:8000", "[::1]:8000", socket.gethostname(), "192.0.2.7"):
            assert client.get("/healthz", headers={"Host": host}).status_code == 200, host
        assert client.post("/v1/chat/completions", json=CHAT, headers={"Host": "localhost:8000"}).status_code == 200
        assert engine.generated == 1
    with gateway("evil.example", allowed_hosts=allowed_hosts("127.0.0.1", ["evil.example"])) as (client, _, _):
        assert client.get("/healthz").status_code == 200  # --allowed-host evil.example
    with gateway("evil.example", allowed_hosts=allowed_hosts("127.0.0.1", ["*"])) as (client, _, _):
        assert client.get("/healthz").status_code == 200  # --allowed-host '*'


def test_ticket_dialling_needs_the_api_key_and_nothing_is_dialled_without_it():
    """``/api/swarm?ticket=`` makes the gateway dial the peer a ticket names (any address, any
    port): a page could make it probe the user's network. Only a caller with the API key may."""
    with gateway() as (client, _, watchers):  # no --api-key: no one may
        for path in (f"/api/swarm?ticket={TICKET}", f"/api/swarm/history?ticket={TICKET}&since=0"):
            assert_error(client.get(path), 403, "ticket_needs_api_key", "--api-key")
            assert_error(client.get(path, headers={"Authorization": f"Bearer {KEY}"}), 403, "ticket_needs_api_key")
        assert watchers.asked == []  # no watcher, so no node and no dial
        assert client.get("/api/swarm").status_code == 200  # the gateway's own swarm, as before
        assert client.get("/api/swarm/history?since=0").status_code == 200
        assert client.get("/api/swarm?ticket=").status_code == 200  # empty: the own swarm too
        assert watchers.asked == [None, None, ""]  # Watchers.get("") is the own swarm
    with gateway(api_key=KEY) as (client, _, watchers):
        path = f"/api/swarm?ticket={TICKET}"
        assert_error(client.get(path), 401, "missing_api_key")
        assert_error(client.get(path, headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
        assert watchers.asked == []
        assert client.get("/api/swarm").status_code == 200  # the own swarm still needs no key
        assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        history = client.get(f"/api/swarm/history?ticket={TICKET}", headers={"Authorization": f"Bearer {KEY}"})
        assert history.status_code == 200
        assert watchers.asked == [None, TICKET, TICKET]


def test_no_cors_header_by_default_and_exactly_the_configured_origins_get_one():
    """Without ``--cors-origin`` no answer carries ``Access-Control-Allow-Origin`` (no other page
    reads it) and a preflight is not granted; with it, that origin alone is."""
    origin, evil = "https://app.example", "https://evil.example"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    with gateway() as (client, _, _):
        for who in (origin, evil):
            assert "access-control-allow-origin" not in client.get("/healthz", headers={"Origin": who}).headers
            granted = client.options("/v1/chat/completions", headers={"Origin": who, **preflight})
            assert "access-control-allow-origin" not in granted.headers
            posted = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": who})
            assert "access-control-allow-origin" not in posted.headers
    with gateway(cors_origins=(origin,)) as (client, engine, _):
        assert client.get("/healthz", headers={"Origin": origin}).headers["access-control-allow-origin"] == origin
        granted = client.options("/v1/chat/completions", headers={"Origin": origin, **preflight})
        assert granted.status_code == 200 and granted.headers["access-control-allow-origin"] == origin
        posted = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert posted.status_code == 200 and posted.headers["access-control-allow-origin"] == origin
        assert "access-control-allow-origin" not in client.get("/healthz", headers={"Origin": evil}).headers
        refused = client.options("/v1/chat/completions", headers={"Origin": evil, **preflight})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        assert engine.generated == 1


@pytest.mark.parametrize("command", ["api", "dashboard"])
def test_the_flags_reach_the_gateway_and_default_to_no_extra_host_and_no_origin(monkeypatch, command):
    import shoal.gateway.serve as serve

    seen = []
    monkeypatch.setattr(serve, "serve_gateway", lambda options: seen.append(options) or 0)
    model = ["m"] if command == "api" else []
    parser = build_parser()
    args = parser.parse_args([command, *model, "--join", TICKET])
    assert args.func(args) == 0
    assert (seen[0].allowed_hosts, seen[0].cors_origins) == ((), ())
    flags = ["--allowed-host", "gpu.lan", "--allowed-host", "*", "--cors-origin", "https://a.example"]
    args = parser.parse_args([command, *model, "--join", TICKET, "--api-key", KEY, *flags])
    assert args.func(args) == 0
    assert (seen[1].allowed_hosts, seen[1].cors_origins, seen[1].api_key) == (
        ("gpu.lan", "*"),
        ("https://a.example",),
        KEY,
    )
    assert allowed_hosts("0.0.0.0") == ("localhost", "127.0.0.1", "::1", socket.gethostname().lower())
    assert allowed_hosts("10.1.2.3", ["GPU.lan."])[-2:] == (socket.gethostname().lower(), "gpu.lan")
    assert allowed_hosts("::", ["a", "*"]) == ("*",)
