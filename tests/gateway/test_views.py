"""The dashboard's and the health checks' views of a swarm, without a network: load samples (rates
from counters, the 10-minute ring), the swarm graph and readiness, over a status summarized from a
real record table of signed records."""

from __future__ import annotations

import dataclasses
import time

import pytest

from shoal.gateway.history import LoadHistory, Reading, Sample, ServerLoad
from shoal.gateway.views import readiness, swarm_graph, with_load
from shoal.swarm.records import ModelRecord, State, sign
from shoal.swarm.status import summarize
from shoal.swarm.table import RecordTable
from shoal.transport.identity import generate_key
from tests.helpers.registry import peer_id, server_record

pytestmark = pytest.mark.timeout(30)

SWARM, MODEL, BLOCKS = "0123456789abcdef", "tinychat", 6


def test_rates_come_from_counter_differences_and_restart_after_a_gap():
    history = LoadHistory()
    first = history.add(100.0, {"a": Reading(1_000, 0, at=10.0)})
    assert first == Sample(100.0, {"a": ServerLoad(None, 0)})  # nothing to compare with yet
    assert history.add(101.0, {"a": Reading(1_250, 2, at=12.0)}).servers["a"] == ServerLoad(125.0, 2)
    history.add(102.0, {})  # "a" did not answer: a gap
    assert history.add(103.0, {"a": Reading(1_300, 1, at=15.0)}).servers["a"] == ServerLoad(None, 1)
    assert history.add(104.0, {"a": Reading(10, 1, at=16.0)}).servers["a"] == ServerLoad(None, 1)  # counters restarted
    assert [s.t for s in history.since(102.0)] == [103.0, 104.0]
    assert history.as_json(103.0) == {
        "interval_s": 1.0,
        "window_s": 600.0,
        "samples": [{"t": 104.0, "servers": {"a": {"tokens_per_s": None, "sessions_active": 1}}}],
    }


def test_the_ring_keeps_ten_minutes_of_one_second_samples():
    history = LoadHistory()
    for i in range(700):
        history.add(float(i), {"a": Reading(i * 10, 0, at=float(i))})
    assert len(history.samples) == 600
    assert history.samples[0].t == 100.0 and history.latest().t == 699.0
    assert history.latest().servers["a"] == ServerLoad(10.0, 0)


def signed_table(states: dict[str, State], rtts: dict[str, dict[str, float]]) -> tuple[RecordTable, dict]:
    """A table with the model record and servers "a" [0:2), "b" and "d" [2:4), "c" [4:6) (those in
    ``states``), publishing ``rtts`` (by name); returns it and name -> peer id."""
    now = time.time()
    keys = {name: generate_key() for name in "abcdx"}  # "x": a peer without a record
    peers = {name: peer_id(key) for name, key in keys.items()}
    fingerprints = [bytes([i]) * 32 for i in range(BLOCKS)]
    table = RecordTable(SWARM)
    model = ModelRecord(SWARM, peers["a"], MODEL, BLOCKS, tuple(fingerprints), now, now + 60)
    assert table.merge(sign(model, keys["a"]))
    spans = {"a": (0, 2), "b": (2, 4), "d": (2, 4), "c": (4, 6)}
    for name, state in states.items():
        start, end = spans[name]
        record = server_record(SWARM, peers[name], MODEL, spans[name], fingerprints[start:end], now, 60, state=state)
        published = tuple(sorted((peers[to], ms) for to, ms in rtts.get(name, {}).items()))
        assert table.merge(sign(dataclasses.replace(record, rtts=published), keys[name]))
    return table, peers


def test_the_graph_has_a_node_per_server_and_an_edge_per_rtt_of_a_server_not_offline():
    states = {"a": State.OFFLINE, "b": State.ONLINE, "c": State.ONLINE, "d": State.JOINING}
    rtts = {"a": {"b": 1.5}, "b": {"c": 0.25}, "d": {"c": 2.0, "x": 9.0}}  # "x" has no record
    table, peers = signed_table(states, rtts)
    status = summarize(table, time.time())
    route = [{"peer": peers["b"], "start": 2, "end": 4}, {"peer": peers["c"], "start": 4, "end": 6}]
    graph = swarm_graph(status, [route])
    assert {n["peer"]: (n["state"], n["start"], n["end"], n["model"]) for n in graph["nodes"]} == {
        peers["a"]: ("offline", 0, 2, MODEL),
        peers["b"]: ("online", 2, 4, MODEL),
        peers["d"]: ("joining", 2, 4, MODEL),
        peers["c"]: ("online", 4, 6, MODEL),
    }
    edges = {(e["from"], e["to"]): e["ms"] for e in graph["edges"]}
    assert edges == {(peers["b"], peers["c"]): 0.25, (peers["d"], peers["c"]): 2.0}
    assert graph["routes"] == [[peers["b"], peers["c"]]]


def test_with_load_adds_each_servers_latest_load_and_leaves_the_status_alone():
    table, peers = signed_table({"a": State.ONLINE, "c": State.ONLINE}, {})
    status = summarize(table, time.time())
    sample = Sample(42.0, {peers["a"]: ServerLoad(12.5, 3)})
    loaded = with_load(status, sample)
    shown = {s["peer"]: (s["tokens_per_s"], s["sessions_active"]) for s in loaded["models"][0]["servers"]}
    assert shown == {peers["a"]: (12.5, 3), peers["c"]: (None, None)}
    assert loaded["load_time"] == 42.0
    assert "tokens_per_s" not in status["models"][0]["servers"][0]
    assert with_load(status, None)["load_time"] is None


def test_readiness_names_the_uncovered_blocks():
    table, _ = signed_table({"a": State.ONLINE, "b": State.ONLINE, "c": State.ONLINE}, {})
    status = {**summarize(table, time.time()), "via": "someone", "error": None}
    assert readiness(status, MODEL) == (True, {"ready": True, "model": MODEL, "num_blocks": 6, "servers_online": 3})
    assert readiness(status, None) == (True, {"ready": True, "swarm": SWARM})
    ready, body = readiness(status, "other")
    assert not ready and body["reason"] == "the swarm has no record of model other"

    table, _ = signed_table({"a": State.ONLINE, "b": State.OFFLINE, "c": State.ONLINE}, {})
    status = {**summarize(table, time.time()), "via": "someone", "error": None}
    assert readiness(status, MODEL) == (
        False,
        {
            "ready": False,
            "reason": f"blocks 2-3 of {MODEL} have no online server",
            "model": MODEL,
            "num_blocks": 6,
            "servers_online": 2,
            "uncovered": [2, 3],
        },
    )
    error = "no swarm member answered: a: timed out"
    assert readiness({**status, "via": None, "error": error}, MODEL) == (False, {"ready": False, "reason": error})
