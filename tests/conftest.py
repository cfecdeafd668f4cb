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


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The fetched SmolLM2 checkpoint; a missing one FAILS the test (never skips)."""
    from shoal.checkpoints import fetch_model, is_fetched, model_cache_dir

    if not is_fetched("smollm2"):
        pytest.fail(
            f"SmolLM2 is not fetched (expected at {model_cache_dir('smollm2')}): run `shoal models fetch smollm2` "
            "once (it needs the network), then rerun the tests",
            pytrace=False,
        )
    return fetch_model("smollm2", progress=False)


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """The fetched Gemma-3-270M checkpoint; a missing one FAILS the test (never skips)."""
    from shoal.checkpoints import fetch_model, is_fetched, model_cache_dir

    if not is_fetched("gemma3"):
        pytest.fail(
            f"Gemma 3 is not fetched (expected at {model_cache_dir('gemma3')}): run `shoal models fetch gemma3` "
            "once (it needs the network), then rerun the tests",
            pytrace=False,
        )
    return fetch_model("gemma3", progress=False)
