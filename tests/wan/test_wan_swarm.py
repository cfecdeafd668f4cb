"""A swarm behind the WAN emulator (testkit.wan.WanSwarm): real servers, client, push chain and
recovery on iroh nodes whose every datagram crosses the emulator's proxies.

Per-link RTT R means R/2 each way: a pushed step (client -> s0 -> s1 -> client) pays 1.5 R of
propagation, a client-driven one (client -> s0 -> client -> s1 -> client) 2 R. The emulator's thread
shares the process with the servers' torch compute, hence the tiny model.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor

from shoal.checkpoints import save_sharded
from shoal.client.remote.driver import MIN_DEADLINE
from shoal.ids import BlockRange
from shoal.routing import NoRouteError
from testkit.tiny import tiny_model
from testkit.wan import (
    DirectionStats,
    LinkConditions,
    LoopbackCapture,
    WanEmulator,
    WanSwarm,
    check_capture_against_counters,
    udp_drops,
    wait_quiet,
)

pytestmark = pytest.mark.timeout(60)
SPANS = [BlockRange(0, 2), BlockRange(2, 4)]
HIDDEN_BYTES = 64 * 4  # one position's hidden state on the wire (hidden size 64, float32)
PROMPT = torch.tensor([[1, 17, 33, 2, 90, 5, 61, 7]])
LONG_PROMPT = torch.randint(2, 256, (1, 64), generator=torch.Generator().manual_seed(0))
LINKS = [("client", "s0"), ("s0", "s1"), ("s1", "client")]  # the hops of a pushed step
CAPTURE_LAG_S = 0.5  # the capture reads a datagram at most this long after the kernel passed (or dropped) it


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return tiny_model("llama", 0)


@pytest.fixture(scope="module")
def checkpoint(reference, tmp_path_factory) -> Path:
    return save_sharded(reference, reference.config, tmp_path_factory.mktemp("tiny-llama"))


def greedy(model, prompt: torch.Tensor, tokens: int, **kwargs) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=tokens, do_sample=False, **kwargs)


class TokenClock(LogitsProcessor):
    """When each token was chosen: consecutive differences are whole decode steps."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


class AtToken(LogitsProcessor):
    """Calls ``action`` once, when token ``index`` (0: the first new one) is chosen."""

    def __init__(self, index: int, action):
        self.index, self.action, self.calls = index, action, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.calls == self.index:
            self.action()
        self.calls += 1
        return scores


def test_the_swarm_hands_out_only_the_emulators_tickets_and_sets_links_by_name_or_span(checkpoint):
    """Every ticket a client gets (hence every push target it names) is a proxy's: the server's
    peer id at an address of the emulator's host, never the server's own; ``links`` apply to a
    client's links once it registers, and ``set_link`` finds a span's server."""
    slow = LinkConditions(rtt_ms=30.0)
    with WanSwarm(checkpoint, SPANS, default=LinkConditions(rtt_ms=1.0), links={("client", "s1"): slow}) as swarm:
        own = [local.ticket for local in swarm.servers]
        assert [t.peer_id for t in swarm.tickets()] == [t.peer_id for t in own]
        assert [t.addrs for t in swarm.tickets()] == [
            (f"{h}:{p}",) for h, p in (swarm.wan.node(n).proxy_addr for n in ("s0", "s1"))
        ]
        assert all(t.addrs[0].startswith(f"{swarm.wan.host}:") for t in swarm.tickets())
        model = swarm.connect(refresh_period=0)
        assert [span.ticket for span in model.blocks.chain] == swarm.tickets(SPANS)
        assert [swarm.names[span.peer_id] for span in model.blocks.chain] == ["s0", "s1"]
        assert swarm.wan.conditions("client", "s1") == swarm.wan.conditions("s1", "client") == slow
        assert swarm.wan.conditions("client", "s0").rtt_ms == 1.0
        swarm.set_link(SPANS[0], SPANS[1], rtt_ms=7.0)
        assert swarm.wan.conditions("s1", "s0").rtt_ms == swarm.wan.conditions("s0", "s1").rtt_ms == 7.0
        assert swarm.name(SPANS[1]) == "s1" and swarm.ticket(SPANS[1]) == swarm.wan.ticket("s1")


def test_greedy_generation_through_a_lossy_jittery_pushed_chain_matches_transformers(checkpoint, reference):
    """2% loss (seeded: the same datagrams are dropped every run) and 1 ms of jitter on every link:
    QUIC resends what was lost, and the tokens are exactly transformers', every step pushed s0 -> s1."""
    conditions = LinkConditions(rtt_ms=4.0, jitter_ms=1.0, loss=0.02)
    with WanSwarm(checkpoint, SPANS, default=conditions, seed=11) as swarm:
        model = swarm.connect(refresh_period=0)
        got = greedy(model, PROMPT, 16)
        pushes = swarm.server(SPANS[0]).server.counters.pushes_sent
        received = swarm.server(SPANS[1]).server.counters.pushes_received
        lost = sum(s.dropped_datagrams for s in swarm.wan.all_stats().values())
        stray = swarm.wan.stray_datagrams
    assert torch.equal(got, greedy(reference, PROMPT, 16))
    assert pushes == received == 16  # the prompt's step and 15 decode steps
    assert lost > 0 and stray == 0  # some datagrams were dropped, and QUIC resent them


def decode_step_ms(model) -> list[float]:
    clock = TokenClock()
    greedy(model, PROMPT, 8, logits_processor=[clock])
    return [(b - a) * 1e3 for a, b in zip(clock.times, clock.times[1:], strict=False)]


@pytest.mark.slow
def test_a_decode_step_pays_one_and_a_half_round_trips_pushed_and_two_driven(checkpoint):
    """R = 250 ms on every link. Each one-way trip takes at least R/2 (the emulator delivers at most
    0.3 ms early), so no step is faster than its propagation: 1.5 R pushed (client -> s0 -> s1 ->
    client), 2 R driven (client -> s0 -> client -> s1 -> client). The median stays within an
    allowance of it for the three nodes' processing (0.45 R: a step costs about 10 ms here without
    delay, but 30-80 ms behind these links, every process waking from idle; and under R/2, so a
    pushed step never paid the driven one's extra leg), and a driven step costs about R/2 more."""
    rtt = 250.0
    allowance = 0.45 * rtt
    with WanSwarm(checkpoint, SPANS, default=LinkConditions(rtt_ms=rtt)) as swarm:
        pushed = decode_step_ms(swarm.connect(name="pushed", refresh_period=0))
        pushes = swarm.server(SPANS[0]).server.counters.pushes_sent
        driven = decode_step_ms(swarm.connect(name="driven", push=False, refresh_period=0))
        assert swarm.server(SPANS[0]).server.counters.pushes_sent == pushes == 8  # every pushed step, no driven one
    for steps, propagation in ((pushed, 1.5 * rtt), (driven, 2.0 * rtt)):
        assert len(steps) == 7
        assert min(steps) >= propagation - 1.0, (propagation, steps)
        assert statistics.median(steps) <= propagation + allowance, (propagation, steps)
    assert statistics.median(driven) - statistics.median(pushed) >= 0.35 * rtt, (pushed, driven)


def test_every_hop_of_a_step_is_counted_on_its_link_and_nothing_goes_around(checkpoint, reference):
    """A driven client, then a pushed one, over s0 [0, 2) and s1 [2, 4); s2 [0, 1) is up but given
    to no client. H = the hidden states of one generation (64 prompt positions + 7 decode steps):
    each hop's link carries at least H, s0 <-> s1 nothing while the client drives the hops, and
    pushing takes H off the client -> s1 link. A capture of ``lo`` matches the proxies' counters
    byte for byte, and every datagram iroh sent straight to another node was dropped by the
    receiver's kernel (the seal)."""
    expected = greedy(reference, LONG_PROMPT, 8)
    h = (LONG_PROMPT.shape[1] + 7) * HIDDEN_BYTES
    with WanEmulator(LinkConditions(rtt_ms=2.0), seed=3) as wan, LoopbackCapture() as capture:
        swarm = WanSwarm(checkpoint, [*SPANS, BlockRange(0, 1)], wan=wan)
        try:
            driver = swarm.connect(SPANS, name="driver", push=False, refresh_period=0)
            assert torch.equal(greedy(driver, LONG_PROMPT, 8), expected)
            wait_quiet(wan)
            driven = wan.all_stats()
            client = swarm.connect(SPANS, name="client", refresh_period=0)
            assert torch.equal(greedy(client, LONG_PROMPT, 8), expected)
            wait_quiet(wan)
            after = wan.all_stats()
            addrs = {node.name: node.own_addrs for node in wan.nodes}
            # iroh keeps probing while the nodes are up, and the capture sees a datagram a little
            # after the kernel dropped it: bracket the capture's count by the drops read well
            # before its cut and just after it
            refused_before = {name: sum(udp_drops(set(own)).values()) for name, own in addrs.items()}
            read_at = time.monotonic() + CAPTURE_LAG_S
            time.sleep(CAPTURE_LAG_S + 0.05)
            refused_after = {name: sum(udp_drops(set(own)).values()) for name, own in addrs.items()}
            emulator = wan.socket_addresses()
        finally:
            swarm.close()  # the nodes; the emulator stays open
        wait_quiet(wan, seconds=0.1)
        datagrams = capture.close()
        final = wan.all_stats()
        stray = wan.stray_datagrams

    def fwd(stats: dict, src: str, dst: str) -> int:
        return stats.get((src, dst), DirectionStats()).forwarded_bytes

    pushed = {key: fwd(after, *key) - fwd(driven, *key) for key in after}
    for src, dst in [("driver", "s0"), ("s0", "driver"), ("driver", "s1"), ("s1", "driver")]:
        assert fwd(driven, src, dst) >= h, (src, dst, driven)
    assert fwd(driven, "s0", "s1") == fwd(driven, "s1", "s0") == 0  # the driver's steps never went s0 -> s1
    for src, dst in [*LINKS, ("s0", "client")]:
        assert pushed[(src, dst)] >= h, (src, dst, pushed)
    assert pushed[("client", "s1")] + h <= fwd(driven, "driver", "s1")  # pushing took H off client -> s1
    assert all(s == DirectionStats() for key, s in final.items() if "s2" in key)  # the idle server's links
    assert all(s.dropped_datagrams == 0 for s in final.values()) and stray == 0

    # around the emulator: counted while every node was up, before its drops were read
    _, _, around = check_capture_against_counters(datagrams, addrs, emulator, final, around_before=read_at)
    for name in addrs:  # every datagram that went around was dropped by its receiver's kernel
        assert refused_before[name] <= around[name] <= refused_after[name], (name, around, refused_before)


@pytest.mark.parametrize(("server", "missing"), [("s0", [0, 1]), ("s1", [2, 3])])
def test_a_lost_client_link_fails_the_step_when_no_other_server_hosts_the_span(checkpoint, server, missing):
    """100% loss on the client's link to one server, mid-session: the step's reply never comes,
    the server does not answer the liveness probe, and no other server hosts its blocks, so the
    step raises :class:`NoRouteError` naming them, within the probe deadlines (not the request
    deadline). Nothing crossed the link meanwhile; s0 got the step (and pushed it on to s1) only
    when its own link was up."""
    with WanSwarm(checkpoint, SPANS, default=LinkConditions(rtt_ms=2.0)) as swarm:
        model = swarm.connect(refresh_period=0, route_wait=0)  # no waiting for a newcomer: at once
        with model.inference_session(max_length=PROMPT.shape[1] + 4):
            first = greedy(model, PROMPT, 2)  # every connection is up, the session holds the prompt
            pushes = swarm.server(SPANS[0]).server.counters.pushes_sent
            swarm.set_link("client", server, loss=1.0)
            time.sleep(0.05)  # what was in flight (e.g. a delayed acknowledgement) has landed
            before = swarm.stats("client", server), swarm.stats(server, "client")
            started = time.monotonic()
            try:
                with pytest.raises(NoRouteError) as failure:
                    greedy(model, first, 1)  # one more step: the token the session does not hold yet
                elapsed = time.monotonic() - started
                after = swarm.stats("client", server), swarm.stats(server, "client")
                pushed = swarm.server(SPANS[0]).server.counters.pushes_sent - pushes
            finally:
                swarm.set_link("client", server, loss=0.0)  # the session closes over a working link
    assert failure.value.missing == missing
    assert 0.5 <= elapsed < 3.0
    assert [new.forwarded_datagrams - old.forwarded_datagrams for old, new in zip(before, after, strict=True)] == [0, 0]
    assert after[0].dropped_datagrams > before[0].dropped_datagrams  # the step or the probe, lost
    assert pushed == (1 if server == "s1" else 0)


def test_a_lost_client_link_moves_the_session_to_a_replica_and_the_tokens_stay_exact(checkpoint, reference):
    """Two servers host [2, 4); the one the session uses loses its link to the client after the
    third token: the session replaces it by the other (replaying the positions so far) and
    generation ends with transformers' tokens."""
    with WanSwarm(checkpoint, [*SPANS, SPANS[1]], default=LinkConditions(rtt_ms=2.0)) as swarm:
        model = swarm.connect(refresh_period=0, routing_seed=0)
        victim: list[str] = []

        def cut() -> None:
            peer = model.active_session.session.chain[1].peer_id
            victim.append(swarm.names[peer])
            swarm.set_link(victim[0], "client", loss=1.0)

        with model.inference_session(max_length=PROMPT.shape[1] + 12) as cache:
            got = greedy(model, PROMPT, 12, logits_processor=[AtToken(2, cut)])
            session = cache.session
        swarm.set_link(victim[0], "client", loss=0.0)
    assert torch.equal(got, greedy(reference, PROMPT, 12))
    (record,) = session.recoveries
    replica = {"s1": "s2", "s2": "s1"}[victim[0]]
    assert swarm.names[record.failed] == victim[0] and record.blocks == SPANS[1]
    assert {swarm.names[peer]: n for peer, n in record.replayed.items()} == {replica: PROMPT.shape[1] + 2}
    assert [swarm.names[span.peer_id] for span in session.chain] == ["s0", replica]


def test_a_lost_push_link_makes_the_client_drive_that_hop(checkpoint, reference):
    """100% loss between s0 and s1: s0's push is sent but never arrives, s1 still answers the
    client's probe, so the client sends s1 each step itself (after the push deadline) and the
    tokens stay exact; nothing crosses s0 -> s1 meanwhile."""
    with WanSwarm(checkpoint, SPANS, default=LinkConditions(rtt_ms=2.0)) as swarm:
        model = swarm.connect(refresh_period=0)
        greedy(model, PROMPT, 2)
        s1 = swarm.server(SPANS[1]).server.counters
        received, steps = s1.pushes_received, s1.steps
        swarm.set_link("s0", "s1", loss=1.0)
        time.sleep(0.05)  # what was in flight has landed
        before = swarm.stats("s0", "s1")
        started = time.monotonic()
        got = greedy(model, PROMPT, 3)
        elapsed = time.monotonic() - started
        after = swarm.stats("s0", "s1")
        received, steps = s1.pushes_received - received, s1.steps - steps
        swarm.set_link("s0", "s1", loss=0.0)
    assert torch.equal(got, greedy(reference, PROMPT, 3))
    assert received == 0 and steps == 3  # every step of the 3 tokens reached s1 from the client
    assert after.forwarded_datagrams == before.forwarded_datagrams
    assert after.dropped_datagrams > before.dropped_datagrams
    assert 3 * MIN_DEADLINE <= elapsed < 3.0  # each step waited out the push deadline first
