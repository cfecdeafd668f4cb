"""Start shoal processes for tests and read the ticket they print; always clean up."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from shoal.transport import Ticket


class PeerProcess:
    """A child process that prints ``ticket: ...`` when ready. Its stdin is kept open: closing it
    asks the child to exit; :meth:`kill` sends SIGKILL."""

    def __init__(self, args: Sequence[str], ready_timeout: float = 120.0, env: dict | None = None):
        self.args = list(args)
        self.proc = subprocess.Popen(
            [sys.executable, *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        self.output: list[str] = []
        self.ticket = self._wait_ready(ready_timeout)
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout: float) -> Ticket:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            if line.startswith("ticket: "):
                return Ticket.parse(line.split(" ", 1)[1])
        self.kill()
        raise RuntimeError(f"process {self.args} did not become ready:\n{''.join(self.output)[-4000:]}")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
