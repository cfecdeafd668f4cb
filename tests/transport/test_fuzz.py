"""10,000+ frames at a live server in another process: valid frames mutated field by field,
truncated, oversized and random ones, with valid requests interleaved. Every bad frame gets an
error reply or a closed stream, every valid request is served, and the server's memory stays flat."""

from __future__ import annotations

import asyncio
import random
import struct

import msgpack
import psutil
import pytest
import torch

from shoal.errors import ClosedError, WireError
from shoal.transport import META, Node, TransportConfig
from shoal.wire import FRAME_DATA, FRAME_HEAD, Message, encode
from tests.helpers.aio import run
from tests.helpers.processes import PeerProcess

pytestmark = pytest.mark.timeout(300)

TOTAL_CASES = 10_000
VALID_EVERY = 5
CONCURRENCY = 8
MEMORY_GROWTH_BOUND = 24 * 1024 * 1024


def frame(frame_type: int, payload: bytes) -> bytes:
    return struct.pack(">IB", len(payload) + 1, frame_type) + payload


def head(**changes) -> bytes:
    header = {"v": 1, "k": "ping", "id": 7, "m": {"x": 1}, "t": [["f32", [4]]], "n": 16}
    header.update(changes)
    return frame(FRAME_HEAD, msgpack.packb(header, use_bin_type=True))


DATA16 = frame(FRAME_DATA, bytes(16))

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
    ("bad_header", frame(FRAME_HEAD, msgpack.packb({"v": 1, "k": "ping"}))),
    ("bad_version", head(v=99) + DATA16),
    ("unknown_kind", head(k="launch") + DATA16),
    ("bad_meta", head(m={"a": [[[[[[1]]]]]]}) + DATA16),
    ("bad_meta", head(m=[1, 2]) + DATA16),
    ("bad_tensor", head(t="f32") + DATA16),
    ("bad_tensor", head(t=[["f32", [0]]] * 65, n=0)),
    ("unknown_dtype", head(t=[["f128", [4]]]) + DATA16),
    ("bad_shape", head(t=[["f32", [-4]]]) + DATA16),
    ("bad_shape", head(t=[["f32", [1] * 9]], n=4) + DATA16),
    ("bad_shape", head(t=[["f32", ["4"]]]) + DATA16),
    ("size_mismatch", head(n=15) + DATA16),
    ("size_mismatch", head() + frame(FRAME_DATA, bytes(17))),
    ("message_too_large", head(t=[["u8", [1 << 30]]], n=1 << 30)),
    ("header_too_large", head(m={"pad": "z" * 70_000}) + DATA16),
    ("truncated", head() + frame(FRAME_DATA, bytes(16))[:12]),
    ("truncated", head()[:9]),
]


def random_case(rng: random.Random) -> tuple[str | None, bytes]:
    """Truncated, bit-flipped or random frames: any outcome but a crash or a hang is fine."""
    valid = b"".join(encode(Message("ping", 3, {"k": "v"}, [torch.arange(4.0)])))
    choice = rng.randrange(3)
    if choice == 0:
        return None, valid[: rng.randrange(1, len(valid))]
    if choice == 1:
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return None, bytes(data)
    return None, rng.randbytes(rng.randint(1, 300))


async def send_bad(node: Node, ticket, data: bytes, expected: str | None) -> tuple[str, int]:
    stream = await node.open_stream(ticket, META)
    await stream.send_raw(data)
    await stream.finish()
    outcome = "closed"
    try:
        reply = await stream.recv(10)
        outcome = reply.kind
        if reply.kind == "error":
            assert reply.meta["code"] in ("wire", "bad_request"), reply.meta
            if expected is not None:
                assert reply.meta.get("reason") == expected, (expected, reply.meta)
        elif expected is not None:
            raise AssertionError(f"{expected}: server answered {reply.kind}")
        await stream.recv(10)  # then the server ends the stream
    except (ClosedError, WireError):
        pass
    if expected is not None and outcome == "closed":
        raise AssertionError(f"{expected}: no error reply")
    return outcome


def test_fuzz_ten_thousand_frames_against_a_live_server():
    peer = PeerProcess(["-m", "tests.helpers.peer", "--max-message", str(64 << 20)])
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
                tasks = []
                for item in batch:
                    if item[0] == "valid":
                        x = torch.randn(rng.randint(1, 64))
                        tasks.append(valid_stream.request(Message("ping", item[1], {"i": item[1]}, [x])))
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
                    assert reply.kind == "result" and reply.meta == {} and reply.id == item[1]
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
