"""Session-wide guards (the run must be inside a loopback-only network namespace) and fixtures."""

from __future__ import annotations

import socket
from pathlib import Path

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


def fetched(name: str, label: str) -> Path:
    """The checkpoint ``shoal models fetch NAME`` converted; a missing one FAILS the test (never skips)."""
    from shoal.checkpoints import fetch_model, is_fetched, model_cache_dir

    if not is_fetched(name):
        pytest.fail(
            f"{label} is not fetched (expected at {model_cache_dir(name)}): run `shoal models fetch {name}` "
            "once (it needs the network), then rerun the tests",
            pytrace=False,
        )
    return fetch_model(name, progress=False)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The fetched SmolLM2 checkpoint."""
    return fetched("smollm2", "SmolLM2")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """The fetched Gemma-3-270M checkpoint."""
    return fetched("gemma3", "Gemma 3")
