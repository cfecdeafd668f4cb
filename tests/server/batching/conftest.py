"""The batching tests' span (a tiny random llama's) and fresh batching servers over it."""

from __future__ import annotations

import pytest

from shoal.checkpoints import load_span
from testkit.tiny import tiny_checkpoint
from tests.server.batching.bench import PLANS, Server, pages_for


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    span, _ = load_span(tiny_checkpoint(tmp_path_factory.mktemp("tiny-batching")), 0, 4)
    return span


@pytest.fixture
def server_factory(span):
    made: list[Server] = []

    def make(num_pages: int = pages_for(PLANS), **limits: int) -> Server:
        made.append(Server(span, num_pages, **limits))
        return made[-1]

    yield make
    for server in made:
        server.close()
