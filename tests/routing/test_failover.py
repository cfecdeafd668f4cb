"""Fault tolerance through a real swarm: servers SIGKILLed or drained mid-generation.

A tiny random llama with 6 blocks; servers a1, a2 host blocks 0:3 and b1, b2 host 3:6 (spare
coverage for every block), one swarm, short gossip periods. Clients join through one ticket and
route over the swarm's table; steps are pushed from server to server. Victims and steps are drawn
from a seeded generator.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from shoal.routing import NoRouteError
from tests.helpers.parity import min_top2_gap, tiny_causal_lm
from tests.helpers.swarm import write_checkpoint
from tests.routing.helpers import AtStep, KillableSwarm, TokenRecorder, connect, counters, wait_draining

NEW_TOKENS = 64
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3, 250, 8]])
KILL_RUNS = 20
SPECS = [("a1", (0, 3), ()), ("a2", (0, 3), ()), ("b1", (3, 6), ()), ("b2", (3, 6), ())]


@pytest.fixture(scope="module")
def reference_and_dir(tmp_path_factory):
    model = tiny_causal_lm("llama", seed=5, num_hidden_layers=6)
    path = write_checkpoint(model, tmp_path_factory.mktemp("failover-model"))
    expected = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert min_top2_gap(model, PROMPT, max_new_tokens=NEW_TOKENS) > 1e-3  # no near-ties
    return expected, path


@pytest.fixture(scope="module")
def swarm(reference_and_dir, tmp_path_factory):
    _, path = reference_and_dir
    swarm = KillableSwarm(path)
    try:
        swarm.start(SPECS)
        yield swarm
    finally:
        swarm.close()


@pytest.mark.timeout(420)
def test_sigkill_of_any_route_server_keeps_the_tokens(swarm, reference_and_dir):
    """20 runs: SIGKILL one server of the route at a random step; tokens equal an undisturbed run,
    nothing streamed twice or lost, only the replacement gets the replay; the victim restarts."""
    expected, _ = reference_and_dir
    total = PROMPT.shape[1] + NEW_TOKENS - 1  # positions every route server processes
    rng = random.Random(2026)
    recovery_seconds = []
    for run in range(KILL_RUNS):
        model = connect(swarm, first=sorted(swarm.members)[run % 4])
        try:
            known = sorted((swarm.by_peer(s.peer_id).name, s.start, s.end) for s in model.blocks.directory.spans)
            assert len(known) == 4, f"run {run}: the client sees {known}"
            with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as cache:
                route = [span.peer_id for span in cache.session.chain]
                victim = swarm.by_peer(rng.choice(route)).name
                step = rng.randint(1, NEW_TOKENS - 3)
                before = counters(model)
                recorder, trigger = TokenRecorder(), AtStep(step, lambda v=victim: swarm.kill(v))
                out = model.generate(
                    PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=recorder, logits_processor=[trigger]
                )
                session = cache.session
                new_route = [span.peer_id for span in session.chain]
                after = counters(model)
            assert torch.equal(out, expected), f"run {run}: tokens differ after killing {victim} at step {step}"
            assert recorder.tokens == out[0, PROMPT.shape[1] :].tolist(), f"run {run}: streamed tokens differ"
            assert len(session.recoveries) == 1, f"run {run}: {session.recoveries}"
            recovery = session.recoveries[0]
            assert recovery["failed"] == swarm.members[victim].peer
            replacements = set(new_route) - set(route)
            assert set(recovery["replayed"]) == replacements and len(replacements) == 1, (run, recovery)
            for peer, now in after.items():
                processed = now["positions_processed"] - before.get(peer, {}).get("positions_processed", 0)
                # a route server processes every position once; a server off the route none; a
                # replacement exactly the replayed prefix plus what followed: also every position
                assert processed in (0, total), f"run {run}: {swarm.by_peer(peer).name} processed {processed}"
                assert (processed == total) == (peer in new_route), (run, swarm.by_peer(peer).name)
            gap = trigger.stamps[step + 1] - trigger.stamps[step]
            recovery_seconds.append(gap)
        finally:
            model.blocks.close()
        swarm.restart([victim])
    print(f"token gap across a kill: median {sorted(recovery_seconds)[len(recovery_seconds) // 2]:.2f} s, "
          f"max {max(recovery_seconds):.2f} s")  # fmt: skip
    assert max(recovery_seconds) < 5.0


@pytest.mark.timeout(120)
def test_without_spare_coverage_the_error_names_the_missing_blocks(swarm, reference_and_dir):
    model = connect(swarm, first="a1")
    try:
        failed_at = {}

        def kill_both() -> None:
            swarm.kill("b1")
            swarm.kill("b2")
            failed_at["t"] = time.perf_counter()

        session = model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS)
        with pytest.raises(NoRouteError) as caught, session:
            model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=[AtStep(5, kill_both)])
        elapsed = time.perf_counter() - failed_at["t"]
        assert caught.value.missing == [3, 4, 5]
        assert "3-5" in str(caught.value)
        assert elapsed < 10.0, f"took {elapsed:.1f} s to give up"
    finally:
        model.blocks.close()
        swarm.restart(["b1", "b2"])


@pytest.mark.timeout(120)
def test_sigterm_drain_during_generation_keeps_the_tokens(swarm, reference_and_dir):
    expected, _ = reference_and_dir
    model = connect(swarm, first="a1")
    try:
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as cache:
            victim = swarm.by_peer(cache.session.chain[0].peer_id).name

            def leave(name: str) -> None:  # SIGTERM, and generation goes on once the server is leaving
                swarm.terminate(name)
                wait_draining(model, swarm.members[name].peer)

            out = model.generate(
                PROMPT,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                logits_processor=[AtStep(10, lambda: leave(victim))],
            )
            session = cache.session
        assert torch.equal(out, expected)
        assert [r["failed"] for r in session.recoveries] == [swarm.members[victim].peer]
        assert session.recoveries[0]["drain"], "the client should move on the draining flag, not on a failure"
        assert swarm.members[victim].process.proc.wait(30) == 0  # it drained and exited cleanly
    finally:
        model.blocks.close()
        swarm.restart([victim])
