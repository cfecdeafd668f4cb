"""Who can check a hop (:mod:`shoal.routing.audits`), what a hop nobody can check costs an auditing
client's route, that a listed server which never answered uses up no auditor try, and that a
server runs a forward's sub-range only inside its span (:func:`shoal.server.stateless.check_sub_range`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shoal.client.config import ClientConfig
from shoal.client.remote.directory import ServerDirectory
from shoal.errors import BadRequest
from shoal.ids import BlockRange
from shoal.quantization import Quantization
from shoal.routing import RouteInfo, ServerSpan
from shoal.routing.audits import SUB_SPAN, Piece, auditable, plan_cover, replicas
from shoal.server.stateless import check_sub_range
from shoal.wire.schema import ForwardRequest

CAN_SLICE = frozenset({SUB_SPAN})


def span(peer: str, start: int, end: int, *, dtype: str = "float32", step_ms: float = 1.0, **info) -> ServerSpan:
    info.setdefault("capabilities", CAN_SLICE)
    return ServerSpan(peer, BlockRange(start, end), info=RouteInfo(dtype=dtype, step_ms=step_ms, **info))


def by_length(s: ServerSpan, previous: ServerSpan | None) -> float:
    return float(len(s.blocks))


LIAR = span("liar", 0, 2)
LOW, HIGH, TAIL = span("low", 0, 3), span("high", 2, 6), span("tail", 3, 6)


def test_a_unique_span_is_covered_by_a_piece_of_a_longer_one():
    assert plan_cover([LIAR, LOW, HIGH], LIAR, by_length) == [Piece(LOW, BlockRange(0, 2))]
    assert not plan_cover([LIAR, LOW, HIGH], LIAR, by_length)[0].whole
    assert auditable([LIAR, LOW, HIGH], LIAR)


def test_a_cover_may_take_several_pieces_each_server_once():
    cover = plan_cover([LOW, HIGH, TAIL], HIGH, by_length)
    assert cover == [Piece(LOW, BlockRange(2, 3)), Piece(TAIL, BlockRange(3, 6))]
    assert plan_cover([LOW, HIGH, TAIL], HIGH, by_length, exclude={"tail"}) is None
    assert plan_cover([HIGH], HIGH, by_length) is None  # never its own check


def test_a_piece_needs_the_sub_span_capability_unless_it_is_the_whole_span():
    old = span("old", 0, 3, capabilities=frozenset())
    assert plan_cover([LIAR, old], LIAR, by_length) is None
    replica = span("replica", 0, 2, capabilities=frozenset())
    assert plan_cover([LIAR, replica], LIAR, by_length) == [Piece(replica, BlockRange(0, 2))]


def test_checkers_compute_alike_but_their_dtype_may_differ():
    bf16 = span("bf16", 0, 2, dtype="bfloat16")
    int8 = span("int8", 0, 3, quantization=Quantization.INT8)
    adapted = span("adapted", 0, 3, adapters=(("x", "0" * 64),))
    assert replicas([LIAR, bf16], LIAR) == [bf16]
    assert plan_cover([LIAR, int8, adapted], LIAR, by_length) is None
    assert not auditable([LIAR, int8, adapted], LIAR)


def directory(spans: list[ServerSpan], verify: str = "audit") -> ServerDirectory:
    made = ServerDirectory(None, [], None, 6, 64, ClientConfig(verify=verify, refresh_period=0))
    made.spans = spans
    return made


def test_an_auditing_client_routes_around_a_hop_nobody_can_check():
    """A fast chain whose ``[0:2]`` hop is int8 (nobody computes it alike) beside a slower chain of
    checkable hops: without audits the fast one, in audit mode the checkable one."""
    unique, rest = span("unique", 0, 2, step_ms=0.1, quantization=Quantization.INT8), span("rest", 2, 6, step_ms=0.1)
    slow = [span("a", 0, 3), span("a2", 0, 3), span("b", 3, 6), span("b2", 3, 6)]
    spans = [unique, rest, *slow]
    assert not auditable(spans, unique) and auditable(spans, rest)  # rest: a's 2:3, then b's 3:6

    def route(verify: str) -> list[str]:
        return [s.peer_id for s in directory(spans, verify).route_inference(0, cache_tokens=0, push=False)]

    assert route("off") == ["unique", "rest"]
    assert route("audit") == ["a", "b"]
    alone = [unique, rest]  # nothing else: the unchecked route is still taken
    assert [s.peer_id for s in directory(alone).route_inference(0, cache_tokens=0, push=False)] == ["unique", "rest"]


def test_a_listed_server_that_never_answered_is_no_auditor():
    """A record nobody reached (banned after the client's measurement) uses up no auditor try."""
    made = directory([LIAR, span("fake", 0, 2), LOW])
    made.bans.ban("fake", 30.0)
    assert made.route_replica(LIAR) is None
    assert made.route_cover(LIAR) == [Piece(LOW, BlockRange(0, 2))]
    made.bans.ban("low", 30.0)
    assert made.route_cover(LIAR) is None


def test_a_sub_range_must_lie_inside_the_span():
    server = SimpleNamespace(info=SimpleNamespace(blocks=BlockRange(2, 6)))
    assert check_sub_range(server, ForwardRequest()) is None
    assert check_sub_range(server, ForwardRequest(blocks=BlockRange(2, 6))) is None
    assert check_sub_range(server, ForwardRequest(blocks=BlockRange(3, 5))) == BlockRange(3, 5)
    for outside in (BlockRange(0, 3), BlockRange(5, 7), BlockRange(0, 1)):
        with pytest.raises(BadRequest, match="not within this span"):
            check_sub_range(server, ForwardRequest(blocks=outside))
    with pytest.raises(BadRequest, match="no deep prompts"):
        check_sub_range(server, ForwardRequest(blocks=BlockRange(3, 5), receipt=True))
