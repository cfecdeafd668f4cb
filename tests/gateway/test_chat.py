"""``shoal chat`` typed into through a pipe: two turns, answers streamed back before the next turn is
typed, equal to plain transformers over the same conversation, and ONE session on every server
across both turns (server metrics)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest

from tests.gateway.support import ENV, reference_answer, total, wait_for

pytestmark = pytest.mark.timeout(180)

NEW = 10
TURNS = ["Hi! Who are you?", "Tell me more, please."]


class Reader:
    """Reads a child's stdout without blocking past a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.fd = proc.stdout.fileno()
        self.text = b""

    def until(self, size: int, timeout: float) -> str:
        """Read until ``size`` bytes arrived in all; everything read so far, decoded."""
        deadline = time.monotonic() + timeout
        while len(self.text) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"not {size} bytes within {timeout} s; got {self.text!r}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                chunk = os.read(self.fd, 4096)
                if not chunk:
                    raise AssertionError(f"chat ended early; got {self.text!r}")
                self.text += chunk
        return self.text.decode()


def test_chat_two_turns_in_one_session(chat_model, swarm):
    model_dir, reference, tokenizer = chat_model
    first, _ = reference_answer(reference, tokenizer, [{"role": "user", "content": TURNS[0]}], NEW)
    history = [
        {"role": "user", "content": TURNS[0]},
        {"role": "assistant", "content": first},
        {"role": "user", "content": TURNS[1]},
    ]
    second, _ = reference_answer(reference, tokenizer, history, NEW)
    before = [s.metrics() for s in swarm.servers]
    args = ["-m", "shoal.cli.main", "chat", str(model_dir), "--join", str(swarm.ticket), "--bind", "127.0.0.1:0"]
    args += ["--max-new-tokens", str(NEW), "--max-length", "512", "--num-threads", "1"]
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **ENV},
    )
    try:
        out = Reader(proc)
        proc.stdin.write(f"{TURNS[0]}\n".encode())
        proc.stdin.flush()
        expected = f"assistant: {first}\n"
        assert out.until(len(expected.encode()), 120) == expected  # (the chat stays open for the next turn)
        # the first answer's tokens came before the second turn was typed; its session is still open
        assert all(s.metrics()["shoal_sessions_active"] == 1 for s in swarm.servers)
        proc.stdin.write(f"{TURNS[1]}\n".encode())
        proc.stdin.close()  # end of input ends the chat after this turn
        expected += f"assistant: {second}\n"
        assert out.until(len(expected.encode()), 120) == expected
        assert proc.wait(60) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    after = [s.metrics() for s in swarm.servers]
    for b, a in zip(before, after, strict=True):
        assert a["shoal_sessions_opened_total"] - b["shoal_sessions_opened_total"] == 1
        assert a["shoal_steps_total"] - b["shoal_steps_total"] >= 2 * (NEW - 1)  # both turns ran in it
    wait_for(lambda: total(swarm, "shoal_sessions_active") == 0, 20, what="the chat's session closed")
