"""Every limit of :class:`shoal.limits.Limits` has its flag, and the flags make the limits a node runs with."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from shoal.cli.args import limits_of, transport_config
from shoal.cli.main import build_parser
from shoal.errors import UsageError
from shoal.limits import Limits, flag_of, limit_fields


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_serve_has_a_flag_for_every_limit_with_its_default():
    serve = subparser("serve")
    flags = {option: action for action in serve._actions for option in action.option_strings}
    for item in limit_fields():
        action = flags[flag_of(item.name)]
        assert action.default == item.default and action.help == item.metadata["help"]


def test_flags_become_the_transports_limits():
    argv = ["serve", "m", "--blocks", "0:1", "--max-streams-per-peer", "7", "--data-timeout", "2.5",
            "--max-forward-positions", "100", "--max-sessions-per-peer", "3"]  # fmt: skip
    args = build_parser().parse_args(argv)
    limits = transport_config(args, "127.0.0.1:0").limits
    assert limits == Limits(max_streams_per_peer=7, data_timeout=2.5, max_forward_positions=100,
                            max_sessions_per_peer=3)  # fmt: skip


def test_limits_that_cannot_work_together_are_a_usage_error():
    args = build_parser().parse_args(["serve", "m", "--blocks", "0:1", "--max-message-bytes", str(1 << 30)])
    with pytest.raises(UsageError, match=r"max_message_bytes .* must not exceed max_inflight_bytes_per_peer"):
        limits_of(args)
    with pytest.raises(UsageError, match="invalid positive integer value"):
        build_parser().parse_args(["serve", "m", "--max-streams-per-peer", "0"])


def test_a_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit max_tensors must be positive"):
        Limits(max_tensors=0)


def test_the_server_page_lists_every_limit_with_its_flag():
    page = (Path(__file__).parents[2] / "docs" / "server.md").read_text()
    missing = [flag_of(item.name) for item in limit_fields() if f"| `{flag_of(item.name)}` |" not in page]
    assert not missing, f"docs/server.md's table of limits lacks {missing}"


@pytest.mark.parametrize("command", ["api", "chat", "dashboard"])
def test_the_clients_endpoint_takes_the_node_limits(command):
    flags = {option for action in subparser(command)._actions for option in action.option_strings}
    assert {flag_of(item.name) for item in limit_fields("node")} <= flags
    assert not {flag_of(item.name) for item in limit_fields("server")} & flags
