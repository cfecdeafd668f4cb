"""A private swarm run with the real commands, as docs/swarm.md shows them: ``shoal swarm new
--private``, ``shoal swarm peer-id``, ``shoal swarm invite``, ``shoal serve --new-swarm
--member-cert``, ``shoal swarm status`` (a member reads the table; a stranger is told why not),
``shoal serve --join`` without a certificate (one line, before any weight loads),
``shoal swarm add-model`` and ``shoal swarm revoke``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shoal.launch import ServerProcess
from shoal.launch.process import serve_args
from shoal.swarm.swarmid import parse_swarm_id
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.cli.test_errors import RUNTIME, USAGE, assert_one_line_error, shoal
from tests.helpers.inprocess import wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("private-cli") / "tiny", "llama", tokenizer=char_tokenizer())


def peer_id(key: Path) -> str:
    done = shoal("swarm", "peer-id", "--identity", str(key))
    assert done.status == 0, done.stderr
    assert re.fullmatch(r"[0-9a-f]{64}\n", done.stdout)
    return done.stdout.strip()


def invite(owner: Path, key: Path, out: Path, *flags: str) -> Path:
    done = shoal("swarm", "invite", "--owner-key", str(owner), "--member", peer_id(key), "--out", str(out), *flags)
    assert done.status == 0, done.stderr
    assert out.read_text().startswith("shoalcert1")
    return out


def test_a_private_swarm_with_the_real_commands(tiny_dir: Path, tmp_path: Path):
    owner = tmp_path / "owner.key"
    made = shoal("swarm", "new", "--private", "--owner-key", str(owner))
    assert made.status == 0 and owner.is_file() and "owner: " in made.stdout, made
    assert_one_line_error(shoal("swarm", "new", "--private", "--owner-key", str(owner)), USAGE, "exists")
    server_key, reader_key = tmp_path / "server.key", tmp_path / "reader.key"
    server_cert = invite(owner, server_key, tmp_path / "server.cert", "--expires", "1d")
    reader_cert = invite(owner, reader_key, tmp_path / "reader.cert")
    server = ServerProcess(serve_args(tiny_dir, (0, 4), "--new-swarm", "--identity", str(server_key),
                                      "--member-cert", str(server_cert), "--gossip-period", "0.3"))  # fmt: skip
    try:
        ticket = server.wait_ready(120)
        swarm = parse_swarm_id(ticket.swarm_id)
        assert swarm.private and swarm.pin is not None
        member = ("--identity", str(reader_key), "--member-cert", str(reader_cert))
        status = shoal("swarm", "status", "--join", str(ticket), "--json", *member)
        assert status.status == 0 and '"tiny"' in status.stdout, status.stderr
        stranger = shoal("swarm", "status", "--join", str(ticket))
        assert_one_line_error(stranger, RUNTIME, "forbidden", "presented no certificate")
        intruder = shoal("serve", str(tiny_dir), "--join", str(ticket), "--host", "127.0.0.1")
        assert_one_line_error(intruder, USAGE, "cannot take part", "presented no certificate")
        other = tiny_checkpoint(tmp_path / "other", "llama", seed=3, tokenizer=char_tokenizer())
        added = shoal("swarm", "add-model", str(other), "--owner-key", str(owner), "--join", str(ticket))
        assert added.status == 0, added.stderr

        def both_models() -> bool:
            outcome = shoal("swarm", "status", "--join", str(ticket), "--json", *member)
            return outcome.status == 0 and '"other"' in outcome.stdout and '"tiny"' in outcome.stdout

        wait_until(both_models, 30.0, what="the added model in the table")
        revoked = shoal("swarm", "revoke", "--owner-key", str(owner), "--member", peer_id(reader_key),
                        "--join", str(ticket))  # fmt: skip
        assert revoked.status == 0, revoked.stderr

        def refused() -> bool:
            outcome = shoal("swarm", "status", "--join", str(ticket), *member)
            return outcome.status == RUNTIME and "revoked the membership" in outcome.stderr

        wait_until(refused, 30.0, what="the revoked reader refused")
    finally:
        server.stop()
