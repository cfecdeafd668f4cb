"""Fault tolerance: servers killed or drained mid-generation, and the tokens do not change.

A tiny random llama with 6 blocks; servers a1, a2 host blocks 0:3 and b1, b2 host 3:6 (spare
coverage for every block); steps are pushed from server to server.

* In process (:class:`shoal.launch.InProcessSwarm`: the real handler, sessions, push chain, recovery
  and client, on an in-memory network): 20 seeded runs each kill a random server of the route at a
  random step; without spare coverage the error names the missing blocks.
* Across processes, where the process boundary is the point: ``shoal serve`` processes in one swarm
  (short gossip periods), clients joining through one ticket and routing over the swarm's table; one
  route server SIGKILLed mid-generation, one drained by SIGTERM mid-generation (it exits cleanly).
"""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.routing import NoRouteError
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.parity import min_top2_gap
from tests.routing.helpers import AtStep, KillableSwarm, TokenRecorder, connect, counters, wait_draining

NEW_TOKENS = 64
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3, 250, 8]])
MAX_LENGTH = PROMPT.shape[1] + NEW_TOKENS
TOTAL = MAX_LENGTH - 1  # positions every route server processes (the last token is not fed back)
KILL_RUNS = 12
FIRST, SECOND = BlockRange(0, 3), BlockRange(3, 6)
SPECS = [("a1", (0, 3), ()), ("a2", (0, 3), ()), ("b1", (3, 6), ()), ("b2", (3, 6), ())]


@pytest.fixture(scope="module")
def reference_and_dir(tmp_path_factory):
    model = tiny_model("llama", seed=5, num_hidden_layers=6)
    path = save_checkpoint(model, tmp_path_factory.mktemp("failover-model"))
    expected = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert min_top2_gap(model, PROMPT, max_new_tokens=NEW_TOKENS) > 1e-3  # no near-ties
    return expected, path


# ---- in process ----------------------------------------------------------------------------------
@pytest.fixture
def local_swarm(reference_and_dir):
    with InProcessSwarm(reference_and_dir[1], [FIRST, FIRST, SECOND, SECOND]) as swarm:
        yield swarm


def counts(local) -> tuple[int, int]:
    """(positions processed, positions processed over ones the session already held) of a server."""
    counters = local.server.counters
    return counters.positions_processed, counters.positions_rolled_back


def generate_killing(swarm: InProcessSwarm, model, choose) -> tuple:
    """One greedy generation in a session; at the step ``choose(route peers)`` returns, its victim
    is killed. Returns (tokens, streamed tokens, session, route, new route, victim, trigger)."""
    live = {s.ticket.peer_id: s for s in swarm.servers if s.alive}
    with model.inference_session(max_length=MAX_LENGTH) as cache:
        route = [span.peer_id for span in cache.session.chain]
        victim_peer, step = choose(route)
        victim = live[victim_peer]
        recorder, trigger = TokenRecorder(), AtStep(step, lambda: swarm.kill(victim))
        out = model.generate(
            PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=recorder, logits_processor=[trigger]
        )
        session = cache.session
        new_route = [span.peer_id for span in session.chain]
    return out, recorder.tokens, session, route, new_route, victim, trigger


@pytest.mark.timeout(60)
def test_killing_any_route_server_keeps_the_tokens(local_swarm, reference_and_dir):
    """20 runs: kill one server of the route at a random step; tokens equal an undisturbed run,
    nothing streamed twice or lost, only the replacement gets the replay; a new server replaces the
    victim before the next run. The draws hit both hops and steps early and late."""
    expected, _ = reference_and_dir
    rng = random.Random(2026)
    hit: set[tuple[int, bool]] = set()  # (hop killed, in the second half of the generation)
    for run in range(KILL_RUNS):
        # verify="off": the counts below are of failover's work alone; an auditor on the spare
        # replicas would process every position too (failover under audits: tests/integration/test_verify*)
        model = local_swarm.connect(refresh_period=0, verify="off")
        try:
            assert len(model.blocks.directory.spans) == 4, f"run {run}: the client sees {model.blocks.directory.spans}"
            before = {s.ticket.peer_id: counts(s) for s in local_swarm.servers}
            out, streamed, session, route, new_route, victim, trigger = generate_killing(
                local_swarm, model, lambda route: (rng.choice(route), rng.randint(1, NEW_TOKENS - 3))
            )
            after = {s.ticket.peer_id: counts(s) for s in local_swarm.servers if s.alive}
        finally:
            model.close()
        where = f"run {run}: {victim.blocks} killed at step {trigger.step}"
        assert torch.equal(out, expected), f"{where}: tokens differ"
        assert streamed == out[0, PROMPT.shape[1] :].tolist(), f"{where}: streamed tokens differ"
        assert len(session.recoveries) == 1, f"{where}: {session.recoveries}"
        recovery = session.recoveries[0]
        assert recovery.failed == victim.ticket.peer_id and not recovery.drain, where
        replacements = set(new_route) - set(route)
        assert set(recovery.replayed) == replacements and len(replacements) == 1, (where, recovery)
        for peer, now in after.items():
            processed, overwritten = (a - b for a, b in zip(now, before.get(peer, (0, 0)), strict=True))
            # a route server processes every position once, a server off the route none, and a
            # replacement exactly the replayed prefix plus what followed: also every position. One
            # exception, counted: a step the client resent after its push had arrived (the step across
            # the kill can outlast the client's deadline) is computed again over the same positions.
            wanted = TOTAL if peer in new_route else 0
            assert processed - overwritten == wanted, f"{where}: {peer[:8]} processed {processed} ({overwritten} again)"
        assert trigger.gap() < 2.0, f"{where}: the step across the kill took {trigger.gap():.2f} s"
        hit.add((route.index(victim.ticket.peer_id), trigger.step >= NEW_TOKENS // 2))
        local_swarm.add(victim.blocks)
    assert hit == {(0, False), (0, True), (1, False), (1, True)}, f"the draws missed a case: {hit}"


@pytest.mark.timeout(30)
def test_without_spare_coverage_the_error_names_the_missing_blocks(local_swarm, caplog):
    """The last servers of blocks 3-5 die: one line says the client waits ``route_wait`` seconds for
    a newcomer, then one error names the blocks, within that wait (not a series of recoveries)."""
    wait = 1.5
    model = local_swarm.connect(refresh_period=0, route_wait=wait)
    failed_at = {}

    def kill_second_half() -> None:
        local_swarm.kill(SECOND)
        local_swarm.kill(SECOND)
        failed_at["t"] = time.perf_counter()

    session = model.inference_session(max_length=MAX_LENGTH)
    with caplog.at_level(logging.WARNING, "shoal.client"), pytest.raises(NoRouteError) as caught, session:
        model.generate(
            PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=[AtStep(5, kill_second_half)]
        )
    elapsed = time.perf_counter() - failed_at["t"]
    assert caught.value.missing == [3, 4, 5]
    assert str(caught.value) == "no live server left for blocks 3-5 after waiting 1.5 s for one to join"
    assert wait <= elapsed < wait + 3.0, f"took {elapsed:.1f} s to give up (route_wait {wait} s)"
    waits = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert waits == ["no live server left for blocks 3-5: waiting up to 1.5 s for one to join"]
    assert len(caplog.records) <= 3, [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(60)
def test_the_last_server_of_blocks_draining_mid_generation_ends_in_one_error(local_swarm, caplog):
    """SIGTERM to the last servers of blocks 3-5 (in process: drained with a 1 s grace each): the
    session keeps using the draining server while it serves, saying once that nobody can take over,
    then one line says it waits, and one error names the blocks: no line per step."""
    wait = 1.5
    model = local_swarm.connect(refresh_period=0, route_wait=wait)
    spare = next(s for s in local_swarm.servers if s.blocks == SECOND)
    local_swarm.kill(spare)  # one server of 3-5 left: the route's
    leaving = next(s for s in local_swarm.servers if s.blocks == SECOND and s.alive)
    drainer = threading.Timer(0.0, local_swarm.drain, args=(leaving,), kwargs={"timeout": 1.0})
    left = {}

    def drain() -> None:
        left["t"] = time.perf_counter()
        drainer.start()

    with caplog.at_level(logging.INFO, "shoal.client"), pytest.raises(NoRouteError) as caught:
        model.generate(PROMPT, max_new_tokens=400, do_sample=False, logits_processor=[AtStep(3, drain)])
    drainer.join(30)
    elapsed = time.perf_counter() - left["t"]
    assert caught.value.missing == [3, 4, 5]
    assert str(caught.value) == "no live server left for blocks 3-5 after waiting 1.5 s for one to join"
    assert elapsed < 1.0 + wait + 5.0, f"{elapsed:.1f} s from the drain to the error"
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("no replacement for draining server" in line for line in lines) == 1, lines
    assert sum("waiting up to 1.5 s" in line for line in lines) == 1, lines
    # audits (the default) may say once that 3-5 have no second server (the spare is dead): not per step
    unverified = [line for line in lines if "unverified in this session" in line]
    assert len(unverified) <= 1 and len(lines) - len(unverified) <= 5, lines


@pytest.mark.timeout(60)
def test_a_server_joining_within_the_route_wait_takes_over(reference_and_dir):
    """In a swarm, the last servers of blocks 3-5 die and a new one joins while the session waits:
    the session goes on over it (its history replayed there) and the tokens do not change."""
    with InProcessSwarm(reference_and_dir[1], [FIRST, FIRST, SECOND, SECOND], swarm="failover") as swarm:
        model = swarm.connect(refresh_period=0, route_wait=20.0)
        joiner = threading.Timer(0.2, swarm.add, args=(SECOND,))

        def kill_second_half() -> None:
            swarm.kill(SECOND)
            swarm.kill(SECOND)
            joiner.start()

        recorder = AtStep(5, kill_second_half)
        try:
            out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=[recorder])
        finally:
            joiner.join(30)
        assert torch.equal(out, reference_and_dir[0])
        assert recorder.gap() < 15.0, f"the newcomer took over after {recorder.gap():.1f} s"


def generate_while_one_joins(swarm: InProcessSwarm, model, caplog) -> tuple[torch.Tensor, list[str]]:
    """Greedy tokens of ``model`` while a server of blocks 3-5 joins ``swarm`` half a second in,
    and the client's "waiting up to" lines."""
    joiner = threading.Timer(0.5, swarm.add, args=(SECOND,))
    joiner.start()
    try:
        with caplog.at_level(logging.WARNING, "shoal.client"):
            out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        joiner.join(30)
    return out, [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]


@pytest.mark.timeout(60)
def test_a_session_opening_while_blocks_have_no_server_waits_for_one(reference_and_dir, caplog):
    """Found by the soak: a request arriving while the last servers of some blocks are gone (killed,
    their replacements still loading) failed at once. Its open now waits ``route_wait`` seconds,
    as a session does mid-generation, and goes on over the newcomer with the same tokens."""
    with InProcessSwarm(reference_and_dir[1], [FIRST, FIRST, SECOND], swarm="open-wait") as swarm:
        model = swarm.connect(refresh_period=0, route_wait=20.0)
        swarm.kill(SECOND)
        out, waits = generate_while_one_joins(swarm, model, caplog)
        assert torch.equal(out, reference_and_dir[0])
        assert waits == ["no live server left for blocks 3-5: waiting up to 20 s for one to join"], waits


@pytest.mark.timeout(60)
def test_a_session_under_require_verified_waits_for_a_checker_to_join(reference_and_dir, caplog):
    """Under ``require_verified`` an open whose blocks 3-5 have a single server (nobody to check it)
    waits ``route_wait`` seconds for a second one before refusing: one joins, the session opens
    with every block checked, and the tokens are the reference's."""
    with InProcessSwarm(reference_and_dir[1], [FIRST, FIRST, SECOND], swarm="checker-wait") as swarm:
        model = swarm.connect(refresh_period=0, route_wait=20.0, require_verified=True)
        out, waits = generate_while_one_joins(swarm, model, caplog)
        assert torch.equal(out, reference_and_dir[0])
        assert model.verification.unverified_blocks == 0, model.verification
        assert waits == ["no other server can check blocks 3-5 yet: waiting up to 20 s for one to join"], waits


def test_the_default_route_wait_is_at_most_10_seconds():
    from shoal.client.config import ClientConfig

    assert 0 < ClientConfig().route_wait <= 10.0


# ---- across processes ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swarm(reference_and_dir):
    swarm = KillableSwarm(reference_and_dir[1])
    try:
        swarm.start(SPECS)
        yield swarm
    finally:
        swarm.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_of_a_route_server_process_keeps_the_tokens(swarm, reference_and_dir):
    """The route's second server is SIGKILLed mid-generation: the first one's push to it and the
    client's wait for its reply fail across the process boundary; tokens equal an undisturbed run,
    the spare (found in the swarm's table) gets the replay."""
    expected, _ = reference_and_dir
    # verify='off': the test counts which servers processed positions (with the default audits the
    # spares also process them as auditors)
    model = connect(swarm, verify="off")
    try:
        known = len(model.blocks.directory.spans)
        assert known == len(swarm.processes.running), f"the client sees {model.blocks.directory.spans}"
        with model.inference_session(max_length=MAX_LENGTH) as cache:
            route = [span.peer_id for span in cache.session.chain]
            victim = swarm.name_of(route[1])
            before = counters(model)
            recorder, trigger = TokenRecorder(), AtStep(23, lambda: swarm.kill(victim))
            out = model.generate(
                PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=recorder, logits_processor=[trigger]
            )
            session = cache.session
            new_route = [span.peer_id for span in session.chain]
            after = counters(model, exclude={swarm.peer(victim)})
    finally:
        model.close()
    assert torch.equal(out, expected), f"tokens differ after killing {victim}"
    assert recorder.tokens == out[0, PROMPT.shape[1] :].tolist(), "streamed tokens differ"
    assert [r.failed for r in session.recoveries] == [swarm.peer(victim)]
    spare = next(name for name in ("b1", "b2") if name != victim)
    assert new_route == [route[0], swarm.peer(spare)]
    assert dict(session.recoveries[0].replayed) == {swarm.peer(spare): PROMPT.shape[1] + 23}
    for peer, now in after.items():
        processed = now["positions_processed"] - before[peer]["positions_processed"]
        assert processed == (TOTAL if peer in new_route else 0), f"{swarm.name_of(peer)} processed {processed}"
    assert trigger.gap() < 5.0, f"the step across the kill took {trigger.gap():.2f} s"


@pytest.mark.timeout(120)
def test_sigterm_drain_during_generation_keeps_the_tokens(swarm, reference_and_dir):
    """The route's first server gets SIGTERM mid-generation: it drains (its replies say so), the
    client moves to the spare at its next step (which takes the session's KV pages from it), and the
    server exits with 0."""
    expected, _ = reference_and_dir
    model = connect(swarm)
    try:
        with model.inference_session(max_length=MAX_LENGTH) as cache:
            victim = swarm.name_of(cache.session.chain[0].peer_id)

            def leave() -> None:  # SIGTERM, and generation goes on once the server is leaving
                swarm.terminate(victim)
                wait_draining(model, swarm.peer(victim))

            out = model.generate(
                PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=[AtStep(10, leave)]
            )
            session = cache.session
    finally:
        model.close()
    assert torch.equal(out, expected)
    assert [r.failed for r in session.recoveries] == [swarm.peer(victim)]
    assert session.recoveries[0].drain, "the client should move on the draining flag, not on a failure"
    (spare,) = set(session.recoveries[0].migrated) | set(session.recoveries[0].replayed)
    # the spare of the same span took the session's KV pages (shoal.server.migrate): no replay
    assert session.recoveries[0].migrated == {spare: PROMPT.shape[1] + 11}, session.recoveries[0]
    assert swarm.members[victim].proc.wait(30) == 0  # it drained and exited cleanly
