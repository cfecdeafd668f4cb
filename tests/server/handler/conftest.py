"""The handler tests' servers: fresh real servers of a tiny random llama for each test
(:func:`serve`), and the local blocks a correct server matches (:func:`spans`)."""

from __future__ import annotations

import pytest

from shoal.checkpoints import load_span
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from testkit.tiny import tiny_checkpoint
from tests.server.handler.bench import CACHE_TOKENS, PER_PEER, SPAN, Bench


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-handler"), "llama", seed=1)


@pytest.fixture(scope="module")
def spans(model_dir):
    """Local blocks, by (start, end): what a correct server of that span answers."""
    made = {}

    def get(start: int, end: int):
        if (start, end) not in made:
            made[start, end] = load_span(model_dir, start, end)[0]
        return made[start, end]

    return get


@pytest.fixture(scope="module")
def span(spans):
    return spans(*SPAN)


@pytest.fixture
def serve(model_dir):
    """``serve(spans=[SPAN], **settings)``: a :class:`Bench` with fresh servers, closed after the test."""
    benches: list[Bench] = []

    def make(spans=(SPAN,), **settings) -> Bench:
        settings = dict(cache_tokens=CACHE_TOKENS, max_sessions_per_peer=PER_PEER, session_timeout=30.0) | settings
        bench = Bench(InProcessSwarm(model_dir, [BlockRange(*s) for s in spans], **settings))
        benches.append(bench)
        return bench

    yield make
    for bench in benches:
        bench.close()
