"""Malformed input at live servers in other processes.

* 10,000+ frames at a peer: valid frames mutated field by field, truncated, oversized and random
  ones, with valid requests interleaved. Every bad frame gets an error reply or a closed stream,
  every valid request is served, and the server's memory stays flat.
* Every typed field of every request kind's metadata, mutated (wrong type, missing, an unknown field
  next to it, out of range) at a ``shoal serve`` process: each gets a ``bad_request`` reply naming
  the field, on a stream that stays usable, and the server goes on serving (sessions included). The
  mutations come from the metadata structs themselves, so a new field is fuzzed without a change
  here (a new field *type* or request kind makes this module fail until it is taught it).

The mutations are :mod:`testkit.mutations`' (shared with ``python -m bench.fuzz``).
"""

from __future__ import annotations

import asyncio
import random

import msgpack
import msgspec
import psutil
import pytest
import torch

from shoal.checkpoints import load_span, save_sharded
from shoal.launch import ServerProcess
from shoal.protocols import BLOCKS, WEIGHTS
from shoal.swarm.service import SWARM, blob, blob_bytes
from shoal.transport import META, MessageStream, Node
from shoal.verify.tokens import push_token
from shoal.wire import Message
from shoal.wire.schema import (
    KIND_META,
    Empty,
    Gossip,
    InfoReply,
    OpenReply,
    OpenRequest,
    Ping,
    PushHop,
    PushRequest,
    StepReply,
    StepRequest,
)
from testkit.mutations import (
    HIDDEN,
    MUTATIONS,
    ON_SESSION_STREAM,
    PROTOCOL_OF,
    UNKNOWN_FIELD,
    MetaMutation,
    meta_mutations,
    random_case,
    send_raw_case,
    valid_requests,
)
from testkit.tiny import tiny_model
from tests.helpers.aio import run
from tests.helpers.servers import CLIENT_CONFIG, ONE_THREAD, inputs, local_forward, start_server, stop_server

pytestmark = pytest.mark.timeout(300)

TOTAL_CASES = 10_000
VALID_EVERY = 5
CONCURRENCY = 8
MEMORY_GROWTH_BOUND = 24 * 1024 * 1024


async def send_bad(node: Node, ticket, data: bytes, expected: str | None) -> str:
    """``data`` on a fresh meta stream: answered ``expected`` (None: anything but a hang)."""
    outcome = await send_raw_case(node, ticket, META, data)
    problem = outcome.problem(expected)
    assert problem is None, problem
    return outcome.kind


@pytest.mark.slow
def test_fuzz_ten_thousand_frames_against_a_live_server():
    peer = ServerProcess(["-m", "tests.helpers.peer", "--max-message", str(64 << 20)], env=ONE_THREAD)
    server = psutil.Process(peer.pid)
    assert "tests.helpers.peer" in server.cmdline(), "/proc does not match this PID namespace (use scripts/test)"
    rng = random.Random(20261130)
    stats = {"valid_served": 0, "bad": 0, "frames": 0, "outcomes": {}}
    reasons_seen: set[str] = set()
    rss: dict[int, int] = {}

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            valid_stream = await node.open_stream(peer.ticket, META)
            case = next_mutation = 0
            while case < TOTAL_CASES:
                batch = []
                for _ in range(CONCURRENCY):
                    if case % VALID_EVERY == 0:
                        batch.append(("valid", case))
                    elif case % 3:
                        batch.append(MUTATIONS[next_mutation % len(MUTATIONS)] + (case,))
                        next_mutation += 1
                    else:
                        batch.append((None, random_case(rng), case))
                    case += 1
                tasks, sent = [], {}
                for item in batch:
                    if item[0] == "valid":
                        x = sent[item[1]] = torch.randn(rng.randint(1, 64))
                        tasks.append(valid_stream.request(Message("ping", item[1], Ping(), [x])))
                        stats["frames"] += 2  # HEAD + DATA
                    else:
                        reason, data, _ = item
                        if reason:
                            reasons_seen.add(reason)
                        tasks.append(send_bad(node, peer.ticket, data, reason))
                        stats["frames"] += 1  # at least one (possibly broken) frame
                # valid requests on the shared stream must be sequential: run them first, in order
                valid = [t for t, item in zip(tasks, batch, strict=True) if item[0] == "valid"]
                bad = [t for t, item in zip(tasks, batch, strict=True) if item[0] != "valid"]
                for item, reply in zip([b for b in batch if b[0] == "valid"], [await v for v in valid], strict=True):
                    assert reply.kind == "result" and reply.reply(Empty) == Empty() and reply.id == item[1]
                    assert torch.equal(reply.tensors[0], sent[item[1]])  # echoed
                    stats["valid_served"] += 1
                for outcome in await asyncio.gather(*bad):
                    stats["bad"] += 1
                    stats["outcomes"][outcome] = stats["outcomes"].get(outcome, 0) + 1
                if (case >= 1000 and not rss) or case >= TOTAL_CASES:
                    rss[case] = server.memory_info().rss

    try:
        run(go(), timeout=280)
        assert peer.proc.poll() is None, "server died"
    finally:
        peer.stop()
    assert stats["valid_served"] == TOTAL_CASES // VALID_EVERY
    assert stats["valid_served"] + stats["bad"] == TOTAL_CASES
    assert stats["frames"] >= TOTAL_CASES
    assert reasons_seen == {reason for reason, _ in MUTATIONS}
    growth = rss[max(rss)] - rss[min(rss)]
    print(f"fuzz: {stats}, server rss {rss}, growth {growth / 1e6:.1f} MB")
    assert growth < MEMORY_GROWTH_BOUND, f"server memory grew {growth / 1e6:.1f} MB between cases 1000 and 10000"


# ---- every typed metadata field of every request kind ---------------------------------------------

#: The fields the protocol has today: each must be among those mutated (a guard on the generator).
MUST_COVER = {
    ("open", "$.max_length"),
    ("open", "$.batch_size"),
    ("open", "$.prompts"),
    ("open", "$.adapter"),
    ("forward", "$.prompts"),
    ("forward", "$.adapter"),
    ("forward", "$.receipt"),
    ("backward", "$.prompts"),
    ("backward", "$.adapter"),
    ("step", "$.session"),
    ("step", "$.position"),
    ("step", "$.push"),
    ("step", "$.receipt"),
    *(("step", f"$.push[0][{i}]") for i in range(3)),  # a push hop: [ticket, session, token]
    ("push", "$.session"),
    ("push", "$.token"),
    ("push", "$.position"),
    ("push", "$.step"),
    ("push", "$.push"),
    ("push", "$.receipt"),
    *(("push", f"$.push[0][{i}]") for i in range(3)),
    ("ping", "$.echo"),
    ("gossip", "$.op"),
}


def test_the_generator_covers_every_request_kind_and_field():
    """Pure: a new request kind must get a sample; each field is mutated every applicable way."""
    hop = PushHop(ticket="ticket", session="s", token="k")
    samples = valid_requests("s", "k", hop)
    assert set(samples) == {kind for kind, meta in KIND_META.items() if meta is not None} - {"error"}
    mutations = meta_mutations(samples)
    covered = {(m.kind, m.field) for m in mutations}
    assert covered >= MUST_COVER, MUST_COVER - covered
    hows = {(m.kind, m.field): set() for m in mutations}
    for m in mutations:
        hows[(m.kind, m.field)].add(m.how)
    assert hows[("step", "$.position")] == {"wrong type", "missing", "below range", "above range"}
    assert hows[("open", "$.batch_size")] == {"wrong type", "below range", "above range"}  # optional
    assert hows[("open", "$.adapter")] == {"wrong type", "too long", "too short", "off pattern"}  # optional
    assert hows[("backward", "$.prompts")] == {"wrong type"}
    assert hows[("push", "$.push")] == {"wrong type", "too many"}
    assert hows[("step", "$.push[0][2]")] == {"wrong type", "missing", "too long"}
    assert hows[("gossip", "$.op")] == {"wrong type", "missing", "too long"}
    assert hows[("step", "$.push[0][3]")] == {"unknown field"}
    assert all(hows[(kind, f"$.{UNKNOWN_FIELD}")] == {"unknown field"} for kind in samples)
    for m in mutations:  # each mutation really is invalid, and msgspec's error names what we expect
        with pytest.raises(msgspec.ValidationError) as caught:
            msgspec.convert(m.meta, type(samples[m.kind]), strict=True)
        assert m.names in str(caught.value), (m, str(caught.value))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tiny_model("llama", 1)
    return save_sharded(model, model.config, tmp_path_factory.mktemp("tiny-fuzz"))


@pytest.fixture(scope="module")
def blocks_server(model_dir):
    """One ``shoal serve`` of block 0 in a swarm of its own (so it serves the swarm protocol too)."""
    process = start_server(model_dir, "0:1", "--new-swarm", "--throughput", "10", "--share-counters")
    yield process
    stop_server(process)  # exits cleanly, no traceback logged: nothing above crashed a handler


async def expect_bad_request(stream: MessageStream, mutation: MetaMutation, request_id: int) -> None:
    await stream.send(mutation.message(request_id))
    reply = await stream.recv(10)
    label = f"{mutation.kind} {mutation.field} {mutation.how}: {mutation.meta!r:.200}"
    assert (reply.kind, reply.id) == ("error", request_id), (label, reply.kind)
    code, message = reply.error_info()
    assert code == "bad_request", (label, code, message)
    assert message.startswith(f"invalid {mutation.kind} metadata: ") and mutation.names in message, (label, message)


def test_every_metadata_field_mutated_at_a_live_server(blocks_server, model_dir):
    ticket = blocks_server.ticket
    span, _ = load_span(model_dir, 0, 1)

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            before = (await node.request(ticket, BLOCKS, Message("info", 1))).reply(InfoReply).counters
            session_stream = await node.open_stream(ticket, BLOCKS)
            opened = (await session_stream.request(Message("open", 1, OpenRequest(max_length=16)))).reply(OpenReply)
            hop = PushHop(ticket=str(ticket), session="no-such-session", token="0" * 32)
            mutations = meta_mutations(valid_requests(opened.session, opened.token, hop))
            streams = {p: await node.open_stream(ticket, p) for p in (META, SWARM, WEIGHTS)}
            streams[BLOCKS] = await node.open_stream(ticket, BLOCKS)
            push_stream = await node.open_stream(ticket, BLOCKS)
            on_blocks = 0
            for mutation in mutations:
                if mutation.kind in ON_SESSION_STREAM:
                    stream = session_stream
                elif mutation.kind == "push":
                    stream = push_stream
                else:
                    stream = streams[PROTOCOL_OF.get(mutation.kind, BLOCKS)]
                on_blocks += stream is session_stream or stream is push_stream or stream is streams[BLOCKS]
                await expect_bad_request(stream, mutation, stream.next_id())

            # every stream still works: meta, swarm, and a fresh blocks stream
            ping = await streams[META].request(Message("ping", streams[META].next_id(), Ping(), [torch.arange(3.0)]))
            assert torch.equal(ping.tensors[0], torch.arange(3.0))
            table_request = Message("gossip", streams[SWARM].next_id(), Gossip(op="table"), [blob(b"")])
            table = msgpack.unpackb(blob_bytes(await streams[SWARM].request(table_request)))
            gossip_mutations = sum(m.kind == "gossip" for m in mutations)
            assert table["rejected"].get("malformed", 0) == gossip_mutations > 0
            info = await streams[BLOCKS].request(Message("info", streams[BLOCKS].next_id()))
            assert info.reply(InfoReply).span.blocks.start == 0

            # the session is intact: a step pushed into it (right token) and one of its client
            cache = span.allocate_cache(1, 16)
            prefill, step = inputs(HIDDEN, 2, seed=11), inputs(HIDDEN, 1, start=2, seed=12)
            token = push_token(opened.token, node.id, step=1000, position=0, n=2, receipt=False)  # its own node
            push = PushRequest(session=opened.session, token=token, position=0, step=1000)
            await push_stream.send(Message("push", push_stream.next_id(), push, prefill))
            pushed = await session_stream.recv(10)  # the pushed step is answered on the session's stream
            assert (pushed.kind, pushed.id, pushed.reply(StepReply).position) == ("result", 1000, 2)
            torch.testing.assert_close(pushed.tensors[0], local_forward(span, prefill, cache, 0), rtol=0, atol=1e-4)
            meta = StepRequest(session=opened.session, position=2)
            reply = await session_stream.request(Message("step", session_stream.next_id(), meta, step))
            assert reply.reply(StepReply) == StepReply(position=3)
            torch.testing.assert_close(reply.tensors[0], local_forward(span, step, cache, 2), rtol=0, atol=1e-4)
            await session_stream.request(Message("close", session_stream.next_id()))
            for stream in (*streams.values(), push_stream, session_stream):
                await stream.finish()

            after = (await node.request(ticket, BLOCKS, Message("info", 1))).reply(InfoReply).counters
            counted = ("errors", "sessions_opened", "sessions_closed", "pushes_received", "pushes_rejected", "steps")
            delta = {name: getattr(after, name) - getattr(before, name) for name in counted}
            assert delta == dict(zip(counted, (on_blocks, 1, 1, 1, 0, 2), strict=True))
            return len(mutations)

    sent = run(go(), timeout=120)
    assert sent > 50  # every kind, field and way: 61 today
