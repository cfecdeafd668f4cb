"""Wire version 2 against a live ``shoal serve`` process: a v1 peer is refused with both versions
named (in frames and in the ALPN), unknown kinds and codecs are refused without taking the server
down, and peers announce their capabilities (``info`` and ``hello``)."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from shoal.checkpoints import save_sharded
from shoal.errors import BadRequest, ClosedError, ProtocolMismatch, WireError
from shoal.protocols import BLOCKS
from shoal.swarm.service import blob
from shoal.transport import META, MessageStream, Node, Protocol
from shoal.wire import CAPABILITIES, FRAME_HEAD, Message, encode
from shoal.wire.schema import CODEC_RAW, PUSH, Gossip, HelloReply, InfoReply, Ping
from testkit.tiny import tiny_model
from tests.helpers.aio import run
from tests.helpers.servers import CLIENT_CONFIG, start_server, stop_server

pytestmark = pytest.mark.timeout(120)

OLD_BLOCKS = Protocol("blocks", 1)


def raw_frame(header: dict, frame_type: int = FRAME_HEAD) -> bytes:
    """A frame as any version writes it: ``u32 length | u8 type | payload``."""
    payload = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">IB", len(payload) + 1, frame_type) + payload


def v1_info() -> bytes:
    return raw_frame({"v": 1, "k": "info", "id": 1, "m": {}, "t": [], "n": 0})


def v1_step() -> bytes:
    """A v1 step: untyped metadata, ``[dtype, shape]`` descriptors, then its data."""
    header = {"v": 1, "k": "step", "id": 2, "m": {"session": "s", "position": 0}, "t": [["f32", [1, 1, 64]]], "n": 256}
    return raw_frame(header) + struct.pack(">IB", 257, 2) + bytes(256)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model("llama", 2)
    process = start_server(save_sharded(model, model.config, tmp_path_factory.mktemp("tiny-v2")), "0:1")
    yield process
    stop_server(process)  # a clean exit without a logged traceback


async def wire_error_reply(stream: MessageStream, data: bytes) -> tuple[str, str, str | None, int]:
    """Send raw bytes; return the error reply's code, message, reason and id, after checking that
    the server then ended the stream (framing is lost after a wire error)."""
    await stream.send_raw(data)
    reply = await stream.recv(10)
    assert reply.kind == "error", reply
    code, message = reply.error_info()
    with pytest.raises(ClosedError):
        await stream.recv(10)
    return code, message, reply.meta.reason, reply.id


async def still_serving(node: Node, server) -> InfoReply:
    return (await node.request(server.ticket, BLOCKS, Message("info", 1))).reply(InfoReply)


def test_the_blocks_alpn_moved_on_from_version_1():
    assert BLOCKS.name == "blocks" and BLOCKS.version >= 2 and BLOCKS != OLD_BLOCKS


@pytest.mark.parametrize("frames", [v1_info(), v1_step()], ids=["info", "step-with-data"])
@pytest.mark.parametrize("protocol", [META, BLOCKS], ids=lambda p: p.name)
def test_v1_frames_are_refused_with_both_versions_named(server, protocol, frames):
    """``shoal/meta/1`` kept its ALPN, so a v1 peer reaches it and learns from the reply why it
    cannot go on; a v2 ALPN stream refuses v1 frames the same way."""

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            stream = await node.open_stream(server.ticket, protocol)
            code, message, reason, request_id = await wire_error_reply(stream, frames)
            assert (code, reason, request_id) == ("wire", "bad_version", 0)
            assert "peer speaks wire version 1, this peer speaks 2" in message
            return (await still_serving(node, server)).span.blocks.end

    assert run(go(), timeout=60) == 1


def test_a_v1_reply_is_refused_by_a_v2_client():
    """The other direction: a v2 client reading a v1 peer's reply raises the version error."""
    legacy = Protocol("legacy", 1)

    async def v1_peer(stream: MessageStream, peer_id: str) -> None:
        await stream.recv(10)
        await stream.send_raw(raw_frame({"v": 1, "k": "result", "id": 1, "m": {"x": 1}, "t": [], "n": 0}))

    async def go():
        async with (
            await Node.start(CLIENT_CONFIG, {legacy: v1_peer}) as old,
            await Node.start(CLIENT_CONFIG) as new,
        ):
            with pytest.raises(WireError, match="peer speaks wire version 1, this peer speaks 2") as caught:
                await new.request(old.ticket(), legacy, Message("ping", 1, Ping()), timeout=10)
            assert caught.value.reason == "bad_version"

    run(go(), timeout=60)


def test_dialling_the_old_blocks_alpn_names_both_sides_protocols(server):
    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            with pytest.raises(ProtocolMismatch) as caught:
                await node.open_stream(server.ticket, OLD_BLOCKS, timeout=10)
            return caught.value

    error = run(go(), timeout=60)
    assert error.wanted == "shoal/blocks/1"
    assert error.remote_speaks == sorted([str(BLOCKS), str(META)])
    assert "shoal/blocks/1" in str(error) and str(BLOCKS) in str(error)


UNKNOWN = {
    "unknown_kind": (
        {"v": 2, "k": "teleport", "id": 4, "m": {}, "t": [], "n": 0},
        "'teleport'",
    ),
    "unknown_codec": (
        {"v": 2, "k": "forward", "id": 4, "m": {}, "t": [["f32", [1, 1, 64], "zstd"]], "n": 256},
        "tensor codec 'zstd' (this peer knows: bf16, fp16, q8, raw)",
    ),
}


@pytest.mark.parametrize("reason", sorted(UNKNOWN))
def test_unknown_kinds_and_codecs_are_refused_and_the_server_goes_on(server, reason):
    header, names = UNKNOWN[reason]

    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            stream = await node.open_stream(server.ticket, BLOCKS)
            code, message, got, request_id = await wire_error_reply(stream, raw_frame(header))
            assert (code, got, request_id) == ("wire", reason, 0) and names in message
            assert (await still_serving(node, server)).span.blocks.start == 0

    run(go(), timeout=60)
    with pytest.raises(WireError) as caught:  # nor does a v2 peer send one
        encode(Message("teleport"))
    assert caught.value.reason == "unknown_kind"


def test_a_known_kind_of_another_protocol_is_a_bad_request_on_a_usable_stream(server):
    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            stream = await node.open_stream(server.ticket, BLOCKS)
            with pytest.raises(BadRequest, match="'gossip' is not a request of this protocol"):
                await stream.request(Message("gossip", 3, Gossip(op="table"), [blob(b"")]), timeout=10)
            with pytest.raises(BadRequest, match="'hello' is not a request of this protocol"):
                await stream.request(Message("hello", 4), timeout=10)
            reply = await stream.request(Message("info", 5), timeout=10)  # the same stream goes on
            await stream.finish()
            return reply.reply(InfoReply)

    assert run(go(), timeout=60).span.hidden_size == 64


def test_info_and_hello_announce_the_capabilities(server):
    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            info = await still_serving(node, server)
            hello = (await node.request(server.ticket, META, Message("hello", 1), timeout=10)).reply(HelloReply)
            return info, hello

    info, hello = run(go(), timeout=60)
    assert {PUSH, CODEC_RAW} <= CAPABILITIES
    assert info.span.capabilities == CAPABILITIES
    assert hello.capabilities == CAPABILITIES
    assert hello.protocols == sorted([str(BLOCKS), str(META)])


def test_ping_echoes_unless_told_not_to(server):
    async def go():
        async with await Node.start(CLIENT_CONFIG) as node:
            x = torch.arange(5.0)
            echoed = await node.request(server.ticket, META, Message("ping", 1, Ping(), [x]), timeout=10)
            silent = await node.request(server.ticket, META, Message("ping", 2, Ping(echo=False), [x]), timeout=10)
            return echoed.tensors, silent.tensors

    echoed, silent = run(go(), timeout=60)
    assert len(echoed) == 1 and torch.equal(echoed[0], torch.arange(5.0)) and silent == []
