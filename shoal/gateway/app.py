"""The HTTP side: OpenAI-compatible routes, server-sent events, the dashboard.

    GET  /v1/models                 the models this gateway serves, each with its coverage now
                                    (``"shoal": {"coverage": {...}, "loaded", "in_flight"}``)
    POST /v1/chat/completions       chat template, ``stream: true`` as SSE chunks ending in [DONE]
    POST /v1/completions            plain prompt continuation
    GET  /dashboard                 live swarm page (HTML + a little JS, polls /api/swarm)
    GET  /api/swarm[?ticket=T]      the swarm's status as JSON (any swarm, with ``ticket``): servers
                                    with their latest load, the swarm graph, this gateway's routes
    GET  /api/swarm/history[?ticket=T&since=S]  1-second load samples of the last 10 minutes
                                    (``ticket`` makes the gateway dial that peer: it needs the API key)
    GET  /healthz                   200 while the process answers
    GET  /readyz                    200 when the swarm can serve the model (every block has an online
                                    server); 503 with the reason (and the uncovered blocks) otherwise
    GET  /metrics                   Prometheus text: completion tokens, speculative decoding's rounds,
                                    drafted and accepted tokens, and the client's verification counters
                                    since start and the servers it banned (see GatewayCollector)

The dashboard, its JSON (of the gateway's own swarm), the health checks and the metrics need no API
key (probes, scrapers and browsers send none). Every route answers only to the allowed ``Host`` names,
a POST only to a JSON body, and no other origin reads an answer unless ``--cors-origin`` names it
(:mod:`shoal.gateway.guards`). When speculative decoding ran, a response's ``usage`` also carries
``"speculation": {rounds, drafted_tokens, accepted_tokens, acceptance_rate, mean_window}``.
With verification on (``--verify audit``, the default, or ``redundant``) a response also carries
shoal's extension key ``"shoal": {"verification": {mode, audit_every, unverified_blocks, audits, audited_positions,
disagreements, settled, unsettled, bans, rollbacks}}`` (:func:`shoal.gateway.engine.checked`): a
non-streamed body at its top level, a stream in the chunk with the ``finish_reason``. Streamed text
then holds only audited tokens, so nothing shown is ever replaced by a repair.

Every error is OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``. Generation
runs in a thread pool (one ``generate`` and one server-side session per request); a streaming client
that disconnects sets its request's cancel flag, which stops ``generate`` at the next token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from shoal.errors import BusyError, ShoalError
from shoal.gateway.catalog import Catalog
from shoal.gateway.engine import Completion, Engine, GatewayError
from shoal.gateway.guards import LOOPBACK_HOSTS, HostGuard, JsonOnly
from shoal.gateway.metrics import GatewayCollector
from shoal.gateway.schemas import ChatRequest, CompletionRequest, parse
from shoal.gateway.swarm import SwarmWatcher, Watchers
from shoal.gateway.views import readiness, swarm_graph

log = logging.getLogger(__name__)

__all__ = ["GatewayCollector", "build_app"]  # GatewayCollector: re-exported from shoal.gateway.metrics


def _error_response(error: GatewayError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _translate(exc: BaseException) -> GatewayError:
    """What a failed generation means to the API client."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, BusyError):
        return GatewayError(
            503, f"the swarm has no room for this request now: {exc}", "server_error", code="swarm_busy"
        )
    if isinstance(exc, ShoalError):
        return GatewayError(
            503, f"the swarm cannot serve this request: {exc}", "server_error", code="swarm_unavailable"
        )
    if isinstance(exc, ValueError):
        return GatewayError(400, str(exc))
    log.exception("generation failed", exc_info=exc)
    return GatewayError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


def _extension(done: Completion) -> dict:
    """shoal's top-level extension of a response (empty: nothing to add, the body stays OpenAI's)."""
    return {"shoal": {"verification": dict(done.verification)}} if done.verification is not None else {}


def _usage(done: Completion) -> dict:
    usage = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
    if done.speculation is not None:  # shoal's extension: what speculative decoding did for this answer
        usage["speculation"] = dict(done.speculation)
    return usage


class Gateway:
    def __init__(
        self,
        catalog: Catalog | None,
        watchers: Watchers,
        api_key: str | None,
        max_concurrency: int,
        per_model: int | None = None,
    ):
        self.catalog = catalog
        self.watchers = watchers
        self.api_key = api_key
        # requests of one model in flight at once (None: no limit of its own; --max-concurrency queues the rest)
        self.per_model = per_model
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="shoal-generate")
        self.created = int(time.time())

    # ---- checks ----------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if not header or scheme.lower() != "bearer" or not key.strip():
            raise GatewayError(
                401,
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                code="missing_api_key",
            )
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise GatewayError(401, "Incorrect API key provided.", code="invalid_api_key")

    def authorize_ticket(self, request: Request) -> None:
        """``?ticket=`` has the gateway dial a peer its caller names: only for a caller with the API key."""
        if self.api_key is None:
            raise GatewayError(
                403,
                "?ticket= (another swarm) makes this gateway dial the peer it names, so it needs an API key: "
                "start the gateway with --api-key KEY (or $SHOAL_API_KEY) and send 'Authorization: Bearer KEY'",
                param="ticket",
                code="ticket_needs_api_key",
            )
        self.authorize(request)

    async def lease(self, name: str) -> Engine:
        """The engine of model ``name`` (loaded on first use), held until :meth:`release`: 404 for a
        model not served, 503 for one the swarms do not cover now (see :class:`Catalog`), 429 for one
        with :attr:`per_model` requests in flight already."""
        if self.catalog is None:
            raise GatewayError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        await self.catalog.check(name)
        return await asyncio.get_running_loop().run_in_executor(None, self.catalog.pool.acquire, name, self.per_model)

    def release(self, engine: Engine) -> None:
        self.catalog.pool.release(engine.model_id)

    async def models(self) -> list[dict]:
        if self.catalog is None:
            return []
        loaded = set(self.catalog.pool.loaded())
        return [
            {"id": name, "object": "model", "created": self.created, "owned_by": "shoal",
             "shoal": {"coverage": coverage.as_json() if coverage is not None else None, "loaded": name in loaded,
                       "in_flight": self.catalog.pool.in_flight(name)}}
            for name, coverage in (await self.catalog.served()).items()
        ]  # fmt: skip

    # ---- generation ------------------------------------------------------------------------------
    async def run(self, engine: Engine, request: Request, prompt: list[int], body) -> Completion:
        """A non-streamed generation; a client that went away cancels it."""
        cancel = threading.Event()
        loop = asyncio.get_running_loop()
        sampling = body.sampling(engine.budget(prompt, body.limit, _param(body)))
        future = loop.run_in_executor(self.pool, engine.complete, prompt, sampling, None, cancel)
        try:
            return await _watching(request, future, cancel)
        finally:
            cancel.set()  # also when this handler is cancelled

    async def stream(
        self, engine: Engine, request: Request, prompt: list[int], body, chunk, first: dict | None
    ) -> AsyncIterator[str]:
        """SSE events: ``chunk(delta_text, finish_reason)`` builds each payload (the first one carries
        ``first``); ends with ``data: [DONE]``. Waits for the first text (or the failure) before
        answering, so a request the swarm cannot serve gets its status code, not a broken stream.
        Leaving early (client gone) cancels the generation. The events release ``engine`` when they end."""
        sampling = body.sampling(engine.budget(prompt, body.limit, _param(body)))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        cancel = threading.Event()

        def on_text(delta: str) -> None:  # in the worker thread
            loop.call_soon_threadsafe(queue.put_nowait, delta)

        future = loop.run_in_executor(self.pool, engine.complete, prompt, sampling, on_text, cancel)
        future.add_done_callback(lambda _: queue.put_nowait(None))  # after every on_text of the run
        try:
            head = await _watching(request, asyncio.ensure_future(queue.get()), cancel)
        except BaseException:
            cancel.set()
            raise
        if head is None and future.exception() is not None:
            raise _translate(future.exception())

        def wrap(text: str) -> dict | str:
            return {"content": text} if first is not None else text

        async def events() -> AsyncIterator[str]:
            delta = head
            try:
                if first is not None:
                    yield _sse(chunk(first, None))
                while delta is not None:
                    yield _sse(chunk(wrap(delta), None))
                    delta = await queue.get()
                try:
                    done = future.result()
                except Exception as exc:  # failed mid-stream: the status line is sent already
                    yield _sse(_translate(exc).body())
                    return
                yield _sse({**chunk(wrap("") if first is None else {}, done.finish_reason), **_extension(done)})
                if body.include_usage:
                    yield _sse({**chunk(wrap("") if first is None else {}, None), "choices": [], "usage": _usage(done)})
                yield _sse("[DONE]")
            finally:
                cancel.set()  # the client went away (this generator was cancelled or closed): stop generate
                self.release(engine)

        return events()


async def _watching(request: Request, future: asyncio.Future, cancel: threading.Event):
    """``future``'s result; meanwhile, a client that disconnects sets ``cancel`` (checked every 0.25 s)."""
    while True:
        done, _ = await asyncio.wait({future}, timeout=0.25)
        if done:
            return future.result()
        if not cancel.is_set() and await request.is_disconnected():
            cancel.set()


def _param(body) -> str:
    return "messages" if isinstance(body, ChatRequest) else "prompt"


def build_app(
    served: Catalog | Engine | None,
    watchers: Watchers,
    api_key: str | None = None,
    max_concurrency: int = 16,
    *,
    max_concurrency_per_model: int | None = None,
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
    cors_origins: Sequence[str] = (),
) -> FastAPI:
    """The ASGI app of the models ``served`` (a catalog, or one engine); None serves only the dashboard.
    It answers only requests whose
    ``Host`` is one of ``allowed_hosts`` (``"*"``: any; see :func:`shoal.gateway.guards.allowed_hosts`)
    or an IP address, and lets pages of ``cors_origins`` (none by default) read its answers. A model
    with ``max_concurrency_per_model`` requests in flight (default None: no limit of its own, the
    ``max_concurrency`` threads queue the rest) answers 429 while the others still answer."""
    catalog = served if served is None or isinstance(served, Catalog) else Catalog.of_engine(served)
    gateway = Gateway(catalog, watchers, api_key, max_concurrency, max_concurrency_per_model)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if watchers.default is not None:
            watchers.get(None)  # the gateway's own swarm: its load history starts now
        yield
        gateway.pool.shutdown(wait=False, cancel_futures=True)
        await gateway.watchers.close()

    app = FastAPI(title="shoal gateway", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.gateway = gateway
    app.add_middleware(JsonOnly)  # innermost of the three: a configured origin can read its 415
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(HostGuard, hosts=allowed_hosts)  # outermost: nothing answers a foreign Host
    registry = CollectorRegistry(auto_describe=False)  # this app's own: apps in one process do not mix
    registry.register(GatewayCollector(catalog))

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        detail = f"{request.method} {request.url.path}: {exc.detail}"
        return _error_response(GatewayError(exc.status_code, detail, kind, None, code))

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        gateway.authorize(request)
        return {"object": "list", "data": await gateway.models()}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> dict:
        gateway.authorize(request)
        found = [m for m in await gateway.models() if m["id"] == name]
        if not found:
            raise GatewayError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return found[0]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        gateway.authorize(request)
        body = parse(await request.body(), ChatRequest)
        engine = await gateway.lease(body.model)
        return await _answering(gateway, engine, _chat(engine, request, body))

    async def _chat(engine: Engine, request: Request, body: ChatRequest) -> Response:
        prompt = engine.chat_prompt([m.as_template_input() for m in body.messages])
        ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(delta: dict, finish_reason: str | None) -> dict:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": engine.model_id,
                    "system_fingerprint": None, "choices": [choice]}  # fmt: skip

        if body.stream:
            events = await gateway.stream(engine, request, prompt, body, chunk, {"role": "assistant", "content": ""})
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        done = await _guarded(gateway.run(engine, request, prompt, body))
        message = {"role": "assistant", "content": done.text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": done.finish_reason}
        head = {"id": ident, "object": "chat.completion", "created": created, "model": engine.model_id}
        body = {**head, "system_fingerprint": None, "choices": [choice], "usage": _usage(done), **_extension(done)}
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        gateway.authorize(request)
        body = parse(await request.body(), CompletionRequest)
        engine = await gateway.lease(body.model)
        return await _answering(gateway, engine, _complete(engine, request, body))

    async def _complete(engine: Engine, request: Request, body: CompletionRequest) -> Response:
        prompt = engine.text_prompt(body.prompt_input)
        ident, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(text: str, finish_reason: str | None) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            return {"id": ident, "object": "text_completion", "created": created, "model": engine.model_id,
                    "choices": [choice]}  # fmt: skip

        if body.stream:
            events = await gateway.stream(engine, request, prompt, body, chunk, None)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        done = await _guarded(gateway.run(engine, request, prompt, body))
        return JSONResponse({**chunk(done.text, done.finish_reason), "usage": _usage(done), **_extension(done)})

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(files("shoal.gateway").joinpath("dashboard.html").read_text(encoding="utf-8"))

    def watcher_of(ticket: str | None, request: Request | None = None) -> SwarmWatcher:
        if ticket:  # empty: the gateway's own swarm, as without
            gateway.authorize_ticket(request)  # before the ticket is even parsed: nothing dialled
        try:
            return gateway.watchers.get(ticket)
        except ValueError as exc:
            raise GatewayError(400, str(exc), param="ticket") from None

    @app.get("/api/swarm")
    async def swarm(request: Request, ticket: str | None = None) -> JSONResponse:
        watcher = watcher_of(ticket, request)
        status = await watcher.status()
        default = gateway.watchers.default
        own = default is not None and watcher.table.swarm == default.swarm_id  # the swarm the engine uses
        routes = catalog.routes() if catalog is not None and own else []
        status["graph"] = swarm_graph(status, routes)
        served = list(await catalog.served()) if catalog is not None else []
        status["gateway_model"] = served[0] if len(served) == 1 else None  # the one model it serves
        status["gateway_models"] = await gateway.models()
        return JSONResponse(status, headers={"Cache-Control": "no-store"})

    @app.get("/api/swarm/history")
    async def swarm_history(request: Request, ticket: str | None = None, since: float | None = None) -> JSONResponse:
        history = await watcher_of(ticket, request).history(since)
        return JSONResponse(history, headers={"Cache-Control": "no-store"})

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"}, headers={"Cache-Control": "no-store"})

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        status = await watcher_of(None).status()
        served = list(await catalog.served()) if catalog is not None else []
        ready, body = readiness(status, served[0] if len(served) == 1 else None)
        return JSONResponse(body, status_code=200 if ready else 503, headers={"Cache-Control": "no-store"})

    return app


async def _answering(gateway: Gateway, engine: Engine, answer) -> Response:
    """``answer``'s response; ``engine``'s lease ends with it, or with its events when it streams."""
    streams = False
    try:
        response = await answer
        streams = isinstance(response, StreamingResponse)
        return response
    finally:
        if not streams:
            gateway.release(engine)


async def _guarded(coro):
    try:
        return await coro
    except GatewayError:
        raise
    except Exception as exc:
        raise _translate(exc) from None
