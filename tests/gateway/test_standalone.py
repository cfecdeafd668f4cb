"""``shoal api`` and ``shoal chat`` over standalone servers: two ``shoal serve --blocks`` processes
started without ``--new-swarm`` or ``--join`` (each a swarm of none), whose tickets are given with
``--join`` twice. The gateway's and ``shoal chat``'s greedy answers equal plain transformers'; given
only the first ticket, ``shoal chat`` exits 1 with one line that names the missing blocks and how to add them. The
dashboard shows a swarm's table, so ``shoal dashboard`` refuses a ticket that names none.
"""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest

from shoal.cli.main import build_parser
from shoal.errors import UsageError
from shoal.gateway.serve import shown_swarm
from shoal.launch import LocalSwarm
from shoal.transport import Ticket
from tests.gateway.support import ENV, gateway, reference_answer
from tests.gateway.support import SPANS as CHAT_MODEL_SPANS

pytestmark = pytest.mark.timeout(180)

NUM_BLOCKS = CHAT_MODEL_SPANS[-1][1]
HALF = NUM_BLOCKS // 2
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NEW = 12
PLAIN = Ticket("0f" * 32, ("127.0.0.1:9",), None, None)  # a standalone server's: no swarm id
MEMBER = Ticket("1e" * 32, ("127.0.0.1:10",), None, "swarm-1")


@pytest.fixture(scope="module")
def standalone(chat_model):
    """Two standalone servers of the chat model: blocks [0, HALF) and [HALF, NUM_BLOCKS)."""
    spans = [(0, HALF), (HALF, NUM_BLOCKS)]
    with LocalSwarm(chat_model[0], spans, ["--num-threads", "1"], env=ENV, ready_timeout=120) as servers:
        yield servers


def test_api_with_two_standalone_tickets_answers_as_transformers(chat_model, standalone: LocalSwarm):
    model_dir, reference, tokenizer = chat_model
    first, second = standalone.tickets
    assert not first.swarm_id and not second.swarm_id
    expected, _ = reference_answer(reference, tokenizer, MESSAGES, NEW)
    with gateway(model_dir, first, "--join", str(second)) as api:
        client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=model_dir.name, messages=MESSAGES, temperature=0, max_tokens=NEW)
    assert reply.choices[0].message.content == expected


def test_chat_with_two_standalone_tickets_answers_as_transformers(chat_model, standalone: LocalSwarm):
    model_dir, reference, tokenizer = chat_model
    first, second = standalone.tickets
    expected, _ = reference_answer(reference, tokenizer, MESSAGES, NEW)
    args = [sys.executable, "-m", "shoal.cli.main", "chat", str(model_dir), "--join", str(first), "--join", str(second)]
    done = subprocess.run(
        [*args, "--bind", "127.0.0.1:0", "--num-threads", "1", "--max-new-tokens", str(NEW)],
        input=MESSAGES[0]["content"] + "\n",  # one turn, then end of input ends the chat
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ENV},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"assistant: {expected}\n"


def test_chat_missing_blocks_is_one_line_saying_how_to_add_them(chat_model, standalone: LocalSwarm):
    first = standalone.tickets[0]
    args = [sys.executable, "-m", "shoal.cli.main", "chat", str(chat_model[0]), "--join", str(first)]
    done = subprocess.run(
        [*args, "--bind", "127.0.0.1:0", "--num-threads", "1"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ENV},
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.splitlines() == [
        f"shoal: error: no server hosts blocks {HALF}-{NUM_BLOCKS - 1}: start one with "
        f"`shoal serve MODEL --blocks {HALF}:{NUM_BLOCKS}` and pass its ticket with another --join"
    ]


@pytest.mark.parametrize("command", ["api", "chat"])
def test_every_join_reaches_the_client(monkeypatch, command: str):
    import shoal.cli.chat as chat
    import shoal.gateway.serve as serve

    seen = []
    monkeypatch.setattr(serve, "serve_gateway", lambda options: seen.append(options) or 0)
    monkeypatch.setattr(chat, "run_chat", lambda options: seen.append(options) or 0)
    args = build_parser().parse_args([command, "m", "--join", str(PLAIN), "--join", str(MEMBER)])
    assert args.func(args) == 0
    assert seen[0].join == (PLAIN, MEMBER)


def test_the_dashboard_shows_the_first_swarm_among_the_tickets():
    assert shown_swarm((PLAIN, MEMBER)) == MEMBER
    assert shown_swarm((PLAIN,)) is None


def test_shoal_dashboard_refuses_a_ticket_that_names_no_swarm():
    args = build_parser().parse_args(["dashboard", "--join", str(PLAIN)])
    with pytest.raises(UsageError) as raised:
        args.func(args)
    assert str(raised.value) == (
        "this ticket names no swarm: it was printed by a server started without --new-swarm or --join; "
        "the dashboard shows a swarm's table: use the ticket of a swarm member"
    )
