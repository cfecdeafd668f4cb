"""The gateway's catalog without a network: coverage merged over the joined swarms' statuses, where
a model's client part is loaded from, and what ``shoal api`` with no model hands the gateway."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.cli.main import build_parser
from shoal.gateway.catalog import Coverage, coverage_of, model_path
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
    assert model_path("alpha", [first, second]) == str(second / "alpha")
    assert model_path("smollm2", [first, second]) == "smollm2"  # a known model or Hub id, as named


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
