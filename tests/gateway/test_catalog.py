"""The gateway's catalog without a network: coverage merged over the joined swarms' statuses, where
a model's client part is loaded from, and what ``shoal api`` with no model hands the gateway."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import shoal.gateway.catalog as catalog_module
from shoal.checkpoints import model_source
from shoal.cli.main import build_parser
from shoal.gateway.catalog import Catalog, Coverage, coverage_of
from shoal.gateway.engine import GatewayError
from shoal.transport import Ticket

TICKET = Ticket("1e" * 32, ("127.0.0.1:10",), None, "swarm-1")


def server(peer: str, state: str = "online") -> dict:
    return {"peer": peer, "state": state}


def status(swarm: str, models: list[dict], via: str | None = "p") -> dict:
    return {"swarm": swarm, "via": via, "models": models}


def model(name: str, coverage: list[int], servers: list[dict]) -> dict:
    return {"name": name, "num_blocks": len(coverage), "coverage": coverage, "servers": servers}


def test_coverage_is_merged_over_the_swarms_that_list_a_model():
    one = status("s1", [model("alpha", [1, 1, 0, 0], [server("a1"), server("a0", "offline")]),
                        model("beta", [1, 1], [server("b1")])])  # fmt: skip
    two = status("s2", [model("alpha", [0, 0, 1, 1], [server("a2")])])
    found = coverage_of([one, two])
    assert found == {
        "alpha": Coverage("alpha", 4, (), 2, ("s1", "s2"), frozenset({"a1", "a2"})),
        "beta": Coverage("beta", 2, (), 1, ("s1",), frozenset({"b1"})),
    }
    alone = coverage_of([one])["alpha"]
    assert (alone.covered, alone.uncovered) == (False, (2, 3))
    assert alone.as_json() == {"num_blocks": 4, "covered": False, "uncovered": [2, 3], "servers_online": 1,
                               "swarms": ["s1"]}  # fmt: skip


def test_a_swarm_no_member_answered_for_lists_nothing():
    assert coverage_of([status("s1", [model("alpha", [1], [server("a1")])], via=None)]) == {}


def test_a_swarm_listing_another_shape_of_a_model_is_left_out():
    one = status("s1", [model("alpha", [1, 1], [server("a1")])])
    two = status("s2", [model("alpha", [1, 1, 1], [server("a2")])])
    assert coverage_of([one, two])["alpha"].swarms == ("s1",)


def test_a_model_loads_from_the_first_models_dir_that_has_it(tmp_path: Path):
    first, second = tmp_path / "first", tmp_path / "second"
    (second / "alpha").mkdir(parents=True)
    (second / "alpha" / "config.json").write_text("{}")
    (first / "alpha").mkdir(parents=True)  # no config.json: not a checkpoint
    assert model_source("alpha", [first, second]) == str(second / "alpha")
    assert model_source("smollm2", [first, second]) == "smollm2"  # a known model or Hub id, as named


def test_api_with_no_model_serves_every_model(monkeypatch):
    import shoal.gateway.serve as serve

    seen = []
    monkeypatch.setattr(serve, "serve_gateway", lambda options: seen.append(options) or 0)
    parser = build_parser()
    args = parser.parse_args(["api", "--join", str(TICKET), "--models-dir", "/m", "--client-memory", "512MiB"])
    assert args.func(args) == 0
    assert (seen[0].model, seen[0].every_model, seen[0].models_dirs) == (None, True, (Path("/m"),))
    assert seen[0].client_memory == 512 << 20
    args = parser.parse_args(["api", "smollm2", "--join", str(TICKET)])
    assert args.func(args) == 0
    assert (seen[1].model, seen[1].every_model, seen[1].client_memory) == ("smollm2", False, 8 << 30)


@pytest.mark.parametrize("size", ["0", "lots", "-1GiB"])
def test_a_client_memory_that_is_no_size_is_a_usage_error(size: str):
    from shoal.errors import UsageError

    with pytest.raises(UsageError):
        build_parser().parse_args(["api", "--join", str(TICKET), "--client-memory", size])


class Watcher:
    """A swarm watcher whose status is ``status``, answered after ``delay`` seconds."""

    def __init__(self, status: dict):
        self.status_now, self.delay = status, 0.0

    async def status(self) -> dict:
        await asyncio.sleep(self.delay)
        return self.status_now

    def of(self, ticket: Ticket):
        return self


def test_a_slow_swarm_pull_answers_with_the_last_look(monkeypatch):
    """A request waits ``COVERAGE_WAIT`` for the swarms' tables at most, then goes by the last look;
    the pull goes on, and a later request sees what it found."""
    monkeypatch.setattr(catalog_module, "COVERAGE_WAIT", 0.2)
    covered = status("swarm-1", [model("alpha", [1, 1], [server("a1")])])
    uncovered = status("swarm-1", [model("alpha", [1, 0], [server("a1")])])
    watcher = Watcher(covered)
    catalog = Catalog((TICKET,), watcher, lambda *a: None, lambda path: 1, 1, every=True)

    async def scenario() -> None:
        assert (await catalog.served())["alpha"].covered
        watcher.status_now, watcher.delay = uncovered, 0.5
        started = time.monotonic()
        assert (await catalog.served())["alpha"].covered  # the last look: the pull is still going
        assert time.monotonic() - started < 0.45
        await asyncio.sleep(0.5)
        with pytest.raises(GatewayError) as refused:
            await catalog.check("alpha")
        assert (refused.value.status, refused.value.code) == (503, "model_unavailable")
        with pytest.raises(GatewayError) as unknown:
            await catalog.check("beta")
        assert (unknown.value.status, unknown.value.code) == (404, "model_not_found")

    asyncio.run(scenario())


def test_blocks_the_gateway_serves_itself_count_before_the_swarm_lists_them():
    """``--serve-blocks 0:1``: the gateway's own span is up while its engine is loaded, so a table that
    does not list it yet answers no 503 for those blocks (and still does for blocks nobody hosts)."""
    from types import SimpleNamespace

    from shoal.ids import BlockRange

    running = SimpleNamespace(done=lambda: False)
    blocks = SimpleNamespace(
        hosted=SimpleNamespace(task=running), config=SimpleNamespace(local_blocks=BlockRange(0, 1))
    )
    engine = SimpleNamespace(model=SimpleNamespace(blocks=blocks))
    watcher = Watcher(status("swarm-1", [model("alpha", [0, 1], [server("a1")])]))
    catalog = Catalog((TICKET,), watcher, lambda *a: engine, lambda path: 1, 1, named={"alpha": "alpha"})

    async def scenario() -> None:
        with catalog.pool.lease("alpha"):
            await catalog.check("alpha")  # block 0 is this process's own
            watcher.status_now = status("swarm-1", [model("alpha", [0, 0], [server("a1")])])
            await asyncio.sleep(0.6)  # the next pull
            with pytest.raises(GatewayError) as refused:
                await catalog.check("alpha")
            assert refused.value.status == 503 and "blocks 1 " in str(refused.value)

    asyncio.run(scenario())
