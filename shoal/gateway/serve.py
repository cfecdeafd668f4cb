"""``shoal api`` and ``shoal dashboard``: build the app once, bind, serve with uvicorn until stopped.

The client model is created once at startup (its routing and sessions live on the client's loop
thread); uvicorn runs the HTTP side on its own loop in the main thread.
"""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.client.config import ClientConfig
from shoal.errors import BindError, ModelNotFoundError
from shoal.gateway.pool import DEFAULT_CLIENT_MEMORY
from shoal.transport import Ticket

if TYPE_CHECKING:
    from shoal.gateway.catalog import Catalog
    from shoal.gateway.engine import Engine, Speculation

log = logging.getLogger(__name__)

__all__ = ["GatewayOptions", "build_catalog", "check_draft", "load_speculation", "serve_gateway", "shown_swarm"]


@dataclass(frozen=True)
class GatewayOptions:
    # tickets of swarm members and standalone servers, routed over together (the dashboard shows the
    # swarm of the first that names one: shown_swarm)
    join: tuple[Ticket, ...]
    model: str | None = None  # None: no model named (``every_model``: each the swarms list; else only the dashboard)
    every_model: bool = False  # with no ``model``: serve every model the joined swarms list (shoal api --join T)
    models_dirs: tuple[Path, ...] = ()  # where a model the swarms list is loaded from: DIR/NAME (else known or Hub)
    client_memory: int = DEFAULT_CLIENT_MEMORY  # bytes of models' client parts held at once (LRU eviction)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the printed URL names it)
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1 when set
    # the client's settings (its transport is the dashboard's too): connection, codec, verification
    client: ClientConfig = field(default_factory=ClientConfig)
    max_concurrency: int = 16  # generations running at once (each holds one server-side session)
    max_concurrency_per_model: int | None = None  # requests in flight per model (None: none of its own); 429 past it
    default_max_tokens: int = 512
    num_threads: int | None = None  # torch threads (embeddings, LM head, sampling)
    draft: str | None = None  # speculative decoding with this local draft model (a model name, as ``model``)
    prompt_lookup: int | None = None  # ... or with up to this many tokens per round looked up in the prompt
    # Host names answered besides loopback's, the bound address and this machine's name; ("*",): any
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # origins whose pages may read the answers (CORS); none by default


def check_draft(name: str, *, weights: bool = False) -> Path:
    """The local directory of draft model ``name`` (a directory, known model or Hub id, as
    ``--draft`` gave it). Without ``weights`` only metadata is fetched from the Hub: cheap, so a
    wrong name is reported before anything loads."""
    from shoal.checkpoints import resolve_model

    try:
        return resolve_model(name, metadata_only=not weights)
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(f"--draft: {exc}") from None


def load_speculation(draft: str | None, prompt_lookup: int | None, target_tokenizer) -> Speculation | None:
    """What ``--draft`` / ``--prompt-lookup`` ask for (None: neither), the draft model loaded."""
    from shoal.gateway.engine import Speculation, load_draft

    if draft is not None:
        return load_draft(check_draft(draft, weights=True), target_tokenizer)
    if prompt_lookup is not None:
        return Speculation(prompt_lookup=prompt_lookup)
    return None


def shown_swarm(tickets: tuple[Ticket, ...]) -> Ticket | None:
    """The ticket whose swarm the dashboard shows: the first that names a swarm (None: standalone
    servers only, no table to show; the dashboard shows a swarm its ``?ticket=`` names)."""
    return next((t for t in tickets if t.swarm_id), None)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port is reported at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise BindError(address, exc.strerror or str(exc)) from exc
    sock.set_inheritable(True)
    return sock


def _engine_maker(options: GatewayOptions):
    """How the gateway makes the engine of a model: its client (over the tickets given) and speculation."""

    def make(name: str, path: str, tickets: tuple[Ticket, ...]) -> Engine:
        from shoal.client import AutoDistributedModelForCausalLM
        from shoal.gateway.engine import Engine

        model = AutoDistributedModelForCausalLM.from_client_config(path, tickets, options.client)
        try:
            speculation = load_speculation(options.draft, options.prompt_lookup, model.tokenizer)
            return Engine(model, name, options.default_max_tokens, speculation)
        except BaseException:
            model.close()
            raise

    return make


def _client_sizer(options: GatewayOptions) -> Callable[[str], int]:
    """How the gateway learns the bytes of a model's client part, from its config (see
    :func:`shoal.gateway.pool.client_bytes`): a model with no files here is fetched from the joined
    swarms' members first (:func:`shoal.client.auto.fetch_client_part`), as its client would be."""

    def size(path: str) -> int:
        from shoal.checkpoints import load_config, resolve_model
        from shoal.client.auto import fetch_client_part
        from shoal.gateway.pool import client_bytes
        from shoal.weights.join import fetches_from_swarm

        if options.join and fetches_from_swarm(path):
            fetch_client_part(path, options.join, options.client)
        return client_bytes(load_config(resolve_model(path, metadata_only=True)))

    return size


def build_catalog(options: GatewayOptions, watchers) -> Catalog | None:
    """The models ``options`` serve (None: only the dashboard); a named model is loaded now, so a
    broken one fails the start."""
    from shoal.checkpoints import model_name
    from shoal.gateway.catalog import Catalog

    if options.model is None and not options.every_model:
        return None
    named = {model_name(options.model): options.model} if options.model is not None else None
    catalog = Catalog(options.join, watchers, _engine_maker(options), _client_sizer(options), options.client_memory,
                      named=named, every=options.every_model, models_dirs=options.models_dirs)  # fmt: skip
    if options.model is not None:
        with catalog.pool.lease(model_name(options.model)):
            pass
    return catalog


def serve_gateway(options: GatewayOptions) -> int:
    import uvicorn

    from shoal.checkpoints import model_name
    from shoal.gateway.app import build_app
    from shoal.gateway.guards import allowed_hosts
    from shoal.gateway.swarm import Watchers
    from shoal.heap import freeze_startup_heap
    from shoal.weights.join import fetches_from_swarm

    if options.model is not None and not (options.join and fetches_from_swarm(options.model)):
        from shoal.checkpoints.check import check_model

        check_model(options.model)  # an unknown model or family: before the port is taken (else: at its fetch)
    if options.draft is not None:
        check_draft(options.draft)
    sock = _bind(options.host, options.port)
    catalog = None
    try:
        if options.num_threads:
            import torch

            torch.set_num_threads(options.num_threads)
        member = (options.client.identity, options.client.member_cert)
        watchers = Watchers(options.client.transport, shown_swarm(options.join), member=member)
        catalog = build_catalog(options, watchers)
        app = build_app(
            catalog,
            watchers,
            options.api_key,
            options.max_concurrency,
            max_concurrency_per_model=options.max_concurrency_per_model,
            allowed_hosts=allowed_hosts(options.host, options.allowed_hosts),
            cors_origins=options.cors_origins,
        )
        freeze_startup_heap()  # a long-lived process, after its heavy imports, before it says it is ready
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        if catalog is not None:
            shown = model_name(options.model) if options.model is not None else "every model the swarms list"
            print(f"model: {shown}", flush=True)
            print(f"api: {url}/v1", flush=True)
        print(f"dashboard: {url}/dashboard", flush=True)
        print(f"gateway: {url}", flush=True)  # last: the gateway is ready (the socket is listening)
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        if catalog is not None:
            try:
                catalog.pool.close()
            except Exception as exc:  # closing at exit: nothing left to do about it
                print(f"shoal: closing the client failed: {exc}", file=sys.stderr)
    return 0
