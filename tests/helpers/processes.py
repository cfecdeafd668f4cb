"""Child processes for tests: :class:`shoal.launch.ServerProcess` with one OpenMP thread."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.launch import ServerProcess


class PeerProcess(ServerProcess):
    """A child ``python ARGS...`` that prints ``ticket: ...`` when ready; ``stop()`` sends
    SIGTERM (once), ``kill()`` SIGKILL."""

    def __init__(self, args: Sequence[str], ready_timeout: float = 120.0, env: dict | None = None):
        super().__init__(args, ready_timeout, {"OMP_NUM_THREADS": "1", **(env or {})})
