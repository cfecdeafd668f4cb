"""Session-wide guards: the run must be inside a loopback-only network namespace."""

from __future__ import annotations

import socket

import pytest
import torch


def pytest_sessionstart(session: pytest.Session) -> None:
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:
        pytest.exit(
            f"tests must run inside a loopback-only network namespace (found interfaces {names}); use scripts/test",
            returncode=3,
        )
    torch.set_num_threads(1)
