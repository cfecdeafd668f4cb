"""Per-model limits of the gateway without a network (``shoal api --max-concurrency-per-model``): a
model with its limit of requests in flight answers 429 (``model_busy``) while another model of the
same gateway still answers, and answers again once one of its requests ends."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from shoal.cli.main import build_parser
from shoal.gateway.app import Gateway
from shoal.gateway.catalog import Catalog
from shoal.gateway.engine import GatewayError
from shoal.transport import Ticket

pytestmark = pytest.mark.timeout(30)

TICKET = Ticket("1e" * 32, ("127.0.0.1:10",), None, "swarm-1")


class Watcher:
    """A swarm watcher whose one swarm covers ``alpha`` and ``beta`` (two blocks each)."""

    async def status(self) -> dict:
        servers = [{"peer": "p1", "state": "online"}]
        models = [{"name": name, "num_blocks": 2, "coverage": [1, 1], "servers": servers} for name in ("alpha", "beta")]
        return {"swarm": "swarm-1", "via": "p1", "models": models}

    def of(self, ticket: Ticket):
        return self


def engine_of(name: str, path: str, tickets) -> SimpleNamespace:
    """What the pool holds per model: the gateway's limits read only its name (no generation runs here)."""
    return SimpleNamespace(model_id=name, model=SimpleNamespace(close=lambda: None))


def test_a_model_at_its_limit_answers_429_while_another_still_answers():
    watcher = Watcher()
    catalog = Catalog((TICKET,), watcher, engine_of, lambda path: 1, 1 << 20, every=True)
    gateway = Gateway(catalog, watcher, None, max_concurrency=4, per_model=2)

    async def scenario() -> None:
        alpha = [await gateway.lease("alpha"), await gateway.lease("alpha")]
        with pytest.raises(GatewayError) as refused:
            await gateway.lease("alpha")
        error = refused.value
        assert (error.status, error.code, error.param) == (429, "model_busy", "model")
        assert "model alpha has 2 requests in flight" in error.message
        beta = await gateway.lease("beta")  # the other model still answers
        assert beta.model_id == "beta" and catalog.pool.in_flight("beta") == 1
        assert catalog.pool.in_flight("alpha") == 2  # the refused request holds nothing
        gateway.release(alpha.pop())
        alpha.append(await gateway.lease("alpha"))  # a slot of its own is free again
        for engine in (*alpha, beta):
            gateway.release(engine)
        assert catalog.pool.in_flight("alpha") == catalog.pool.in_flight("beta") == 0

    try:
        asyncio.run(scenario())
    finally:
        gateway.pool.shutdown(wait=False)


def test_without_a_per_model_limit_requests_queue_for_the_global_one():
    """By default a model has no limit of its own: a single-model gateway queues requests past
    ``--max-concurrency`` (its threads) as before, rather than answering 429."""
    watcher = Watcher()
    catalog = Catalog((TICKET,), watcher, engine_of, lambda path: 1, 1 << 20, every=True)
    gateway = Gateway(catalog, watcher, None, max_concurrency=3)
    gateway.pool.shutdown(wait=False)
    assert gateway.per_model is None


def test_api_takes_a_per_model_limit(monkeypatch):
    import shoal.gateway.serve as serve

    seen = []
    monkeypatch.setattr(serve, "serve_gateway", lambda options: seen.append(options) or 0)
    parser = build_parser()
    args = parser.parse_args(["api", "--join", str(TICKET), "--max-concurrency-per-model", "3"])
    assert args.func(args) == 0
    args = parser.parse_args(["api", "--join", str(TICKET)])
    assert args.func(args) == 0
    assert [(o.max_concurrency, o.max_concurrency_per_model) for o in seen] == [(16, 3), (16, None)]
