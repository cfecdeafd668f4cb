"""Helpers for the swarm registry tests (tests/integration/test_registry.py).

* :func:`process_swarm`: ``shoal serve`` processes in one swarm (:class:`shoal.launch.LocalSwarm`), on
  loopback, with short gossip periods (:data:`SWARM_FLAGS`), one torch thread each (the routing and
  gateway tests use it too); :class:`RegistrySwarm` names their spans and throughputs.
* :func:`fetch_view` / :func:`poll_views`: read every server's table through a test :class:`Node`
  (op ``table``), polled until a condition holds for each peer, with a deadline; an optional
  ``invariant`` is checked on every view seen on the way.
* :class:`TestPeer`: a test node that speaks the swarm protocol (a :class:`SwarmService` with its own
  table), so records it names are real peers; it injects records through the gossip ops.
* forging helpers: records signed by the wrong key, tampered bodies, and so on.
* a client in its own process:

      python -m tests.helpers.registry client MODEL_DIR TICKET NEW_TOKENS

  joins the swarm through ``TICKET`` only, generates ``NEW_TOKENS`` greedy tokens for
  :data:`PROMPT` and prints one line ``result: {json}`` with the tokens, the chain it routes over
  and every server span it saw in the swarm's table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.ids import BlockRange
from shoal.launch import LocalSwarm, ServerProcess
from shoal.swarm.gossip import GossipConfig
from shoal.swarm.messages import (
    OfferReply,
    OfferRequest,
    Payload,
    PushReply,
    PushRequest,
    SyncReply,
    SyncRequest,
    decode_payload,
    encode_payload,
)
from shoal.swarm.records import SIGNING_CONTEXT, Record, ServerRecord, SignedRecord, State, decode, sign
from shoal.swarm.service import SWARM, SwarmService, blob, blob_bytes, fetch_table
from shoal.swarm.table import RecordTable
from shoal.transport import Node, Ticket, TransportConfig
from shoal.transport.identity import generate_key
from shoal.wire import Message
from shoal.wire.schema import Gossip

LOOPBACK = TransportConfig(bind_addr="127.0.0.1:0")
PERIOD = 0.5  # --gossip-period
REFRESH = 1.0  # --refresh-period
EXPIRY = 3.0  # --expiry
ROUND = PERIOD * 1.2  # a round lasts period * uniform(0.8, 1.2): the longest one
SWARM_FLAGS = ("--gossip-period", str(PERIOD), "--refresh-period", str(REFRESH), "--expiry", str(EXPIRY))
GOSSIP = GossipConfig(period=PERIOD, refresh=REFRESH, expiry=EXPIRY)
PROMPT = [1, 17, 42, 99, 7, 3]
FETCH_TIMEOUT = 5.0

Span = tuple[int, int]


# ---- server processes ------------------------------------------------------------------------------
ONE_THREAD = ("--num-threads", "1")
ENV = {"OMP_NUM_THREADS": "1"}


def process_swarm(model_dir: Path, *extra: str) -> LocalSwarm:
    """``shoal serve`` processes of one swarm over ``model_dir`` (none started yet): one torch and
    OpenMP thread each, the short gossip periods, ``extra`` flags."""
    return LocalSwarm(model_dir, extra_args=(*ONE_THREAD, *SWARM_FLAGS, *extra), swarm=True, env=ENV, ready_timeout=120)


@dataclass
class Server:
    span: Span
    throughput: float
    process: ServerProcess
    stopped: bool = False  # stopped or killed on purpose

    @property
    def ticket(self) -> Ticket:
        return self.process.ticket

    @property
    def peer(self) -> str:
        return self.process.ticket.peer_id

    def output(self) -> str:
        return self.process.text()


class RegistrySwarm:
    """Server processes of one swarm over ``model_dir``, each announcing the throughput it is given;
    :meth:`close` stops every one still running."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.processes = process_swarm(self.model_dir)
        self.servers: list[Server] = []  # every server ever started, in start order
        self.swarm_id: str | None = None

    def found(self, span: Span, throughput: float) -> Server:
        (server,) = self.join_all([(span, throughput)], None)
        self.swarm_id = server.ticket.swarm_id
        return server

    def join_all(self, specs: Sequence[tuple[Span, float]], join: Ticket | None) -> list[Server]:
        """One server per ``(span, throughput)``, joining through ``join``, in parallel; all must start."""
        extra = [("--throughput", str(throughput)) for _, throughput in specs]
        started = self.processes.start([span for span, _ in specs], extra, join)
        servers = [Server(span, throughput, p) for (span, throughput), p in zip(specs, started, strict=True)]
        self.servers += servers
        return servers

    @property
    def running(self) -> list[Server]:
        return [s for s in self.servers if s.process.alive]

    def tickets(self, servers: Sequence[Server] | None = None) -> dict[str, Ticket]:
        return {s.peer: s.ticket for s in (self.running if servers is None else servers)}

    def check_alive(self) -> None:
        self.processes.check_alive(expected_gone=[s.process for s in self.servers if s.stopped])

    def close(self, timeout: float = 15.0) -> None:
        self.processes.stop(timeout)


# ---- reading tables --------------------------------------------------------------------------------
@dataclass
class View:
    """One peer's table as its ``table`` op answered it."""

    peer: str
    at: float  # time.monotonic() when the answer arrived
    records: dict[str, SignedRecord]
    data: set[bytes]
    rejected: Counter

    def server(self, peer: str) -> ServerRecord | None:
        signed = self.records.get(f"s:{peer}")
        return signed.record if signed is not None else None

    def servers(self) -> dict[str, ServerRecord]:
        return {s.record.peer: s.record for s in self.records.values() if isinstance(s.record, ServerRecord)}


async def fetch_view(node: Node, ticket: Ticket) -> View:
    table = await fetch_table(node, ticket, FETCH_TIMEOUT)
    records = {}
    for data in table.records:
        signed = decode(data)  # a server's table holds only records that decode and verify
        records[signed.key] = signed
    return View(ticket.peer_id, time.monotonic(), records, set(table.records), Counter(table.rejected))


async def poll_views(
    node: Node,
    tickets: dict[str, Ticket],
    done: Callable[[View], bool],
    timeout: float,
    invariant: Callable[[View], None] | None = None,
    interval: float = 0.05,
    what: str = "condition",
) -> dict[str, float]:
    """Read every peer's table every ``interval`` until ``done`` holds for each peer (once it held,
    that peer is no longer asked unless ``invariant`` is given: then every peer is read until all
    are done). Returns each peer's first time (monotonic) it held; AssertionError after ``timeout``
    with the views that did not satisfy it."""
    started = time.monotonic()
    first: dict[str, float] = {}
    last: dict[str, View] = {}
    while True:
        asked = [p for p in tickets if invariant is not None or p not in first]
        views = await asyncio.gather(*(fetch_view(node, tickets[p]) for p in asked))
        for view in views:
            last[view.peer] = view
            if invariant is not None:
                invariant(view)
            if view.peer not in first and done(view):
                first[view.peer] = view.at
        if len(first) == len(tickets):
            return first
        if time.monotonic() - started > timeout:
            missing = {p[:10]: sorted(last[p].records) for p in tickets if p not in first}
            raise AssertionError(f"{what} not reached within {timeout:.2f} s by peers (their keys): {missing}")
        await asyncio.sleep(interval)


# ---- a test peer speaking the swarm protocol -------------------------------------------------------
GOSSIP_OPS: dict[str, tuple[Callable[[object], Payload], type[Payload]]] = {
    "offer": (lambda digest: OfferRequest(digest=digest), OfferReply),
    "push": (lambda records: PushRequest(records=records), PushReply),
    "sync": (lambda digest: SyncRequest(digest=digest), SyncReply),
}


class TestPeer:
    """A node with its own key and a :class:`SwarmService` answering gossip (no rounds of its own:
    it only publishes what a test injects)."""

    __test__ = False  # not a pytest class

    def __init__(self, swarm: str):
        self.swarm = swarm
        self.key = generate_key()
        self.table = RecordTable(swarm)
        self.node: Node | None = None
        self.service: SwarmService | None = None

    async def __aenter__(self) -> TestPeer:
        handlers = {SWARM: lambda stream, peer: self.service.handle(stream, peer)}
        self.node = await Node.start(LOOPBACK, handlers, secret_key=self.key)
        self.service = SwarmService(self.node, self.table, GOSSIP, [])
        return self

    async def __aexit__(self, *exc) -> None:
        await self.service.stop()
        await self.node.close()

    @property
    def id(self) -> str:
        return self.node.id

    async def op(self, ticket: Ticket, op: str, value) -> Payload:
        """One gossip request to ``ticket``'s peer: ``offer`` or ``sync`` of the digest ``value``, or
        ``push`` of the records ``value``; its reply, validated."""
        request, reply_type = GOSSIP_OPS[op]
        message = Message("gossip", 1, Gossip(op=op), [blob(encode_payload(request(value)))])
        reply = await self.node.request(ticket, SWARM, message, FETCH_TIMEOUT)
        return decode_payload(blob_bytes(reply), reply_type)

    def own_record(self, fingerprints: Sequence[bytes], model: str, span: Span, state: State, lifetime: float):
        now = time.time()
        ticket = self.node.ticket()
        record = server_record(
            self.swarm, self.id, model, span, fingerprints, now, lifetime, state=state, addrs=ticket.addrs
        )
        return sign(record, self.key)


# ---- records, valid and forged ---------------------------------------------------------------------
def peer_id(key: bytes) -> str:
    return Ed25519PrivateKey.from_private_bytes(key).public_key().public_bytes_raw().hex()


def server_record(
    swarm: str,
    peer: str,
    model: str,
    span: Span,
    fingerprints: Sequence[bytes],
    now: float,
    lifetime: float,
    *,
    state: State = State.ONLINE,
    addrs: Sequence[str] = ("127.0.0.1:9",),
    throughput: float = 1234.5,
    cache_tokens_free: int = 100,
) -> ServerRecord:
    return ServerRecord(
        swarm=swarm, peer=peer, addrs=tuple(addrs), relay=None, model=model, blocks=BlockRange(*span),
        fingerprints=tuple(fingerprints), state=state, throughput=throughput, cache_tokens_free=cache_tokens_free,
        rtts=(),
        version="test", timestamp=now, expires=now + lifetime,
    )  # fmt: skip


def sign_with(record: Record, key: bytes) -> bytes:
    """``record`` signed by ``key`` whether or not the key is the signer's (``sign`` refuses that)."""
    body = msgpack.packb([record.TAG, 1, *record.fields()], use_bin_type=True)
    signature = Ed25519PrivateKey.from_private_bytes(key).sign(SIGNING_CONTEXT + body)
    return msgpack.packb([body, signature], use_bin_type=True)


def split(data: bytes) -> tuple[bytes, bytes]:
    body, signature = msgpack.unpackb(data, raw=False)
    return body, signature


def with_body(data: bytes, body: bytes) -> bytes:
    """``data`` with its body replaced and its signature kept."""
    return msgpack.packb([body, split(data)[1]], use_bin_type=True)


def bump_float(data: bytes, value: float) -> bytes:
    """Tamper: the float64 ``value`` in the body (e.g. the timestamp) becomes the next larger
    float, a change of the last byte or so; the signature is kept."""
    body = split(data)[0]
    old, new = b"\xcb" + struct.pack(">d", value), b"\xcb" + struct.pack(">d", math.nextafter(value, math.inf))
    assert body.count(old) == 1, "the float must occur once in the body"
    tampered = body.replace(old, new)
    assert sum(a != b for a, b in zip(body, tampered, strict=True)) == 1, "a one-byte flip"
    return with_body(data, tampered)


def with_field(data: bytes, index: int, value) -> bytes:
    """Tamper: field ``index`` of the record (0 = swarm, as in ``fields()``) set to ``value``, the
    body re-packed, the signature kept."""
    fields = msgpack.unpackb(split(data)[0], raw=False)
    fields[2 + index] = value
    return with_body(data, msgpack.packb(fields, use_bin_type=True))


STATE_FIELD = 8  # index of ``state`` in ServerRecord.fields()


@dataclass
class Forgeries:
    """Records that no table may ever hold, by name; ``fresh_keys`` are keys no table holds either."""

    records: dict[str, bytes] = field(default_factory=dict)
    fresh_keys: set[str] = field(default_factory=set)
    expected: Counter = field(default_factory=Counter)  # rejection reason -> count, per injection

    def add(self, name: str, data: bytes, reason: str, fresh_key: str | None = None) -> None:
        self.records[name] = data
        self.expected[reason] += 1
        if fresh_key is not None:
            self.fresh_keys.add(fresh_key)

    def digest(self) -> list[list]:
        out = []
        for data in self.records.values():
            fields = msgpack.unpackb(split(data)[0], raw=False)
            key = ("s:" + fields[3]) if fields[0] == ServerRecord.TAG else ("m:" + fields[4])
            timestamp = fields[2 + (13 if fields[0] == ServerRecord.TAG else 5)]
            out.append([key, timestamp])
        return out

    def check_absent(self, view: View) -> None:
        leaked = [name for name, data in self.records.items() if data in view.data]
        leaked += [key for key in self.fresh_keys if key in view.records]
        assert not leaked, f"forged records in the table of {view.peer[:10]}: {leaked}"


# ---- a client in its own process -------------------------------------------------------------------
def client_main(model_dir: str, ticket: str, new_tokens: int) -> None:
    import torch

    from shoal.checkpoints import model_name
    from shoal.client import AutoDistributedModelForCausalLM
    from shoal.client.remote.listing import swarm_spans

    torch.set_num_threads(1)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=[ticket], transport=LOOPBACK)
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=new_tokens, do_sample=False)
        blocks = model.blocks
        seen = blocks.runtime.run(swarm_spans(blocks.node, [Ticket.parse(ticket)], model_name(model_dir), 10.0))
        result = {
            "tokens": out[0, len(PROMPT) :].tolist(),
            "chain": [[s.peer_id, s.start, s.end] for s in blocks.chain],
            "seen": sorted([s.peer_id, s.start, s.end] for s in seen),
        }
    finally:
        model.close()
    print("result: " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    client = sub.add_parser("client")
    client.add_argument("model_dir")
    client.add_argument("ticket")
    client.add_argument("new_tokens", type=int)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    client_main(args.model_dir, args.ticket, args.new_tokens)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
