"""Common mistakes, made as a user makes them: through the ``shoal`` command in a child process.

Each ends with exactly one line on standard error, starting ``shoal: error:``, nothing on standard
output, no traceback, and exit status 2 (a usage error: the command asked for something that cannot
be) or 1 (a runtime failure: a port in use, a peer that does not answer, no route). ``-v`` adds the
traceback above that line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shoal.launch import LocalSwarm
from shoal.transport import Node, TransportConfig
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.aio import run

pytestmark = pytest.mark.timeout(120)

USAGE, RUNTIME = 2, 1


@dataclass(frozen=True)
class Outcome:
    status: int
    stdout: str
    stderr: str


def shoal(*args: str, timeout: float = 60.0) -> Outcome:
    """``shoal ARGS...`` as a user runs it (the installed entry point's code), stdin closed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", "from shoal.cli.main import main; main()", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return Outcome(done.returncode, done.stdout, done.stderr)


def assert_one_line_error(outcome: Outcome, status: int, *fragments: str) -> str:
    lines = outcome.stderr.splitlines()
    assert outcome.status == status, f"exit {outcome.status}, expected {status}; stderr: {outcome.stderr!r}"
    assert outcome.stdout == "", f"stdout should be empty: {outcome.stdout!r}"
    assert len(lines) == 1 and lines[0].startswith("shoal: error: "), f"not one error line: {outcome.stderr!r}"
    assert "Traceback" not in outcome.stderr
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A 4-block random llama checkpoint with a tokenizer."""
    return tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tiny", "llama", tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def unreadable_weights(tmp_path_factory, tiny_dir: Path) -> Path:
    """The tiny checkpoint with every weight file replaced by bytes no loader can read."""
    out = tmp_path_factory.mktemp("cli") / "unreadable"
    out.mkdir()
    for item in tiny_dir.iterdir():
        target = out / item.name
        if item.suffix == ".safetensors":
            target.write_bytes(b"\xff" * 64)
            target.chmod(0)
        else:
            target.write_bytes(item.read_bytes())
    return out


@pytest.fixture(scope="module")
def dead_ticket() -> str:
    """The ticket of a swarm member that has stopped: well formed, nobody answers."""

    async def start_and_stop() -> str:
        node = await Node.start(TransportConfig(bind_addr="127.0.0.1:0"))
        ticket = node.ticket("ab" * 16)
        await node.close()
        return str(ticket)

    return run(start_and_stop())


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port held by a TCP listener and a UDP socket at once."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        udp.bind(("127.0.0.1", port))
    except OSError:
        tcp.close()
        pytest.fail(f"UDP port {port} is taken too: cannot build the fixture")
    try:
        yield port
    finally:
        tcp.close()
        udp.close()


# --- shoal serve -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_blocks_outside_the_model(smollm2_dir):
    assert_one_line_error(shoal("serve", "smollm2", "--blocks", "40:50"), USAGE, "--blocks 40:50", "30 blocks")


@pytest.mark.slow
def test_blocks_outside_the_model_are_refused_before_any_weight_is_read(unreadable_weights: Path):
    outcome = shoal("serve", str(unreadable_weights), "--blocks", "2:9")
    assert_one_line_error(outcome, USAGE, "--blocks 2:9 is outside the model's 4 blocks")


def test_unknown_model_with_blocks():
    line = assert_one_line_error(shoal("serve", "nonexistent-model", "--blocks", "0:2"), USAGE, "nonexistent-model")
    assert "shoal models list" in line


def test_unknown_model_without_blocks_names_the_model_not_the_flag():
    line = assert_one_line_error(shoal("serve", "nonexistent-model"), USAGE, "unknown model 'nonexistent-model'")
    assert "--blocks" not in line


def test_directory_that_is_no_model(tmp_path: Path):
    assert_one_line_error(shoal("serve", str(tmp_path), "--blocks", "0:1"), USAGE, "has no config.json")


def test_reversed_blocks(tiny_dir: Path):
    assert_one_line_error(shoal("serve", str(tiny_dir), "--blocks", "3:1"), USAGE, "--blocks 3:1")


def test_blocks_required_outside_a_swarm(tiny_dir: Path):
    assert_one_line_error(shoal("serve", str(tiny_dir)), USAGE, "--blocks START:END is required outside a swarm")


def test_a_server_without_a_model_needs_a_swarm_to_choose_in():
    assert_one_line_error(shoal("serve"), USAGE, "a server without a model chooses one in the swarms it joins")
    assert_one_line_error(shoal("serve", "--new-swarm"), USAGE, "give --join TICKET")


# the cases that get past argument parsing import torch (seconds each): in the slow step
@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        pytest.param(["--port", "abc"], "argument --port: invalid port", id="port-text"),
        pytest.param(["--port", "70000"], "argument --port: invalid port", id="port-range"),
        pytest.param(
            ["--cache-tokens", "0"], "argument --cache-tokens: invalid positive integer value: '0'", id="cache-tokens"
        ),
        pytest.param(["--bogus"], "unrecognized arguments: --bogus", id="unknown-flag"),
        *(
            pytest.param(*case, id=name, marks=pytest.mark.slow)
            for name, case in [
                ("dtype", (["--dtype", "int3"], "unknown dtype 'int3'")),
                ("adapter-a", (["--adapter", "tuned"], "--adapter takes NAME=PATH, got 'tuned'")),
                ("adapter-b", (["--adapter", "my/lora=."], "--adapter my/lora=.: NAME must be 1-64 letters, digits")),
                ("adapter-c", (["--adapter", "tuned=/no/such/adapter"], "no adapter at /no/such/adapter")),
                (
                    "adapter-d",
                    (["--adapter", "tuned=.", "--quant", "int8"], "LoRA adapters on quantised servers"),
                ),
                ("packed-quantised", (["--packed-weights", "--quant", "int8"], "--packed-weights is for fp32 weights")),
                ("merge-wait", (["--merge-wait", "9"], "--merge-wait must be in [0, 4], got 9")),
            ]
        ),
    ],
)
def test_bad_flag_values(tiny_dir: Path, flags: list[str], fragment: str):
    assert_one_line_error(shoal("serve", str(tiny_dir), "--blocks", "0:2", *flags), USAGE, fragment)


@pytest.mark.slow
def test_udp_port_in_use(tiny_dir: Path, busy_port: int):
    outcome = shoal("serve", str(tiny_dir), "--blocks", "0:2", "--host", "127.0.0.1", "--port", str(busy_port))
    assert_one_line_error(outcome, RUNTIME, f"cannot listen on 127.0.0.1:{busy_port}", "--port")


@pytest.mark.slow
def test_serve_joining_through_a_peer_that_is_gone(tiny_dir: Path, dead_ticket: str):
    """A stale ticket must not leave the server serving alone, unseen: with the default 5 s connect
    deadline it exits within 15 s, before transformers or a weight loads (the check dials from a
    throwaway endpoint that closes without lingering: 9-11 s here while the test suite ran beside it)."""
    started = time.monotonic()
    flags = ["--blocks", "0:2", "--host", "127.0.0.1", "--join", dead_ticket]
    outcome = shoal("serve", str(tiny_dir), *flags)
    assert time.monotonic() - started < 15.0
    line = assert_one_line_error(outcome, RUNTIME)
    assert line == (
        "shoal: error: cannot join the swarm: the --join peer did not answer within 5 s (is it running, and is "
        "the ticket current? To start anyway, alone until a peer answers: --join-anyway)"
    )


def test_malformed_join_ticket_of_serve(tiny_dir: Path):
    assert_one_line_error(shoal("serve", str(tiny_dir), "--join", "garbage"), USAGE, "malformed ticket")


# --- shoal api / chat / swarm status / models ---------------------------------------------------------


def test_api_malformed_ticket():
    assert_one_line_error(shoal("api", "smollm2", "--join", "garbage"), USAGE, "malformed ticket")


def test_swarm_status_malformed_ticket():
    assert_one_line_error(shoal("swarm", "status", "--join", "garbage"), USAGE, "malformed ticket")


@pytest.mark.slow
def test_api_unknown_model(dead_ticket: str):
    assert_one_line_error(shoal("api", "llama", "--join", dead_ticket), USAGE, "unknown model 'llama'")


@pytest.mark.slow
def test_chat_unknown_model(dead_ticket: str):
    assert_one_line_error(shoal("chat", "llama", "--join", dead_ticket), USAGE, "unknown model 'llama'")


@pytest.mark.slow
def test_api_port_in_use(tiny_dir: Path, dead_ticket: str, busy_port: int):
    outcome = shoal("api", str(tiny_dir), "--join", dead_ticket, "--port", str(busy_port))
    assert_one_line_error(outcome, RUNTIME, f"cannot listen on 127.0.0.1:{busy_port}", "--port")


@pytest.mark.slow
def test_swarm_status_of_a_peer_that_is_gone(dead_ticket: str):
    outcome = shoal("swarm", "status", "--join", dead_ticket, "--connect-timeout", "1", "--request-timeout", "2")
    assert_one_line_error(outcome, RUNTIME, "cannot reach the peer")


def test_fetch_unknown_model():
    assert_one_line_error(shoal("models", "fetch", "nope"), USAGE, "unknown model 'nope'", "smollm2")


def test_missing_subcommand():
    assert_one_line_error(shoal("models"), USAGE, "shoal models")


@pytest.mark.slow
def test_no_route(tiny_dir: Path):
    """A swarm that holds only blocks 0:2 of 4 cannot serve the model: the client says which blocks."""
    with LocalSwarm(tiny_dir, [(0, 2)], ["--num-threads", "1"], swarm=True) as swarm:
        outcome = shoal("chat", str(tiny_dir), "--join", str(swarm.tickets[0]), "--connect-timeout", "5")
    line = assert_one_line_error(outcome, RUNTIME)
    assert line == (
        "shoal: error: no server hosts blocks 2-3: start one with `shoal serve MODEL --blocks 2:4 --join TICKET`, "
        "or pass the ticket of a server hosting them with another --join"
    )


def test_verbose_adds_the_traceback():
    outcome = shoal("serve", "nonexistent-model", "--blocks", "0:2", "-v")
    assert outcome.status == USAGE and outcome.stdout == ""
    assert "Traceback (most recent call last)" in outcome.stderr
    assert outcome.stderr.splitlines()[-1].startswith("shoal: error: unknown model 'nonexistent-model'")


# --- speculative decoding: --draft, --prompt-lookup ----------------------------------------------------


@pytest.mark.slow
def test_api_unknown_draft_model(smollm2_dir, dead_ticket: str):
    outcome = shoal("api", "smollm2", "--draft", "nonexistent-model", "--join", dead_ticket)
    assert_one_line_error(outcome, USAGE, "--draft: unknown model 'nonexistent-model'", "shoal models list")


@pytest.mark.slow
def test_chat_unknown_draft_model(tiny_dir: Path, dead_ticket: str):
    outcome = shoal("chat", str(tiny_dir), "--draft", "nonexistent-model", "--join", dead_ticket)
    assert_one_line_error(outcome, USAGE, "--draft: unknown model 'nonexistent-model'")


@pytest.mark.slow
def test_demo_unknown_draft_model():
    assert_one_line_error(shoal("demo", "--draft", "nonexistent-model"), USAGE, "--draft: unknown model")


@pytest.mark.parametrize("command", ["api", "chat", "demo"])
@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--draft", "x", "--prompt-lookup", "3"], "argument --prompt-lookup: not allowed with argument --draft"),
        (["--prompt-lookup", "0"], "argument --prompt-lookup: invalid positive integer value: '0'"),
    ],
    ids=["both", "lookup-0"],
)
def test_bad_speculation_flags(command: str, flags: list[str], fragment: str, dead_ticket: str):
    model = [] if command == "demo" else ["smollm2", "--join", dead_ticket]
    assert_one_line_error(shoal(command, *model, *flags), USAGE, fragment)
