"""Transport benchmark: shoal on iroh vs plain asyncio TCP, two processes, one run.

    scripts/isolated python -m bench.transport [--rounds 500] [--mb 64] [--cold]

Prints JSON: for each stack, 1 KB request/response round trips on an open connection
(``rtt_us_median``, ``rtt_us_p99``), ``throughput_mb_s`` for ``--mb`` MB sent as 4 MiB messages
on one stream, streamed (the sender does not wait for each acknowledgement; the receiver
acknowledges each message and the clock stops at the last acknowledgement),
``throughput_acked_mb_s`` for the same messages sent one at a time (each waits for its
acknowledgement: a round trip per message), and ``connect_ms`` (dial + handshake + first round
trip on a warm endpoint).

``--cold``: also the round trip a pipeline sees. In a swarm on one machine, a message arrives at a
process that has waited while another process streamed its weights through the caches. Here a
third process (``--stage-mb`` MB of fp32 weights, one pass of matrix-vector products over them on
all cores) runs before each of ``--cold-rounds`` round trips; ``cold`` reports both stacks' median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import time

import torch

from shoal.heap import freeze_startup_heap
from shoal.omp import child_environment
from shoal.transport import META, Node, Ticket, TransportConfig
from shoal.transport.loop import run as run_loop
from shoal.wire import Message

MESSAGE_BYTES = 4 * 1024 * 1024
TCP_HEADER = struct.Struct(">I")


def _summary(rtts: list[float], streamed_s: float, acked_s: float, total_mb: float, connect_s: float) -> dict:
    rtts = sorted(rtts)
    return {
        "rtt_us_median": round(statistics.median(rtts) * 1e6, 1),
        "rtt_us_p99": round(rtts[int(0.99 * (len(rtts) - 1))] * 1e6, 1),
        "throughput_mb_s": round(total_mb / streamed_s, 1),
        "throughput_acked_mb_s": round(total_mb / acked_s, 1),
        "connect_ms": round(connect_s * 1e3, 2),
    }


async def bench_shoal(ticket: Ticket, rounds: int, total_mb: int) -> dict:
    node = await Node.start(TransportConfig(bind_addr="127.0.0.1:0"))
    try:
        t0 = time.perf_counter()
        await node.request(ticket, META, Message("ping", 1, {"echo": False}))
        connect_s = time.perf_counter() - t0
        stream = await node.open_stream(ticket, META)
        payload = torch.zeros(256, dtype=torch.float32)  # 1 KB
        rtts = []
        for i in range(rounds + 20):
            t = time.perf_counter()
            await stream.request(Message("ping", i, {}, [payload]))
            if i >= 20:  # warm-up excluded
                rtts.append(time.perf_counter() - t)
        block = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        count = total_mb * 1024 * 1024 // MESSAGE_BYTES
        await stream.request(Message("ping", 0, {"echo": False}, [block]))
        t = time.perf_counter()
        for i in range(count):
            await stream.request(Message("ping", i, {"echo": False}, [block]))
        acked_s = time.perf_counter() - t

        async def send_all() -> None:
            for i in range(count):
                await stream.send(Message("ping", i, {"echo": False}, [block]))

        t = time.perf_counter()
        sender = asyncio.create_task(send_all())
        for _ in range(count):
            await stream.recv(60.0)
        await sender
        streamed_s = time.perf_counter() - t
        await stream.finish()
        return _summary(rtts, streamed_s, acked_s, total_mb, connect_s)
    finally:
        await node.close()


async def _tcp_read_message(reader: asyncio.StreamReader) -> bytes:
    (size,) = TCP_HEADER.unpack(await reader.readexactly(TCP_HEADER.size))
    return await reader.readexactly(size)


async def serve_tcp() -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await _tcp_read_message(reader)
                reply = data if len(data) <= 4096 else b"ok"
                writer.write(TCP_HEADER.pack(len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def bench_tcp(port: int, rounds: int, total_mb: int) -> dict:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def request(data: bytes) -> bytes:
        writer.write(TCP_HEADER.pack(len(data)) + data)
        await writer.drain()
        return await _tcp_read_message(reader)

    await request(b"hi")
    connect_s = time.perf_counter() - t0
    rtts = []
    payload = bytes(1024)
    for i in range(rounds + 20):
        t = time.perf_counter()
        await request(payload)
        if i >= 20:
            rtts.append(time.perf_counter() - t)
    block = bytes(MESSAGE_BYTES)
    count = total_mb * 1024 * 1024 // MESSAGE_BYTES
    t = time.perf_counter()
    for _ in range(count):
        await request(block)
    acked_s = time.perf_counter() - t

    async def send_all() -> None:
        for _ in range(count):
            writer.write(TCP_HEADER.pack(len(block)) + block)
            await writer.drain()

    t = time.perf_counter()
    sender = asyncio.create_task(send_all())
    for _ in range(count):
        await _tcp_read_message(reader)
    await sender
    streamed_s = time.perf_counter() - t
    writer.close()
    return _summary(rtts, streamed_s, acked_s, total_mb, connect_s)


def run_stage(megabytes: int) -> None:
    """A stand-in pipeline stage: one pass over ``megabytes`` of weights per byte read on stdin."""
    torch.set_num_threads(os.cpu_count() or 1)
    rows = 2816
    weights = [torch.randn(rows, 1024) for _ in range(max(1, megabytes * 2**20 // (rows * 1024 * 4)))]
    x = torch.randn(1024)
    while sys.stdin.buffer.read(1):
        for w in weights:
            w @ x
        sys.stdout.buffer.write(b"k")
        sys.stdout.buffer.flush()


class Stage:
    """The stand-in stage in a child process, with the OpenMP spin count shoal's servers use (a
    stage whose workers spun on for milliseconds would take a core from the round trip)."""

    def __init__(self, megabytes: int):
        args = [sys.executable, "-m", "bench.transport", "--stage", str(megabytes)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_environment())
        self.run()  # allocated and warm

    def run(self) -> None:
        self.proc.stdin.write(b"g")
        self.proc.stdin.flush()
        if self.proc.stdout.read(1) != b"k":
            raise RuntimeError("the stage process died")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


async def cold_rtts(ticket: Ticket, port: int, stage: Stage, rounds: int) -> dict:
    """Round trips each right after the stage ran: shoal's and TCP's, interleaved."""
    node = await Node.start(TransportConfig(bind_addr="127.0.0.1:0"))
    try:
        stream = await node.open_stream(ticket, META)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = torch.zeros(1024, dtype=torch.float32)  # 4 KB: a hidden state of a 1024-wide model
        shoal_rtts, tcp_rtts = [], []
        for i in range(rounds + 3):
            stage.run()
            t = time.perf_counter()
            await stream.request(Message("ping", i, {}, [payload]))
            shoal_rtts.append(time.perf_counter() - t)
            stage.run()
            t = time.perf_counter()
            writer.write(TCP_HEADER.pack(4096) + bytes(4096))
            await writer.drain()
            await _tcp_read_message(reader)
            tcp_rtts.append(time.perf_counter() - t)
        writer.close()
        await stream.finish()
        return {
            "shoal_iroh_rtt_us_median": round(statistics.median(shoal_rtts[3:]) * 1e6, 1),
            "asyncio_tcp_rtt_us_median": round(statistics.median(tcp_rtts[3:]) * 1e6, 1),
        }
    finally:
        await node.close()


async def run_server() -> None:
    node = await Node.start(TransportConfig(bind_addr="127.0.0.1:0"))
    tcp = await serve_tcp()
    port = tcp.sockets[0].getsockname()[1]
    print(json.dumps({"ticket": str(node.ticket()), "tcp_port": port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent ends
    tcp.close()
    await node.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--cold", action="store_true", help="also round trips right after a stand-in stage ran")
    parser.add_argument("--cold-rounds", type=int, default=60)
    parser.add_argument("--stage-mb", type=int, default=400)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    freeze_startup_heap()  # as shoal's own long-lived processes do (see shoal.heap)
    if args.serve:
        run_loop(run_server())
        return
    if args.stage:
        run_stage(args.stage)
        return
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.transport", "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        hello = json.loads(server.stdout.readline())
        ticket = Ticket.parse(hello["ticket"])
        result = {
            "shoal_iroh": run_loop(bench_shoal(ticket, args.rounds, args.mb)),
            "asyncio_tcp": run_loop(bench_tcp(hello["tcp_port"], args.rounds, args.mb)),
            "message_bytes": MESSAGE_BYTES,
            "total_mb": args.mb,
        }
        if args.cold:
            stage = Stage(args.stage_mb)
            try:
                cold = run_loop(cold_rtts(ticket, hello["tcp_port"], stage, args.cold_rounds))
            finally:
                stage.close()
            result["cold"] = {"stage_mb": args.stage_mb, "rounds": args.cold_rounds, **cold}
        result["targets_met"] = {
            "throughput_mb_s>=100": result["shoal_iroh"]["throughput_mb_s"] >= 100,
            "rtt_us_median<=1000": result["shoal_iroh"]["rtt_us_median"] <= 1000,
        }
        print(json.dumps(result, indent=2))
    finally:
        server.stdin.close()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
