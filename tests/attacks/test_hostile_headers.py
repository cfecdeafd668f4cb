"""Attack: message headers that declare large messages and never send their data.

A HEAD frame says how many data bytes follow (``n``, up to the receiver's ``max_message_bytes``:
1 GiB by default). A receiver that reserved ``n`` bytes when the header arrived lent every peer
64 MiB of its memory per 49-byte header, held until the stream's idle timeout. Now a message's
buffer grows with the data that arrived (:class:`shoal.wire.messages.Assembler`): a header alone
holds nothing. The attack here runs against a ``shoal serve`` process through the real transport
framing, on every protocol a stranger may open, while an honest session beside it steps.
"""

from __future__ import annotations

import asyncio

import msgpack
import psutil
import pytest
import torch

from shoal.checkpoints import load_span, save_sharded
from shoal.protocols import BLOCKS
from shoal.transport import META, Node
from shoal.wire import FRAME_HEAD, FRAME_PREFIX, Message
from shoal.wire.schema import OpenReply, OpenRequest, StepRequest
from testkit.tiny import tiny_model
from tests.helpers.aio import run
from tests.helpers.servers import CLIENT_CONFIG, inputs, local_forward, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a `shoal serve` process

HEADERS = 1_000
STREAMS = 64  # held open at once, each with one header whose data never comes
DECLARED = 64 << 20  # bytes each header declares
RSS_BOUND = 64 << 20  # the server's resident-memory growth allowed over the whole attack
HIDDEN = 64  # testkit.tiny's


def hostile_head(request_id: int, kind: str) -> bytes:
    """A valid v2 HEAD frame for a ``kind`` message of one f32 tensor of DECLARED bytes."""
    header = {"v": 2, "k": kind, "id": request_id, "m": {}, "t": [["f32", [DECLARED // 4], "raw"]], "n": DECLARED}
    payload = msgpack.packb(header, use_bin_type=True)
    return FRAME_PREFIX.pack(len(payload) + 1, FRAME_HEAD) + payload


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tiny_model("llama", 1)
    return save_sharded(model, model.config, tmp_path_factory.mktemp("tiny-attack"))


def test_a_thousand_headers_without_data_hold_no_memory_and_a_session_beside_them_steps(model_dir):
    """1,000 hostile headers of 64 MiB messages, 64 streams open at a time (forward, on the meta
    protocol and on the blocks one): the server's resident memory grows by at most 64 MiB
    (it grew by GiBs when a header reserved its message), and an honest session opened before the
    attack steps through it with the outputs a local span computes."""
    process = start_server(model_dir, "0:1")
    server = psutil.Process(process.pid)
    span, _ = load_span(model_dir, 0, 1)
    growth = {}

    async def go() -> list[torch.Tensor]:
        async with await Node.start(CLIENT_CONFIG) as node:
            session = await node.open_stream(process.ticket, BLOCKS)
            opened = (await session.request(Message("open", 1, OpenRequest(max_length=32)))).reply(OpenReply)
            outputs = []

            async def honest_step(position: int) -> None:
                meta = StepRequest(session=opened.session, position=position)
                tensors = inputs(HIDDEN, 1, position, seed=position)
                reply = await session.request(Message("step", session.next_id(), meta, tensors))
                assert reply.kind == "result", reply.error_info()
                outputs.append(reply.tensors[0])

            await honest_step(0)
            baseline = server.memory_info().rss
            sent = peak = 0
            while sent < HEADERS:
                wave = min(STREAMS, HEADERS - sent)
                streams = []
                for i in range(wave):
                    protocol = META if i % 2 else BLOCKS  # a ping is capped at 16 MiB: forward on both
                    stream = await node.open_stream(process.ticket, protocol)
                    await stream.send_raw(hostile_head(sent + i, "forward"))
                    streams.append(stream)
                sent += wave
                await honest_step(len(outputs))  # served while the headers wait for their data
                await asyncio.sleep(0.2)  # the server has read every header by now
                peak = max(peak, server.memory_info().rss)
                for stream in streams:
                    await stream.finish()  # the server sees a truncated message and drops it
            growth["bytes"] = peak - baseline
            return outputs

    try:
        outputs = run(go(), timeout=240)
        assert process.proc.poll() is None, "the server died"
    finally:
        stop_server(process)
    print(f"hostile headers: {HEADERS} of {DECLARED >> 20} MiB, {STREAMS} streams at a time: "
          f"server rss growth {growth['bytes'] / 2**20:.1f} MiB")  # fmt: skip
    assert growth["bytes"] <= RSS_BOUND, f"server memory grew {growth['bytes'] / 2**20:.0f} MiB"
    assert len(outputs) == 1 + -(-HEADERS // STREAMS)
    cache = span.allocate_cache(1, 32)
    expected = [local_forward(span, inputs(HIDDEN, 1, p, seed=p), cache, p) for p in range(len(outputs))]
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
