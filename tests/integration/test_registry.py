"""The swarm registry across processes: 6 ``shoal serve`` processes in one swarm, 2 client processes,
``shoal swarm status``, and a test peer injecting forged records through the gossip ops.

Periods are short (gossip round 0.5 s, refresh 1 s, expiry 3 s; see tests/helpers/registry.py) and
every wait polls every peer's own table (op ``table``) against a deadline. Bounds, with ``ROUND`` the
longest gossip round (1.2 x period = 0.6 s):

* a new server's record (and a test peer's valid record pushed to one server) is in every peer's
  table within ``SPREAD_ROUNDS`` rounds;
* a server killed with SIGKILL is gone from every table within its expiry + 1 round (+ polling);
* a server stopped with SIGTERM is ``offline`` in every table within ``OFFLINE_ROUNDS`` round(s);
* forged records never enter any table, and the rejection counters of the peer they were sent to
  grow by at least their number, per reason;
* after the kill, every survivor stays ``online`` in every survivor's table for a whole expiry (a
  dead peer must not hold back anyone's gossip).

Plus one in-process test: a peer that accepts gossip requests and never answers (a crashed peer
behind a pooled connection) must not hold back the rumours a server sends to the others.

The swarm tests run in file order and share one swarm: 5 servers at first, the 6th joins in the
first of them (later tests start it themselves when run alone); the last two stop one server each.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.checkpoints import model_fingerprints, model_name, save_sharded
from shoal.limits import RegistryLimits
from shoal.swarm.gossip import GossipConfig
from shoal.swarm.messages import PushReply
from shoal.swarm.records import ModelRecord, ServerRecord, SignedRecord, State, sign
from shoal.swarm.service import SWARM, SwarmService
from shoal.swarm.table import RecordTable
from shoal.transport import Node
from shoal.transport.identity import generate_key
from testkit.tiny import tiny_model
from tests.helpers.aio import run
from tests.helpers.parity import min_top2_gap
from tests.helpers.registry import (
    EXPIRY,
    LOOPBACK,
    PROMPT,
    REFRESH,
    ROUND,
    STATE_FIELD,
    Forgeries,
    RegistrySwarm,
    Server,
    TestPeer,
    View,
    bump_float,
    fetch_view,
    peer_id,
    poll_views,
    server_record,
    sign_with,
    with_field,
)

pytestmark = pytest.mark.timeout(180)

NUM_BLOCKS = 4
FIRST = ((0, 2), 1.0)  # founds the swarm
JOINERS = [((2, 4), 2.0), ((0, 1), 3.0), ((1, 3), 4.0), ((3, 4), 5.0)]  # join through the founder's ticket
NEW = ((1, 4), 6.0)  # joins later through the ticket of JOINERS[2]
SPREAD_ROUNDS = 4
SPREAD_BOUND = SPREAD_ROUNDS * ROUND
OFFLINE_ROUNDS = 1
POLL_SLACK = 0.4  # a poll of every table every 0.05 s, on 2 busy cores
NEW_TOKENS = 8
STARTUP = 60.0  # a swarm of 5 to settle: process start, imports, loading, gossip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = tiny_model("llama", seed=3)
    return save_sharded(model, model.config, tmp_path_factory.mktemp("registry"))


@pytest.fixture(scope="module")
def swarm(model_dir):
    swarm = RegistrySwarm(model_dir)
    try:
        founder = swarm.found(*FIRST)
        swarm.join_all(JOINERS, founder.ticket)
        run(_all_online(swarm, STARTUP), STARTUP + 10)
        yield swarm
    finally:
        swarm.close()


async def _all_online(swarm: RegistrySwarm, timeout: float) -> dict[str, float]:
    """Wait until every running server's table holds every running server ``online``."""
    tickets = swarm.tickets()
    peers = set(tickets)

    def done(view: View) -> bool:
        return {p for p, r in view.servers().items() if r.state is State.ONLINE} >= peers

    async with await Node.start(LOOPBACK) as node:
        return await poll_views(node, tickets, done, timeout, what="every server online in every table")


def six(swarm: RegistrySwarm) -> list[Server]:
    """The 6 servers (starting the 6th if an earlier test did not), all online in every table."""
    swarm.check_alive()
    if len(swarm.servers) == 1 + len(JOINERS):
        swarm.join_all([NEW], swarm.servers[3].ticket)
        run(_all_online(swarm, 30.0), 40.0)
    assert len(swarm.servers) == 6
    return swarm.servers


def test_a_peer_that_stops_answering_does_not_hold_back_news():
    """In process: A gossips to B and to a peer that accepts requests and never answers (as a
    crashed peer looks while its QUIC connection is still pooled). Each batch of news is offered
    to both (fanout 3 > 2 peers); rounds are 1 h apart, so only offers carry news. The second
    record must reach B as fast as the first, not after the unanswered offer's deadline."""
    config = GossipConfig(period=3600.0, refresh=3600.0, expiry=60.0)

    async def never_answer(stream, peer) -> None:
        await stream.recv(60.0)
        await asyncio.sleep(60.0)

    def record(key: bytes) -> SignedRecord:  # offline: news, not one more peer to gossip with
        fps, now = [bytes(32)] * 2, time.time()
        return sign(server_record("s" * 16, peer_id(key), "m", (0, 2), fps, now, 60.0, state=State.OFFLINE), key)

    async def scenario() -> list[float]:
        async with (
            await Node.start(LOOPBACK, {SWARM: never_answer}) as hole,
            TestPeer("s" * 16) as b,
            await Node.start(LOOPBACK, {SWARM: lambda stream, peer: a.handle(stream, peer)}) as node,
        ):
            a = SwarmService(node, RecordTable("s" * 16), config, [hole.ticket("s" * 16), b.node.ticket("s" * 16)])
            a.start()
            try:
                delays = []
                for _ in range(2):
                    news, started = record(generate_key()), time.monotonic()
                    a.publish(news)
                    while news.key not in {s.key for s in b.table.records()}:
                        assert time.monotonic() - started < 2.0, f"news {len(delays) + 1} did not reach B in 2 s"
                        await asyncio.sleep(0.01)
                    delays.append(round(time.monotonic() - started, 3))
                return delays
            finally:
                await a.stop()

    print(f"news reached B after (s): {run(scenario(), 30.0)}")


@pytest.mark.slow
def test_new_server_record_reaches_every_peer(swarm):
    assert len(swarm.servers) == 5, "this test adds the 6th server"
    swarm.check_alive()
    (new,) = swarm.join_all([NEW], swarm.servers[3].ticket)
    ready = time.monotonic()  # it printed its ticket right after publishing its online record
    tickets = swarm.tickets()
    assert len(tickets) == 6

    def done(view: View) -> bool:  # every peer (the new one included) sees all 6 online
        return {p for p, r in view.servers().items() if r.state is State.ONLINE} == set(tickets)

    async def scenario() -> dict[str, float]:
        async with await Node.start(LOOPBACK) as node:
            return await poll_views(node, tickets, done, SPREAD_BOUND + POLL_SLACK, what="the new server's record")

    first = run(scenario(), 30.0)
    delays = {p[:8]: round(t - ready, 3) for p, t in first.items()}
    print(f"new server {new.peer[:8]} online in each table after (s): {delays}")
    assert max(first.values()) - ready <= SPREAD_BOUND + POLL_SLACK


@pytest.mark.slow
def test_clients_and_status_see_the_whole_table_through_one_ticket(swarm, model_dir):
    servers = six(swarm)
    spans = sorted([s.peer, *s.span] for s in servers)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPT])
    assert min_top2_gap(reference, prompt, max_new_tokens=NEW_TOKENS) > 1e-3  # greedy far from ties
    expected = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT) :].tolist()

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tests.helpers.registry", "client", str(model_dir)]
    via = {"client-a": servers[1], "client-b": servers[5]}  # each joins through another server's ticket
    procs = {
        name: subprocess.Popen([*cmd, str(s.ticket), str(NEW_TOKENS)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
        for name, s in via.items()
    }  # fmt: skip
    status_cmd = [sys.executable, "-m", "shoal.cli.main", "swarm", "status", "--json", "--join", str(servers[4].ticket)]
    procs["status"] = subprocess.Popen(status_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    outputs = {}
    try:
        for name, proc in procs.items():
            outputs[name] = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{outputs[name]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)

    for name in via:
        lines = [line for line in outputs[name][0].splitlines() if line.startswith("result: ")]
        assert lines, f"{name} printed no result:\n{outputs[name][0][-3000:]}"
        result = json.loads(lines[-1].removeprefix("result: "))
        assert result["tokens"] == expected, name
        assert result["seen"] == spans, f"{name} saw {result['seen']}, the swarm is {spans}"
        chain = result["chain"]
        assert [hop[1] for hop in chain] == [0] + [hop[2] for hop in chain[:-1]] and chain[-1][2] == NUM_BLOCKS
        assert all(hop in spans for hop in chain), chain
        print(f"{name} via {via[name].peer[:8]}: tokens {result['tokens']}, chain {[(h[1], h[2]) for h in chain]}")

    status = json.loads(outputs["status"][0])
    assert status["swarm"] == swarm.swarm_id and status["unverified_servers"] == []
    (model,) = status["models"]
    assert model["name"] == model_name(str(model_dir)) and model["num_blocks"] == NUM_BLOCKS
    assert model["uncovered"] == [] and model["coverage"] == [2, 3, 3, 3]
    listed = {s["peer"]: s for s in model["servers"]}
    assert set(listed) == {s.peer for s in servers}
    for server in servers:
        row = listed[server.peer]
        assert (row["start"], row["end"]) == server.span and row["state"] == "online"
        assert row["throughput"] == server.throughput
        assert 0 < row["cache_tokens_free"] <= 8192
        assert 0 <= row["age_s"] < EXPIRY and row["expires_in_s"] > 0


def test_forged_records_never_enter_a_table_and_a_valid_one_spreads(swarm, model_dir):
    servers = six(swarm)
    tickets = swarm.tickets()
    swarm_id, model = swarm.swarm_id, model_name(str(model_dir))
    fingerprints = [bytes.fromhex(f) for f in model_fingerprints(model_dir)]
    victim = servers[1]  # a live server others try to impersonate
    push_to, offer_to, sync_to = servers[0], servers[2], servers[5]

    async def scenario() -> None:
        async with TestPeer(swarm_id) as peer:
            node = peer.node
            # an earlier valid record of the victim, then wait until every table holds a newer one
            old = (await fetch_view(node, tickets[push_to.peer])).records[f"s:{victim.peer}"]

            def refreshed(view: View) -> bool:
                record = view.server(victim.peer)
                return record is not None and record.timestamp > old.timestamp

            await poll_views(node, tickets, refreshed, REFRESH + ROUND + SPREAD_BOUND, what="a refresh")
            latest = (await fetch_view(node, tickets[push_to.peer])).records[f"s:{victim.peer}"]
            now = time.time()
            forged = Forgeries()
            start, end = victim.span
            impostor = server_record(swarm_id, victim.peer, model, victim.span, fingerprints[start:end], now, EXPIRY,
                                     state=State.OFFLINE)  # fmt: skip
            forged.add("victim-signed-by-another-key", sign_with(impostor, peer.key), "bad_signature")
            k1, k2, k3, k4, k5 = (generate_key() for _ in range(5))
            other = server_record(swarm_id, peer_id(k1), model, (0, 2), fingerprints[0:2], now, EXPIRY)
            forged.add("fresh-signed-by-another-key", sign_with(other, k2), "bad_signature", other.key)
            alien = server_record("0" * 16, peer_id(k3), model, (0, 2), fingerprints[0:2], now, EXPIRY)
            forged.add("wrong-swarm", sign(alien, k3).data, "wrong_swarm", alien.key)
            valid = server_record(swarm_id, peer_id(k4), model, (2, 4), fingerprints[2:4], now, EXPIRY)
            forged.add("tampered-throughput", bump_float(sign(valid, k4).data, 1234.5), "bad_signature", valid.key)
            forged.add("tampered-victim-state", with_field(latest.data, STATE_FIELD, "offline"), "bad_signature")
            forged.add("tampered-victim-timestamp", bump_float(latest.data, latest.timestamp), "bad_signature")
            forged.add("replayed-victim", old.data, "stale")
            wrong = server_record(swarm_id, peer_id(k5), model, (0, 2), [os.urandom(32)] * 2, now, EXPIRY)
            forged.add("fingerprints-not-the-models", sign(wrong, k5).data, "fingerprint_mismatch", wrong.key)
            remodel = ModelRecord(swarm_id, peer_id(k5), model, NUM_BLOCKS, (os.urandom(32),) * 4, now, now + EXPIRY)
            forged.add("model-with-other-fingerprints", sign(remodel, k5).data, "fingerprint_mismatch")
            control = peer.own_record(fingerprints[2:4], model, (2, 4), State.JOINING, lifetime=30.0)

            def clean(view: View) -> None:
                forged.check_absent(view)
                record = view.server(victim.peer)
                assert record is not None and record.state is State.ONLINE, f"victim in {view.peer[:8]}: {record}"
                assert record.timestamp > old.timestamp, f"the replayed record is back in {view.peer[:8]}"

            targets = (push_to.peer, offer_to.peer, sync_to.peer)
            before = {p: (await fetch_view(node, tickets[p])).rejected for p in targets}
            # push: the forgeries, then the control record, to one server, a few per push (a push
            # takes at most RegistryLimits.max_unasked_per_push records nobody asked for)
            pushed, per_push = [*forged.records.values(), control.data], RegistryLimits().max_unasked_per_push
            for i in range(0, len(pushed), per_push):
                assert await peer.op(push_to.ticket, "push", pushed[i : i + per_push]) == PushReply()
            injected = time.monotonic()
            # offer, then push what it wanted (and the rest anyway, as a forger would)
            wanted = (await peer.op(offer_to.ticket, "offer", forged.digest())).wanted
            assert forged.fresh_keys <= set(wanted), wanted
            assert await peer.op(offer_to.ticket, "push", list(forged.records.values())) == PushReply()
            # sync: its answer must not carry a forgery; then push what it wanted
            answer = await peer.op(sync_to.ticket, "sync", forged.digest())
            assert forged.fresh_keys <= set(answer.wanted), answer.wanted
            assert not set(answer.records) & set(forged.records.values())
            assert await peer.op(sync_to.ticket, "push", list(forged.records.values())) == PushReply()

            def has_control(view: View) -> bool:
                return control.data in view.data

            first = await poll_views(
                node, tickets, has_control, SPREAD_BOUND + POLL_SLACK, clean, what="control record"
            )
            delays = {p[:8]: round(t - injected, 3) for p, t in first.items()}
            print(f"control record pushed to {push_to.peer[:8]} in each table after (s): {delays}")
            assert max(first.values()) - injected <= SPREAD_BOUND + POLL_SLACK
            # two more rounds of watching: nothing forged shows up late
            settle = time.monotonic() + 2 * ROUND
            await poll_views(node, tickets, lambda view: view.at >= settle, 2 * ROUND + 5.0, clean, what="settling")
            for p, counts in before.items():
                after = (await fetch_view(node, tickets[p])).rejected
                grew = {reason: after[reason] - counts[reason] for reason in (*forged.expected, "unasked")}
                # each forgery was refused for its own reason, or dropped undecoded as one of more
                # unasked records than a push may carry (which of them depends on the order)
                short = sum(max(n - grew[r], 0) for r, n in forged.expected.items())
                assert short <= grew["unasked"], (p[:8], grew, dict(forged.expected))
            # leave: an offline record to every server, so nobody gossips to this peer any more
            bye = peer.own_record(fingerprints[2:4], model, (2, 4), State.OFFLINE, lifetime=EXPIRY)
            await asyncio.gather(*(peer.op(t, "push", [bye.data]) for t in tickets.values()))

    run(scenario(), 60.0)
    swarm.check_alive()


def test_clean_shutdown_shows_offline_in_every_table_at_once(swarm):
    servers = six(swarm)
    target = servers[2]
    others = {p: t for p, t in swarm.tickets().items() if p != target.peer}

    def offline(view: View) -> bool:
        record = view.server(target.peer)
        return record is not None and record.state is State.OFFLINE

    async def scenario() -> tuple[float, dict[str, float]]:
        async with await Node.start(LOOPBACK) as node:
            await fetch_view(node, target.ticket)  # connections up before the clock starts
            target.stopped = True
            started = time.monotonic()
            target.process.terminate()
            bound = OFFLINE_ROUNDS * ROUND + POLL_SLACK
            return started, await poll_views(node, others, offline, bound, what="offline record")

    started, first = run(scenario(), 30.0)
    delays = {p[:8]: round(t - started, 3) for p, t in first.items()}
    print(f"SIGTERM: {target.peer[:8]} offline in each table after (s): {delays}")
    assert max(first.values()) - started <= OFFLINE_ROUNDS * ROUND + POLL_SLACK
    assert target.process.proc.wait(15) == 0
    time.sleep(0.1)
    assert "Traceback" not in target.output(), target.output()[-3000:]


@pytest.mark.slow
def test_killed_server_disappears_from_every_table_within_its_expiry(swarm):
    servers = six(swarm)
    target = servers[3]  # the one the 6th server joined through: it stays among that one's bootstrap peers
    others = {p: t for p, t in swarm.tickets().items() if p != target.peer}

    def gone(view: View) -> bool:
        return view.server(target.peer) is None

    def survivors_online(view: View) -> None:  # a crash must not hold back the others' gossip
        missing = [p[:8] for p in others if not online(view, p)]
        assert not missing, f"{view.peer[:8]} lost live servers {missing} after the kill"

    async def scenario() -> tuple[float, dict[str, float]]:
        async with await Node.start(LOOPBACK) as node:
            await poll_views(node, others, lambda view: online(view, target.peer), 5.0, what="target online")
            target.stopped = True
            started = time.monotonic()
            target.process.kill()
            bound = EXPIRY + ROUND + POLL_SLACK
            first = await poll_views(node, others, gone, bound, survivors_online, what="killed record gone")
            # and the survivors keep seeing each other for a whole expiry after the kill
            until = started + EXPIRY + ROUND
            await poll_views(node, others, lambda view: view.at >= until, bound + 5.0, survivors_online)
            return started, first

    started, first = run(scenario(), 30.0)
    delays = {p[:8]: round(t - started, 3) for p, t in first.items()}
    print(f"SIGKILL: {target.peer[:8]} gone from each table after (s): {delays}")
    assert max(first.values()) - started <= EXPIRY + ROUND + POLL_SLACK
    swarm.check_alive()


def online(view: View, peer: str) -> bool:
    record = view.server(peer)
    return isinstance(record, ServerRecord) and record.state is State.ONLINE
