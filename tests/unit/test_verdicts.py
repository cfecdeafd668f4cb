"""Verdict records (shoal.swarm.records.VerdictRecord) and the swarm's quorum (shoal.swarm.verdicts):
strict decoding, the table's checks, gossip carrying them unchanged, who is convicted, and the places
that must stop routing over a convicted server (a client's swarm table, a server's next hops, status)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from types import SimpleNamespace

import msgspec
import pytest

from shoal.client.remote.listing import swarm_spans
from shoal.ids import BlockRange
from shoal.server.announce import Announcement
from shoal.swarm.gossip import GossipConfig, Gossiper
from shoal.swarm.messages import TableReply, encode_payload
from shoal.swarm.records import (
    ModelRecord,
    RecordError,
    SignedRecord,
    State,
    VerdictRecord,
    decode,
    sign,
)
from shoal.swarm.service import blob
from shoal.swarm.status import render, summarize
from shoal.swarm.table import RecordTable
from shoal.swarm.verdicts import VERDICT_LIFETIME, VerdictKeeper, convicted, tally, verdict_for
from shoal.transport import Ticket
from shoal.verify.receipts import ReceiptSigner
from shoal.wire import Message
from shoal.wire.schema import Receipt
from tests.helpers.registry import server_record, sign_with, split, with_body, with_field

pytestmark = pytest.mark.timeout(30)

SWARM = "verdict-test"
MODEL = "tiny"
NUM_BLOCKS = 6
NOW = float(int(time.time()))  # records live 100 s from it (tests reading the real clock use fresh())
FPS = tuple(bytes([i]) * 32 for i in range(NUM_BLOCKS))
EVIDENCE = bytes(range(32))
HIGH = BlockRange(2, 4)


def keys(n: int, seed: int) -> list[tuple[bytes, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        key = rng.randbytes(32)
        out.append((key, ReceiptSigner(key).peer_id))
    return out


(ACCUSED_KEY, ACCUSED), (JUDGE_KEY, JUDGE), (OTHER_KEY, OTHER), (FOURTH_KEY, FOURTH), (LOW_KEY, LOW) = keys(5, 1)
PUBLISHER_KEY, PUBLISHER = keys(1, 2)[0]


def receipt_of(key: bytes, start: int = 2, end: int = 4, position: int = 8) -> Receipt:
    unsigned = Receipt(
        weights=b"w" * 16, start=start, end=end, session="s" * 8, position=position, n=1, step=3,
        inputs=b"i" * 16, outputs=b"o" * 16, codec="raw", adapter=b"", prompts=False, state=b"c" * 16,
        compute="f32/cpu", signature=b"",
    )  # fmt: skip
    return ReceiptSigner(key).sign(unsigned)


def verdict(
    judge: str = JUDGE, accused: str = ACCUSED, blocks: BlockRange = HIGH, now: float = NOW, *,
    key: bytes = ACCUSED_KEY, receipt: Receipt | bytes | None = None, lifetime: float = VERDICT_LIFETIME,
) -> VerdictRecord:  # fmt: skip
    """A verdict against ``accused`` with a receipt signed by ``key`` (the accused's own, unless told)."""
    return verdict_for(
        swarm=SWARM, judge=judge, accused=accused, model=MODEL, blocks=blocks, evidence=EVIDENCE,
        receipt=receipt_of(key) if receipt is None else receipt, now=now, lifetime=lifetime,
    )  # fmt: skip


def signed_verdict(judge_key: bytes = JUDGE_KEY, **kw) -> bytes:
    return sign(verdict(judge=ReceiptSigner(judge_key).peer_id, **kw), judge_key).data


def table_at(now: float = NOW + 1, signed: float = NOW) -> RecordTable:
    table = RecordTable(SWARM, clock=lambda: now)
    model = ModelRecord(SWARM, PUBLISHER, MODEL, NUM_BLOCKS, FPS, signed, signed + 100)
    assert table.merge(sign(model, PUBLISHER_KEY))
    return table


def add_server(table: RecordTable, key: bytes, span: tuple[int, int], state: State = State.ONLINE, at: float = NOW):
    peer = ReceiptSigner(key).peer_id
    record = server_record(SWARM, peer, MODEL, span, FPS[span[0] : span[1]], at, 100.0, state=state)
    assert table.merge(sign(record, key)), table.rejected


# ---- records --------------------------------------------------------------------------------------
def test_round_trip_keeps_every_field_and_the_bytes():
    data = signed_verdict()
    signed = decode(data)
    record = signed.record
    assert record == verdict()
    assert signed.data == data
    assert record.key == f"v:{JUDGE}:{ACCUSED}" and record.signer == JUDGE
    assert record.expires - record.timestamp == VERDICT_LIFETIME
    assert record.disputed == receipt_of(ACCUSED_KEY)
    assert len(data) < 600  # a receipt of ~150 bytes, two peer ids, a digest
    table = table_at()
    assert table.merge(data) and table.verdicts(MODEL) == [record] and table.verdicts("other") == []


MALFORMED = {
    "swarm empty": (0, ""),
    "swarm not a string": (0, 5),
    "swarm too long": (0, "s" * 65),
    "judge not hex": (1, "z" * 64),
    "judge short": (1, "ab" * 31),
    "accused not a string": (2, 7),
    "accused upper case": (2, ACCUSED.upper()),
    "model empty": (3, ""),
    "model missing": (3, None),
    "start negative": (4, -1),
    "start a bool": (4, True),
    "start a string": (4, "2"),
    "end not after start": (5, 2),
    "end beyond any model": (5, (1 << 20) + 1),
    "evidence short": (6, b"e" * 31),
    "evidence a string": (6, "e" * 32),
    "receipt empty": (7, b""),
    "receipt not bytes": (7, 5),
    "receipt too long": (7, b"r" * 1025),
    "timestamp not a number": (8, "now"),
    "timestamp infinite": (8, math.inf),
    "expiry before timestamp": (9, NOW - 1),
    "judge is the accused": (1, ACCUSED),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_every_malformed_field_is_rejected(case):
    index, value = MALFORMED[case]
    with pytest.raises(RecordError) as caught:
        decode(with_field(signed_verdict(), index, value))
    assert caught.value.reason == "malformed", caught.value


def test_wrong_field_count_is_malformed():
    body, _ = split(signed_verdict())
    fields = msgspec.msgpack.decode(body)
    for tampered in (fields[:-1], [*fields, 1.0]):
        with pytest.raises(RecordError, match="field count"):
            decode(with_body(signed_verdict(), msgspec.msgpack.encode(tampered)))


def test_receipts_that_do_not_show_the_accused_computing_those_blocks_are_bad_receipts():
    garbage = sign(verdict(receipt=b"\x93\x01\x02\x03"), JUDGE_KEY).data
    someone_elses = sign(verdict(receipt=receipt_of(OTHER_KEY)), JUDGE_KEY).data  # signed, not by the accused
    tampered = msgspec.structs.replace(receipt_of(ACCUSED_KEY), position=9)  # the accused's signature, altered
    altered = sign(verdict(receipt=tampered), JUDGE_KEY).data
    elsewhere = sign(verdict(receipt=receipt_of(ACCUSED_KEY, 0, 2)), JUDGE_KEY).data  # blocks 0:2, verdict on 2:4
    # a verdict's blocks are exactly its receipt's (2:4): overlapping, inside or around it is not enough
    spans = (BlockRange(3, 5), BlockRange(3, 4), BlockRange(1, 5))
    overlapping, inside, around = (sign(verdict(blocks=span), JUDGE_KEY).data for span in spans)
    for data in (garbage, someone_elses, altered, elsewhere, overlapping, inside, around):
        with pytest.raises(RecordError) as caught:
            decode(data)
        assert caught.value.reason == "bad_receipt", caught.value
    assert decode(signed_verdict()).record.blocks == HIGH == BlockRange(receipt_of(ACCUSED_KEY).start, 4)


def test_forged_signatures_are_rejected():
    by_other_key = sign_with(verdict(), OTHER_KEY)  # names JUDGE, signed by OTHER
    edited = with_field(signed_verdict(), 3, "tinz")  # a valid body the judge never signed
    for data in (by_other_key, edited):
        with pytest.raises(RecordError) as caught:
            decode(data)
        assert caught.value.reason == "bad_signature"
    with pytest.raises(ValueError, match="does not belong"):
        sign(verdict(), OTHER_KEY)


def test_the_table_checks_verdicts_like_any_record_and_counts_each_reason():
    table = table_at(NOW + 1)
    rejected = {
        "expired": sign(verdict(now=NOW - 2 * VERDICT_LIFETIME), JUDGE_KEY).data,
        "future": sign(verdict(now=NOW + 60), JUDGE_KEY).data,
        "lifetime": sign(verdict(lifetime=4000.0), JUDGE_KEY).data,
        "wrong_swarm": sign(dataclasses.replace(verdict(), swarm="other"), JUDGE_KEY).data,
        "bad_receipt": sign(verdict(receipt=receipt_of(OTHER_KEY)), JUDGE_KEY).data,
        "bad_signature": sign_with(verdict(), OTHER_KEY),
        "malformed": with_field(signed_verdict(), 1, ACCUSED),
    }
    for reason, data in rejected.items():
        assert not table.merge(data), reason
        assert table.rejected[reason] == 1, (reason, dict(table.rejected))
    assert table.verdicts() == []
    assert table.merge(signed_verdict())
    assert not table.merge(signed_verdict()) and table.rejected["stale"] == 1  # not newer than the one held
    newer = signed_verdict(now=NOW + 0.5)
    assert table.merge(newer) and table.verdicts()[0].timestamp == NOW + 0.5


def test_gossip_carries_a_verdict_byte_for_byte():
    a, b = table_at(), table_at()
    config = GossipConfig(period=1.0)
    alice, bob = Gossiper(a, "a" * 64, config, random.Random(1)), Gossiper(b, "b" * 64, config, random.Random(2))
    alice.extra_peers.add("b" * 64)
    data = signed_verdict()
    assert alice.publish(decode(data))
    (offer,) = alice.take_offers()
    (push,) = alice.on_reply(offer, bob.handle(offer.op, offer.payload, "a" * 64))
    bob.handle(push.op, push.payload, "a" * 64)
    assert b.get(f"v:{JUDGE}:{ACCUSED}").data == data


# ---- the quorum -------------------------------------------------------------------------------------
def replicas(table: RecordTable, *extra: tuple[bytes, tuple[int, int], State], at: float = NOW) -> None:
    """The accused and two honest replicas on blocks 2:4, one server of 0:2, and ``extra``."""
    for key in (ACCUSED_KEY, JUDGE_KEY, OTHER_KEY):
        add_server(table, key, (2, 4), at=at)
    add_server(table, LOW_KEY, (0, 2), at=at)
    for key, span, state in extra:
        add_server(table, key, span, state)


def test_two_honest_replicas_of_three_convict_the_third():
    table = table_at()
    replicas(table)  # the 0:2 server is adjacent to 2:4, not on it: no vote
    table.merge(signed_verdict(JUDGE_KEY))
    (alone,) = tally(table, MODEL)
    assert (alone.judges, alone.electorate, alone.needed, alone.convicts) == ((JUDGE,), 2, 2, False)  # 1 of 2
    assert convicted(table, MODEL) == {}
    table.merge(signed_verdict(OTHER_KEY))
    found = convicted(table, MODEL)
    assert list(found) == [ACCUSED]
    assert found[ACCUSED].judges == tuple(sorted([JUDGE, OTHER])) and found[ACCUSED].electorate == 2
    assert found[ACCUSED].as_json() == {
        "accused": ACCUSED, "model": MODEL, "start": 2, "end": 4, "judges": sorted([JUDGE, OTHER]),
        "ignored_judges": [], "electorate": 2, "needed": 2, "convicts": True, "advisory_judges": [],
    }  # fmt: skip
    assert convicted(table, "another-model") == {}


def test_a_lone_framing_judge_cannot_convict_an_honest_server_two_honest_servers_cover():
    table = table_at()
    replicas(table)
    # OTHER frames JUDGE with a receipt JUDGE really signed (any client of JUDGE holds some)
    table.merge(sign(verdict(judge=OTHER, accused=JUDGE, key=JUDGE_KEY), OTHER_KEY))
    (framed,) = tally(table, MODEL)
    assert (framed.accused, framed.judges, framed.electorate, framed.convicts) == (JUDGE, (OTHER,), 2, False)
    assert convicted(table, MODEL) == {}


def test_judges_that_do_not_cover_the_blocks_do_not_count():
    table = table_at()
    partial_key, partial = keys(1, 3)[0]
    replicas(table, (partial_key, (3, 6), State.ONLINE))  # overlaps 2:4, does not cover it
    table.merge(signed_verdict(JUDGE_KEY))
    table.merge(signed_verdict(LOW_KEY))  # serves 0:2
    table.merge(signed_verdict(partial_key))
    outsider_key, outsider = keys(1, 4)[0]  # no server record at all (a client's key)
    table.merge(signed_verdict(outsider_key))
    (result,) = tally(table, MODEL)
    assert result.judges == (JUDGE,) and set(result.ignored) == {LOW, partial, outsider}
    assert (result.electorate, result.needed, result.convicts) == (3, 2, False)  # 3:6 votes, 0:2 does not


def test_servers_of_part_of_the_blocks_vote_without_judging():
    """Partial servers cannot recompute, so never judge; they weigh in the electorate all the same."""
    table = table_at()
    partial_key, partial = keys(1, 3)[0]
    replicas(table, (partial_key, (3, 6), State.ONLINE))
    table.merge(signed_verdict(JUDGE_KEY))
    table.merge(signed_verdict(OTHER_KEY))
    (result,) = tally(table, MODEL)
    assert (result.judges, result.ignored, result.electorate, result.convicts) == (
        tuple(sorted([JUDGE, OTHER])), (), 3, True,
    )  # fmt: skip
    second_key = keys(1, 5)[0][0]
    add_server(table, second_key, (0, 3))  # a second partial server: 2 judges of 4 is no strict majority
    (result,) = tally(table, MODEL)
    assert (result.electorate, result.needed, result.convicts) == (4, 3, False)
    table.merge(signed_verdict(partial_key))  # it signs anyway: still not a judge of 2:4
    (result,) = tally(table, MODEL)
    assert (result.judges, result.ignored, result.convicts) == (tuple(sorted([JUDGE, OTHER])), (partial,), False)
    assert convicted(table, MODEL) == {}


def test_a_judge_cannot_shrink_the_electorate_with_blocks_of_its_own():
    """Finding 1: honest P, H1, H2 serve 2:4, attacker A 3:6 holds a receipt P signed."""
    table = table_at()
    replicas(table, (FOURTH_KEY, (3, 6), State.ONLINE))
    on_its_blocks = sign(verdict(judge=FOURTH, blocks=BlockRange(3, 5)), FOURTH_KEY).data  # receipt of 2:4
    assert not table.merge(on_its_blocks) and table.rejected["bad_receipt"] == 1
    assert table.merge(sign(verdict(judge=FOURTH), FOURTH_KEY).data)  # on the receipt's 2:4: held, not counted
    (result,) = tally(table, MODEL)
    assert (result.judges, result.ignored, result.electorate, result.convicts) == ((), (FOURTH,), 3, False)
    # P also served 3:4 alone for some client: A covers those blocks, but H1 and H2 vote on them too
    receipt = receipt_of(ACCUSED_KEY, 3, 4)
    on_3_4 = verdict(judge=FOURTH, blocks=BlockRange(3, 4), receipt=receipt, now=NOW + 0.5)  # supersedes A's first
    assert table.merge(sign(on_3_4, FOURTH_KEY).data)
    (result,) = tally(table, MODEL)
    assert (result.judges, result.electorate, result.needed, result.convicts) == ((FOURTH,), 3, 2, False)
    assert convicted(table, MODEL) == {}


def test_one_attacker_covering_a_span_honest_servers_split_convicts_nobody():
    """Finding 2: honest P serves 0:6, honest H1 0:3 and H2 3:6, attacker A 0:6: A is the only other
    server covering 0:6, yet H1 and H2 vote."""
    table = table_at()
    for key, span in ((ACCUSED_KEY, (0, 6)), (JUDGE_KEY, (0, 3)), (OTHER_KEY, (3, 6)), (FOURTH_KEY, (0, 6))):
        add_server(table, key, span)
    whole = BlockRange(0, 6)
    table.merge(sign(verdict(judge=FOURTH, blocks=whole, receipt=receipt_of(ACCUSED_KEY, 0, 6)), FOURTH_KEY).data)
    (result,) = tally(table, MODEL)
    assert (result.judges, result.electorate, result.needed, result.convicts) == ((FOURTH,), 3, 2, False)
    assert convicted(table, MODEL) == {}


def test_one_key_alone_never_convicts_even_as_the_whole_electorate():
    table = table_at()
    add_server(table, ACCUSED_KEY, (2, 4))
    add_server(table, FOURTH_KEY, (2, 4))  # the only other server of 2:4: a strict majority of one
    add_server(table, LOW_KEY, (0, 2))
    table.merge(sign(verdict(judge=FOURTH), FOURTH_KEY).data)
    (result,) = tally(table, MODEL)
    assert (result.judges, result.electorate, result.needed, result.convicts) == ((FOURTH,), 1, 2, False)
    assert convicted(table, MODEL) == {}


def test_offline_or_lapsed_servers_neither_judge_nor_vote():
    table = table_at()
    replicas(table, (FOURTH_KEY, (2, 4), State.OFFLINE))
    table.merge(signed_verdict(JUDGE_KEY))
    table.merge(signed_verdict(FOURTH_KEY))  # offline: its verdict does not count
    (result,) = tally(table, MODEL)
    assert (result.judges, result.ignored, result.electorate, result.convicts) == ((JUDGE,), (FOURTH,), 2, False)
    add_server(table, FOURTH_KEY, (2, 4), State.ONLINE, at=NOW + 0.5)  # back online: 2 of 3
    (result,) = tally(table, MODEL, NOW + 1)
    assert (result.electorate, result.convicts) == (3, True)
    # the judges' records lapse (a server that died without an offline record): nobody counts
    assert convicted(table, MODEL, NOW + 150) == {}


def test_the_judge_keeps_re_signing_its_verdicts_before_they_expire():
    clock = [NOW]
    published: list[SignedRecord] = []
    keeper = VerdictKeeper(JUDGE_KEY, published.append, clock=lambda: clock[0])
    first = keeper.add(verdict())
    assert published == [first] and decode(first.data).record == verdict()
    clock[0] = NOW + VERDICT_LIFETIME / 2 - 1
    assert keeper.due() == []
    clock[0] = NOW + VERDICT_LIFETIME / 2
    (fresh,) = keeper.due()
    assert fresh.record.timestamp == clock[0] and fresh.record.expires == clock[0] + VERDICT_LIFETIME
    assert (fresh.record.accused, fresh.record.receipt) == (ACCUSED, first.record.receipt)
    table = RecordTable(SWARM, clock=lambda: clock[0])
    assert table.merge(first) and table.merge(fresh)  # newer: supersedes
    assert keeper.due() == [] and len(keeper) == 1
    with pytest.raises(ValueError):
        keeper.add(verdict(judge=OTHER))  # another judge's verdict cannot be signed with this key


# ---- who stops routing over a convicted server ------------------------------------------------------
def convicting_table(now: float = NOW) -> RecordTable:
    """The accused convicted by both honest replicas, records signed at ``now``."""
    table = table_at(now + 1, signed=now)
    replicas(table, at=now)
    table.merge(signed_verdict(JUDGE_KEY, now=now))
    table.merge(signed_verdict(OTHER_KEY, now=now))
    return table


def fresh() -> float:
    """Now, for tests of code that reads the clock itself (routing): records signed at NOW (import
    time) may have expired by the time a long test run gets here."""
    return float(int(time.time()))


def test_a_server_does_not_measure_a_convicted_next_hop():
    table = convicting_table(fresh())
    node = SimpleNamespace(id=LOW)
    announcement = Announcement(node, LOW_KEY, SWARM, MODEL, BlockRange(0, 2), [], 1.0, GossipConfig())
    announcement.service = SimpleNamespace(table=table)
    assert sorted(announcement.next_hops()) == sorted([JUDGE, OTHER])


class TableNode:
    """Answers ``fetch_table`` with the given records, as a swarm member would."""

    def __init__(self, records: list[bytes]):
        self.reply = Message("result", 1, tensors=[blob(encode_payload(TableReply(records=records, rejected={})))])

    async def request(self, ticket, protocol, message, timeout):
        return self.reply


def test_a_client_reading_the_swarm_table_never_routes_over_a_convicted_server():
    records = [s.data for s in convicting_table(fresh()).records()]
    ticket = Ticket(LOW, ("mem:1",), None, SWARM)
    spans = asyncio.run(swarm_spans(TableNode(records), [ticket], MODEL, 1.0))
    assert sorted(s.peer_id for s in spans) == sorted([JUDGE, OTHER, LOW])


def test_status_lists_verdicts_their_quorum_and_rejections():
    table = convicting_table()
    table.merge(sign(verdict(judge=JUDGE, accused=OTHER, key=OTHER_KEY), JUDGE_KEY))  # a lone verdict
    table.merge(sign_with(verdict(), OTHER_KEY))  # forged: counted
    status = summarize(table, NOW + 1)
    by_accused = {v["accused"]: v for v in status["verdicts"]}
    assert by_accused[ACCUSED]["convicts"] is True and by_accused[ACCUSED]["judges"] == sorted([JUDGE, OTHER])
    assert by_accused[OTHER]["convicts"] is False and by_accused[OTHER]["electorate"] == 2
    assert status["rejected"] == {"bad_signature": 1}
    (model,) = status["models"]
    assert {s["peer"]: s["convicted"] for s in model["servers"]} == {ACCUSED: True, JUDGE: False, OTHER: False,
                                                                     LOW: False}  # fmt: skip
    text = render(status)
    on_them = "2:4): {} of 2 servers on them judged it, 2 needed: {}"
    assert f"verdict against {ACCUSED[:12]} on {MODEL} [" + on_them.format(2, "CONVICTED") in text
    assert f"verdict against {OTHER[:12]} on {MODEL} [" + on_them.format(1, "no quorum") in text
    assert "rejected records: bad_signature 1" in text
    shown = summarize(table, NOW + 1, rejected={"stale": 3, "bad_receipt": 2})["rejected"]  # a peer's counts
    assert shown == {"bad_receipt": 2}  # copies gossip delivers twice are no news
