"""Malformed input at live servers in other processes.

* 10,000+ frames at a peer: valid frames mutated field by field, truncated, oversized and random
  ones, with valid requests interleaved. Every bad frame gets an error reply or a closed stream,
  every valid request is served, and the server's memory stays flat.
* Every typed field of every request kind's metadata, mutated (wrong type, missing, an unknown field
  next to it, out of range) at a ``shoal serve`` process: each gets a ``bad_request`` reply naming
  the field, on a stream that stays usable, and the server goes on serving (sessions included). The
  mutations come from the metadata structs themselves, so a new field is fuzzed without a change
  here (a new field *type* or request kind makes this module fail until it is taught it).
"""

from __future__ import annotations

import asyncio
import random
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import msgspec.inspect as mi
import psutil
import pytest
import torch

from shoal.checkpoints import load_span, save_sharded
from shoal.errors import ClosedError, WireError
from shoal.launch import ServerProcess
from shoal.protocols import BLOCKS
from shoal.swarm.service import SWARM, blob, blob_bytes
from shoal.transport import META, MessageStream, Node, Protocol, TransportConfig
from shoal.wire import FRAME_DATA, FRAME_HEAD, Message, encode
from shoal.wire.schema import (
    KIND_META,
    BackwardRequest,
    Empty,
    EvidenceRequest,
    ForwardRequest,
    Gossip,
    Hello,
    InfoReply,
    Meta,
    OpenReply,
    OpenRequest,
    Ping,
    PushHop,
    PushRequest,
    StepReply,
    StepRequest,
)
from testkit.tiny import tiny_model
from tests.helpers.aio import run
from tests.helpers.servers import CLIENT_CONFIG, ONE_THREAD, inputs, local_forward, start_server, stop_server

pytestmark = pytest.mark.timeout(300)

TOTAL_CASES = 10_000
VALID_EVERY = 5
CONCURRENCY = 8
MEMORY_GROWTH_BOUND = 24 * 1024 * 1024


def frame(frame_type: int, payload: bytes) -> bytes:
    return struct.pack(">IB", len(payload) + 1, frame_type) + payload


def head(**changes) -> bytes:
    header = {"v": 2, "k": "ping", "id": 7, "m": {"echo": True}, "t": [["f32", [4], "raw"]], "n": 16}
    header.update(changes)
    return frame(FRAME_HEAD, msgpack.packb(header, use_bin_type=True))


DATA16 = frame(FRAME_DATA, bytes(16))
BAD_REQUEST = "bad_request"  # not a frame problem: metadata that fails validation (the stream goes on)

# Field-by-field mutations of a valid message, each with the rejection reason it must produce.
MUTATIONS: list[tuple[str, bytes]] = [
    ("frame_too_large", struct.pack(">IB", 1 << 30, FRAME_HEAD)),
    ("bad_frame", struct.pack(">IB", 0, FRAME_HEAD)),
    ("bad_frame_type", struct.pack(">IB", 5, 7) + b"abcd"),
    ("unexpected_frame", DATA16),
    ("unexpected_frame", head() + head()),
    ("bad_header", frame(FRAME_HEAD, b"\xc1not msgpack")),
    ("bad_header", frame(FRAME_HEAD, msgpack.packb([1, 2]))),
    ("bad_header", head(id=-5) + DATA16),
    ("bad_header", frame(FRAME_HEAD, msgpack.packb({"v": 2, "k": "ping"}))),
    ("bad_header", head(extra=1) + DATA16),
    ("bad_version", head(v=99) + DATA16),
    ("bad_version", head(v=1, m={"x": 1}, t=[["f32", [4]]]) + DATA16),  # what a v1 peer sends
    ("unknown_kind", head(k="launch") + DATA16),
    (BAD_REQUEST, head(m={"echo": "yes"}) + DATA16),
    (BAD_REQUEST, head(m={"a": [[[[[[1]]]]]]}) + DATA16),
    (BAD_REQUEST, head(m=[1, 2]) + DATA16),
    ("bad_tensor", head(t="f32") + DATA16),
    ("bad_tensor", head(t=[["f32", [4]]]) + DATA16),  # a v1 descriptor
    ("bad_tensor", head(t=[["f32", [0], "raw"]] * 65, n=0)),
    ("unknown_dtype", head(t=[["f128", [4], "raw"]]) + DATA16),
    ("unknown_codec", head(t=[["f32", [4], "zstd"]]) + DATA16),
    ("bad_shape", head(t=[["f32", [-4], "raw"]]) + DATA16),
    ("bad_shape", head(t=[["f32", [1] * 9, "raw"]], n=4) + DATA16),
    ("bad_tensor", head(t=[["f32", ["4"], "raw"]]) + DATA16),
    ("size_mismatch", head(n=15) + DATA16),
    ("size_mismatch", head() + frame(FRAME_DATA, bytes(17))),
    ("message_too_large", head(t=[["u8", [1 << 30], "raw"]], n=1 << 30)),
    ("header_too_large", head(m={"pad": "z" * 70_000}) + DATA16),
    ("truncated", head() + frame(FRAME_DATA, bytes(16))[:12]),
    ("truncated", head()[:9]),
]


def random_case(rng: random.Random) -> tuple[str | None, bytes]:
    """Truncated, bit-flipped or random frames: any outcome but a crash or a hang is fine."""
    valid = b"".join(encode(Message("ping", 3, Ping(), [torch.arange(4.0)])))
    choice = rng.randrange(3)
    if choice == 0:
        return None, valid[: rng.randrange(1, len(valid))]
    if choice == 1:
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return None, bytes(data)
    return None, rng.randbytes(rng.randint(1, 300))


async def send_bad(node: Node, ticket, data: bytes, expected: str | None) -> str:
    stream = await node.open_stream(ticket, META)
    await stream.send_raw(data)
    await stream.finish()
    outcome = "closed"
    try:
        reply = await stream.recv(10)
        outcome = reply.kind
        if reply.kind == "error":
            code, _ = reply.error_info()
            reason = reply.meta.reason
            assert (code == "wire" and reason) or (code == BAD_REQUEST and reason is None), reply.meta
            if expected is not None:
                assert (reason or code) == expected, (expected, reply.meta)
        elif expected is not None:
            raise AssertionError(f"{expected}: server answered {reply.kind}")
        await stream.recv(10)  # then the server ends the stream
    except (ClosedError, WireError):
        pass
    if expected is not None and outcome == "closed":
        raise AssertionError(f"{expected}: no error reply")
    return outcome


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
        async with await Node.start(TransportConfig(bind_addr="127.0.0.1:0")) as node:
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
                        batch.append((*random_case(rng), case))
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

HIDDEN = 64  # testkit.tiny's
UNKNOWN_FIELD = "zz_not_a_field"
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
PROTOCOL_OF: dict[str, Protocol] = {"hello": META, "ping": META, "gossip": SWARM}  # others: BLOCKS
ON_SESSION_STREAM = {"step", "close"}  # push arrives on a stream of its own, as from the previous server


@dataclass(frozen=True)
class MetaMutation:
    kind: str
    field: str  # the field's path as msgspec names it in errors, e.g. "$.push[0][1]"
    how: str
    meta: Any  # the metadata sent, as msgpack builtins
    names: str  # what the error message must contain


def _bare(type_: mi.Type) -> mi.Type:
    """The type without metadata, and an optional one (``X | None``) as ``X``: None is a valid value,
    so the mutations are those of ``X``."""
    while True:
        if isinstance(type_, mi.Metadata):
            type_ = type_.type
            continue
        if isinstance(type_, mi.UnionType):
            types = [t for t in type_.types if not isinstance(t, mi.NoneType)]
            if len(types) == 1:
                type_ = types[0]
                continue
        return type_


def _wrong_type(type_: mi.Type) -> Any:
    """A value of another msgpack type than ``type_`` accepts."""
    if isinstance(type_, (mi.IntType, mi.FloatType)):
        return "7"
    if isinstance(type_, (mi.StrType, mi.BytesType)) or (isinstance(type_, mi.EnumType) and issubclass(type_.cls, str)):
        return 7
    if isinstance(type_, mi.BoolType):
        return 1
    if isinstance(type_, (mi.CollectionType, mi.StructType, mi.DictType)):
        return 7
    raise TypeError(f"no wrong-type value for {type_!r}: teach this fuzz test the new field type")


def _out_of_range(type_: mi.Type, valid: Any) -> Iterator[tuple[str, Any]]:
    """Values just outside each bound ``type_`` declares (none if it declares none)."""
    if isinstance(type_, mi.IntType):
        if type_.ge is not None:
            yield "below range", type_.ge - 1
        if type_.gt is not None:
            yield "below range", type_.gt
        if type_.le is not None:
            yield "above range", type_.le + 1
        if type_.lt is not None:
            yield "above range", type_.lt
    elif isinstance(type_, mi.StrType):
        if type_.max_length is not None:
            yield "too long", "x" * (type_.max_length + 1)
        if type_.min_length:
            yield "too short", "x" * (type_.min_length - 1)
        if type_.pattern is not None:
            candidates = ("-x", " x", "x y", "x/y", "")
            yield "off pattern", next(c for c in candidates if not re.search(type_.pattern, c))
    elif isinstance(type_, mi.EnumType):
        yield "not a member", "x-no-such-member"
    elif isinstance(type_, mi.CollectionType) and (type_.max_length is not None or type_.min_length):
        assert valid, "a sample with at least one item is needed to build a collection out of range"
        if type_.max_length is not None:
            yield "too many", [valid[0]] * (type_.max_length + 1)
        if type_.min_length:
            yield "too few", [valid[0]] * (type_.min_length - 1)


def field_mutations(struct: type, valid: Any, path: str = "$") -> Iterator[tuple[str, str, Any, str]]:
    """``(field path, how, mutated value, text the error must contain)`` for every field of
    ``struct`` and of the structs inside it, from msgspec's type information. ``valid`` is a valid
    value in msgpack builtins, holding a sample of every nested struct."""
    info = mi.type_info(struct)
    for index, field in enumerate(info.fields):
        key = index if info.array_like else field.encode_name
        at = f"{path}[{index}]" if info.array_like else f"{path}.{field.encode_name}"
        type_ = _bare(field.type)

        def put(value: Any, key: int | str = key) -> Any:
            copy = list(valid) if info.array_like else dict(valid)
            copy[key] = value
            return copy

        yield at, "wrong type", put(_wrong_type(type_)), f"`{at}`"
        if field.required and info.array_like:
            names = f"at least length {len(info.fields)}, got {index} - at `{path}`"
            yield at, "missing", list(valid[:index]), names
        elif field.required:
            yield at, "missing", {k: v for k, v in valid.items() if k != key}, f"missing required field `{key}`"
        current = valid[key] if info.array_like or key in valid else None
        for how, value in _out_of_range(type_, current):
            yield at, how, put(value), f"`{at}`"
        inner = _bare(type_.item_type) if isinstance(type_, mi.CollectionType) else type_
        if isinstance(inner, mi.StructType):
            assert current, f"the sample of {at} must hold a {inner.cls.__name__} to fuzz inside it"
            if inner is type_:
                for sub in field_mutations(inner.cls, current, at):
                    yield sub[0], sub[1], put(sub[2]), sub[3]
            else:  # a collection of structs: mutate the first item
                for sub in field_mutations(inner.cls, current[0], f"{at}[0]"):
                    yield sub[0], sub[1], put([sub[2], *current[1:]]), sub[3]
    if info.array_like:
        yield f"{path}[{len(info.fields)}]", "unknown field", [*valid, "extra"], f"at most length {len(info.fields)}"
    else:
        yield (
            f"{path}.{UNKNOWN_FIELD}",
            "unknown field",
            {**valid, UNKNOWN_FIELD: 1},
            f"unknown field `{UNKNOWN_FIELD}`",
        )


def valid_requests(session: str, token: str, hop: PushHop) -> dict[str, Meta]:
    """Valid metadata of every request kind, every optional field set (so each is present to be
    mutated, and every nested struct has a sample)."""
    return {
        "hello": Hello(),
        "ping": Ping(echo=False),
        "info": Empty(),
        "forward": ForwardRequest(prompts=True, adapter="lora-1", receipt=True),
        "backward": BackwardRequest(prompts=True, adapter="lora-1"),
        "open": OpenRequest(max_length=16, batch_size=2, prompts=True, adapter="lora-1"),
        "step": StepRequest(session=session, position=0, push=(hop,), receipt=True),
        "push": PushRequest(session=session, token=token, position=0, step=1, push=(hop,), receipt=True),
        "close": Empty(),
        "evidence": EvidenceRequest(model="m", accused="ab" * 32, start=0, end=2, steps=3),
        "gossip": Gossip(op="table"),
    }


def meta_mutations(samples: dict[str, Meta]) -> list[MetaMutation]:
    out = []
    for kind, sample in samples.items():
        valid = msgspec.to_builtins(sample, builtin_types=(bytes,))  # bytes stay bytes (msgpack bin)
        for field, how, meta, names in field_mutations(type(sample), valid):
            out.append(MetaMutation(kind, field, how, meta, names))
    return out


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
    process = start_server(model_dir, "0:1", "--new-swarm", "--throughput", "10")
    yield process
    stop_server(process)  # exits cleanly, no traceback logged: nothing above crashed a handler


def tensors_for(kind: str, seed: int) -> list[torch.Tensor]:
    """Valid tensors for ``kind``: only the metadata of a mutated message is wrong."""
    if kind in ("step", "push", "forward"):
        return inputs(HIDDEN, 1, seed=seed)
    if kind == "backward":
        return [*inputs(HIDDEN, 1, seed=seed), torch.ones(1, 1, HIDDEN)]
    if kind == "ping":
        return [torch.arange(4.0)]
    if kind == "gossip":
        return [blob(b"")]
    return []


async def expect_bad_request(stream: MessageStream, mutation: MetaMutation, request_id: int) -> None:
    raw = msgspec.Raw(msgspec.msgpack.encode(mutation.meta))
    await stream.send(Message(mutation.kind, request_id, raw, tensors_for(mutation.kind, request_id)))
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
            streams = {p: await node.open_stream(ticket, p) for p in (META, SWARM)}
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
            push = PushRequest(session=opened.session, token=opened.token, position=0, step=1000)
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
