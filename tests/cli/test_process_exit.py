"""A user's script that used the client ends as Python scripts do: status 0, nothing on stderr.

iroh's binding crashes a process whose coroutines are still suspended in it when the interpreter
tears down (status 139, or 132 after an error): :mod:`shoal.client.runtime` closes every model's
node and tasks first. Each script runs in a fresh interpreter, as a user's would, against
``shoal serve`` processes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shoal.launch import LocalSwarm
from testkit.tiny import char_tokenizer, tiny_checkpoint

PROMPT = [[5, 6, 7]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("exit") / "tiny", "llama", tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def swarm(tiny_dir: Path):
    with LocalSwarm(tiny_dir, [(0, 2), (2, 4)], ["--num-threads", "1"]) as servers:
        yield servers


def user_script(body: str, tmp_path: Path, tiny_dir: Path, tickets: list, *args: str) -> subprocess.CompletedProcess:
    """Run ``body`` after a header that imports the client and defines MODEL, TICKETS and PROMPT."""
    script = tmp_path / "user.py"
    script.write_text(HEADER + textwrap.dedent(body))
    argv = [sys.executable, str(script), str(tiny_dir), ",".join(map(str, tickets)), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)


HEADER = f"""\
import sys
import torch
from shoal.client import AutoDistributedModelForCausalLM
MODEL, TICKETS = sys.argv[1], sys.argv[2].split(",")
PROMPT = torch.tensor({PROMPT!r})
"""


def test_a_script_that_generates_and_never_closes_exits_cleanly(swarm: LocalSwarm, tiny_dir: Path, tmp_path: Path):
    done = user_script(
        """
        model = AutoDistributedModelForCausalLM.from_pretrained(MODEL, TICKETS)
        print(model.generate(PROMPT, max_new_tokens=4)[0, 3:].tolist())
        """,
        tmp_path, tiny_dir, swarm.tickets,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    assert len(eval(done.stdout)) == 4


def test_close_and_the_context_manager_end_the_model(swarm: LocalSwarm, tiny_dir: Path, tmp_path: Path):
    done = user_script(
        """
        with AutoDistributedModelForCausalLM.from_pretrained(MODEL, TICKETS) as model:
            first = model.generate(PROMPT, max_new_tokens=4)[0, 3:].tolist()
        assert model.blocks.closed
        model.close()  # idempotent
        other = AutoDistributedModelForCausalLM.from_pretrained(MODEL, TICKETS)
        assert other.generate(PROMPT, max_new_tokens=4)[0, 3:].tolist() == first
        other.close()
        print("ok")
        """,
        tmp_path, tiny_dir, swarm.tickets,
    )  # fmt: skip
    assert (done.returncode, done.stderr, done.stdout.strip()) == (0, "", "ok")


@pytest.mark.slow
def test_two_models_one_after_the_other_exit_cleanly(swarm: LocalSwarm, tiny_dir: Path, tmp_path: Path):
    """The first model, dropped without close, stops its background refresh once collected."""
    done = user_script(
        """
        import gc
        model = AutoDistributedModelForCausalLM.from_pretrained(MODEL, TICKETS, refresh_period=0.2)
        first = model.generate(PROMPT, max_new_tokens=4)
        node = model.blocks.node
        del model
        gc.collect()
        import time
        for _ in range(100):
            if node.closed:
                break
            time.sleep(0.05)
        assert node.closed, "a collected model's node stays open"
        model = AutoDistributedModelForCausalLM.from_pretrained(MODEL, TICKETS, refresh_period=0.2)
        assert model.generate(PROMPT, max_new_tokens=4).tolist() == first.tolist()
        print("ok")
        """,
        tmp_path, tiny_dir, swarm.tickets,
    )  # fmt: skip
    assert (done.returncode, done.stderr, done.stdout.strip()) == (0, "", "ok")


@pytest.mark.slow
def test_a_script_whose_servers_are_gone_exits_cleanly(tiny_dir: Path, tmp_path: Path):
    """Servers up, generate, servers SIGKILLed, generate again: the script catches the error and
    exits 0 with nothing on stderr. A script that does not catch it ends with its traceback and
    status 1 (this one on the dead tickets at connect), never 132 or 139."""
    caught = """
        import os, signal
        from shoal.errors import ShoalError
        model = AutoDistributedModelForCausalLM.from_pretrained(MODEL, TICKETS, refresh_period=0.5)
        model.generate(PROMPT, max_new_tokens=2)
        for pid in sys.argv[3:]:
            os.kill(int(pid), signal.SIGKILL)
        try:
            model.generate(PROMPT, max_new_tokens=2)
        except ShoalError as exc:
            print(type(exc).__name__)
        """
    with LocalSwarm(tiny_dir, [(0, 2), (2, 4)], ["--num-threads", "1"]) as servers:
        tickets, pids = servers.tickets, [str(s.pid) for s in servers.servers]
        done = user_script(caught, tmp_path, tiny_dir, tickets, *pids)
    assert (done.returncode, done.stderr, done.stdout.strip()) == (0, "", "NoRouteError")
    uncaught = "AutoDistributedModelForCausalLM.from_pretrained(MODEL, TICKETS)\n"
    done = user_script(uncaught, tmp_path, tiny_dir, tickets)
    assert done.returncode == 1, done.stderr
    assert done.stderr.rstrip().splitlines()[-1].startswith("shoal.routing.chain.NoRouteError")
