"""Liveness's decisions (no I/O): who is probed when, what a failed probe or a report does, and that
no report evicts a server that answers."""

from __future__ import annotations

from shoal.ids import BlockRange
from shoal.swarm.liveness import Liveness, Reach
from shoal.swarm.records import ServerRecord, State
from shoal.swarm.table import RecordTable


def record(peer: str, timestamp: float = 100.0, addrs: tuple[str, ...] = ("127.0.0.1:1",), state=State.ONLINE):
    return ServerRecord(
        swarm="s", peer=peer, addrs=addrs, relay=None, model="m", blocks=BlockRange(0, 2),
        fingerprints=(b"\0" * 32, b"\1" * 32), state=state, throughput=1.0, cache_tokens_free=0, rtts=(),
        version="test", timestamp=timestamp, expires=timestamp + 60,
    )  # fmt: skip


PEERS = ["a", "c", "e", "g", "i"]


def test_each_peer_watches_the_next_two_in_the_ring():
    records = [record(p) for p in PEERS]
    assert Liveness("e").watched(records) == ["g", "i"]
    assert Liveness("i").watched(records) == ["a", "c"]  # wraps around
    assert Liveness("b").watched(records) == ["c", "e"]  # a client-side or new peer fits in between
    # every server has exactly two watchers among the others
    watchers = {p: [w for w in PEERS if p in Liveness(w).watched(records)] for p in PEERS}
    assert all(len(w) == 2 for w in watchers.values()), watchers


def test_an_unreachable_successor_is_skipped_for_the_next_live_one():
    records = [record(p) for p in PEERS]
    live = Liveness("e")
    live.probed(records[3], ok=False, now=0.0)  # g
    assert live.watched(records) == ["i", "a"]


def test_records_count_only_once_reached():
    live = Liveness("a")
    r = record("c")
    assert live.reach(r) is Reach.UNPROBED
    assert live.due([r], now=0.0) == ["c"]  # admission: probed at first sight
    live.probed(r, ok=True, now=0.0)
    assert live.reach(r) is Reach.REACHABLE
    moved = record("c", timestamp=200.0, addrs=("127.0.0.1:2",))
    assert live.reach(moved) is Reach.UNPROBED  # new addresses: reached again before it counts


def test_a_failed_probe_holds_for_that_record_version_only():
    live = Liveness("a")
    r = record("c")
    assert live.probed(r, ok=False, now=0.0) is True  # newly unreachable: tell the others
    assert live.probed(r, ok=False, now=1.0) is False  # known already
    assert live.reach(r) is Reach.UNREACHABLE
    back = record("c", timestamp=150.0)  # it came back and signed a newer record
    assert live.reach(back) is Reach.UNPROBED and "c" in live.due([back], now=2.0)


def test_unreachable_servers_are_rechecked():
    live = Liveness("a", recheck=30.0)
    r = record("x")  # unreachable: out of the ring, probed only when due a re-check
    live.probed(r, ok=False, now=0.0)
    assert live.due([r], now=10.0) == []
    assert live.due([r], now=31.0) == ["x"]


def test_an_admitted_reporter_marks_at_once_until_our_own_probe_says_otherwise():
    live = Liveness("a")
    records = {p: record(p) for p in ("c", "e")}
    for r in records.values():
        live.probed(r, ok=True, now=0.0)
    live.reported(["e"], reporter="c", admitted=True, records=records, now=1.0)
    assert live.reach(records["e"]) is Reach.UNREACHABLE
    assert live.due(list(records.values()), now=1.0)[0] == "e"  # checked first
    live.probed(records["e"], ok=True, now=1.1)  # it answers: back, and the reporter lied
    assert live.reach(records["e"]) is Reach.REACHABLE
    live.reported(["e"], reporter="c", admitted=True, records=records, now=2.0)
    assert live.reach(records["e"]) is Reach.REACHABLE  # a discredited reporter only makes us look
    assert "e" in live.due(list(records.values()), now=2.0)


def test_a_stranger_report_only_makes_us_look():
    live = Liveness("a")
    records = {"c": record("c")}
    live.probed(records["c"], ok=True, now=0.0)
    live.reported(["c", "unknown"], reporter="z", admitted=False, records=records, now=1.0)
    assert live.reach(records["c"]) is Reach.REACHABLE
    assert live.due(list(records.values()), now=1.0) == ["c"]


def test_the_table_leaves_unreachable_servers_out_and_only_reached_ones_judge():
    table = RecordTable("s")
    live = table.liveness = Liveness("a")
    records = [record(p) for p in ("c", "e", "g")]
    table._records.update({r.key: type("Signed", (), {"record": r})() for r in records})
    live.probed(records[0], ok=True, now=0.0)
    live.probed(records[1], ok=False, now=0.0)
    assert [r.peer for r in table.servers()] == ["c", "g"]  # g: not reached yet, still listed
    assert [r.peer for r in table.servers(include_unreachable=True)] == ["c", "e", "g"]
    assert [r.peer for r in table.admitted()] == ["c"]  # only a reached server may judge or vote


def test_probes_per_round_are_capped_and_not_doubled():
    live = Liveness("a", max_probes=3)
    records = [record(f"p{i:02d}") for i in range(10)]
    first = live.due(records, now=0.0)
    assert len(first) == 3
    second = live.due(records, now=0.0)
    assert len(second) == 3 and not set(first) & set(second)  # in flight: not probed twice


def test_reports_cannot_make_a_peer_ping_a_live_server_over_and_over():
    live = Liveness("a", watchers=0)  # no ring duty: only reports would make it probe
    records = {"c": record("c")}
    live.probed(records["c"], ok=True, now=10.0)
    live.reported(["c"], reporter="z", admitted=False, records=records, now=10.2)
    assert live.due(list(records.values()), now=10.2) == []  # probed 0.2 s ago: the report waits
    assert live.due(list(records.values()), now=11.1) == ["c"]  # then it is checked, once
    live.probed(records["c"], ok=True, now=11.1)
    assert live.due(list(records.values()), now=11.2) == []
