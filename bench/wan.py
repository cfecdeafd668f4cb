"""WAN emulator benchmark: do round trips over shoal's transport through testkit.wan take the
configured RTT, what does a lossy, rate-limited link leave of a transfer, and what does a decode
step of a swarm behind it cost?

    scripts/isolated python -m bench.wan [--rounds 15] [--rtts 20,50,100] [--bandwidth-mbit 50]
        [--loss 0.01] [--transfer-mb 4] [--no-transfer] [--swarm-rtts 20,50] [--swarm-tokens 16] [--no-swarm]

For the round trips and transfers a server node runs in a child process (sealed through
pidfd_getfd, as a harness of server processes would), the client node and the emulator in this
one. Prints one JSON object:

- ``base``: 1 KB ping round trips through a link without delay (the software's own round trip);
- ``rtt``: for each configured RTT, the median (``measured_ms``) and fastest (``min_ms``) of
  ``--rounds`` 1 KB ping/echo requests (``Node.request``, a fresh stream each, on a new
  connection warmed by one request), ``error`` = |measured - configured| / configured, ``net_error`` the same
  for the median less the base median, and QUIC's own smoothed RTT estimate (``quic_rtt_ms``);
- ``rtt_error_max`` (target <= 0.1) and ``rtt_net_error_max``: the largest of those;
- ``transfer``: ``--transfer-mb`` MB streamed in 256 KiB pings (no echo) through a link of
  ``--transfer-rtt`` ms and ``--bandwidth-mbit``, without and with ``--loss``: goodput and the
  emulator's counters (datagrams dropped, of which by the full bottleneck queue);
- ``swarm``: a 2-server chain of a tiny 4-block llama in this process behind the emulator
  (:class:`testkit.wan.WanSwarm`), every link at each of ``--swarm-rtts``: the per-token decode
  time of greedy generation (``--swarm-tokens``), pushed (expected: 1.5 R of propagation, client ->
  s0 -> s1 -> client) and client-driven (2 R), as ``median_ms``/``min_ms``, ``excess_ms`` = median
  less the expectation and ``net_excess_ms`` = that less the same mode's median without delay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from shoal.omp import child_environment
from shoal.transport import META, Node, Ticket, TransportConfig
from shoal.transport.loop import run as run_loop
from shoal.wire import Message
from shoal.wire.schema import Ping
from testkit.wan import LinkConditions, WanEmulator, WanSwarm, request_rtts

CONFIG = TransportConfig(bind_addr="127.0.0.1:0")
TRANSFER_MESSAGE = 256 * 1024


def _ms(samples: list[float]) -> dict:
    return {"median_ms": round(statistics.median(samples) * 1e3, 3), "min_ms": round(min(samples) * 1e3, 3)}


async def measure_rtts(wan: WanEmulator, client: Node, server: Ticket, rtts: list[float], rounds: int) -> dict:
    wan.set_link("client", "server", LinkConditions())
    base = _ms(await request_rtts(client, server, rounds))
    rows = []
    for rtt in rtts:
        wan.set_link("client", "server", LinkConditions(rtt_ms=rtt))
        client.drop_connection(server.peer_id)  # a fresh connection: QUIC's estimate starts at this RTT
        samples = _ms(await request_rtts(client, server, rounds))
        quic = client.rtt_ms(server, META)
        measured = samples["median_ms"]
        rows.append(
            {
                "configured_ms": rtt,
                "measured_ms": measured,
                "min_ms": samples["min_ms"],
                "error": round(abs(measured - rtt) / rtt, 4),
                "net_error": round(abs(measured - base["median_ms"] - rtt) / rtt, 4),
                "quic_rtt_ms": None if quic is None else round(quic, 1),
            }
        )
    return {
        "base": base,
        "rtt": rows,
        "rtt_error_max": max(r["error"] for r in rows),
        "rtt_net_error_max": max(r["net_error"] for r in rows),
    }


async def measure_transfer(wan: WanEmulator, client: Node, server: Ticket, conditions: LinkConditions, mb: int) -> dict:
    wan.set_link("client", "server", conditions)
    stream = await client.open_stream(server, META)
    block = torch.zeros(TRANSFER_MESSAGE, dtype=torch.uint8)
    count = max(1, mb * 2**20 // TRANSFER_MESSAGE)
    try:
        await stream.request(Message("ping", 1, Ping(echo=False), [block]), timeout=60.0)  # warm-up
        before = wan.stats("client", "server")

        async def send_all() -> None:
            for i in range(count):
                await stream.send(Message("ping", i + 2, Ping(echo=False), [block]))

        started = time.perf_counter()
        sender = asyncio.create_task(send_all())
        for _ in range(count):
            await stream.recv(120.0)
        await sender
        elapsed = time.perf_counter() - started
    finally:
        await stream.finish()
    after = wan.stats("client", "server")
    return {
        "rtt_ms": conditions.rtt_ms,
        "bandwidth_mbit": conditions.bandwidth_mbit,
        "loss": conditions.loss,
        "megabytes": round(count * TRANSFER_MESSAGE / 2**20, 2),
        "goodput_mbit": round(count * TRANSFER_MESSAGE * 8 / elapsed / 1e6, 2),
        "seconds": round(elapsed, 3),
        "datagrams_forwarded": after.forwarded_datagrams - before.forwarded_datagrams,
        "datagrams_dropped": after.dropped_datagrams - before.dropped_datagrams,
        "datagrams_overflowed": after.overflow_datagrams - before.overflow_datagrams,
    }


async def run_client(args: argparse.Namespace, server: subprocess.Popen, server_ticket: Ticket) -> dict:
    with WanEmulator(seed=args.seed) as wan:
        wan.add_node(server_ticket, "server", pid=server.pid)  # sealed before anyone dials it
        client = await Node.start(CONFIG)
        try:
            wan.add_node(client.ticket(), "client")
            target = wan.ticket("server")
            result = await measure_rtts(wan, client, target, args.rtts, args.rounds)
            result["rounds"] = args.rounds
            result["payload_bytes"] = 1024
            if not args.no_transfer:
                shaped = LinkConditions(rtt_ms=args.transfer_rtt, bandwidth_mbit=args.bandwidth_mbit)
                result["transfer"] = [
                    await measure_transfer(wan, client, target, shaped, args.transfer_mb),
                    await measure_transfer(
                        wan, client, target, LinkConditions(**{**vars(shaped), "loss": args.loss}), args.transfer_mb
                    ),
                ]
            result["stray_datagrams"] = wan.stray_datagrams
        finally:
            await client.close()
    result["targets_met"] = {"rtt_error_max<=0.1": result["rtt_error_max"] <= 0.1}
    return result


def measure_swarm(rtts: list[float], tokens: int, seed: int) -> dict:
    """Per-token decode times of a 2-server chain of a tiny llama behind the emulator (see the
    module docstring): each R of ``rtts`` on every link, pushed and driven, after R = 0 as a base."""
    from transformers import LogitsProcessor

    from shoal.checkpoints import save_sharded
    from shoal.ids import BlockRange
    from testkit.tiny import tiny_model

    class TokenClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    torch.set_num_threads(1)  # as the tests run: the emulator's thread needs the GIL for every delivery
    reference = tiny_model("llama", seed)
    prompt = torch.randint(2, 256, (1, 16), generator=torch.Generator().manual_seed(seed))
    spans = [BlockRange(0, 2), BlockRange(2, 4)]
    rows, base = [], {}
    with tempfile.TemporaryDirectory() as work:
        checkpoint = save_sharded(reference, reference.config, work)
        expected = reference.generate(prompt, max_new_tokens=tokens, do_sample=False)
        for rtt in [0.0, *rtts]:
            with WanSwarm(checkpoint, spans, default=LinkConditions(rtt_ms=rtt), seed=seed) as swarm:
                for push in (True, False):
                    model = swarm.connect(name="pushed" if push else "driven", push=push, refresh_period=0)
                    model.generate(prompt, max_new_tokens=2, do_sample=False)  # warm: connections and sessions
                    clock = TokenClock()
                    out = model.generate(prompt, max_new_tokens=tokens, do_sample=False, logits_processor=[clock])
                    if not torch.equal(out, expected):
                        raise AssertionError(f"tokens differ from transformers at R = {rtt} ms (push {push})")
                    steps = [(b - a) * 1e3 for a, b in zip(clock.times, clock.times[1:], strict=False)]
                    median = statistics.median(steps)
                    if rtt == 0.0:
                        base[push] = median
                        continue
                    propagation = (1.5 if push else 2.0) * rtt
                    rows.append(
                        {
                            "rtt_ms": rtt,
                            "push": push,
                            "expected_ms": propagation,
                            "median_ms": round(median, 2),
                            "min_ms": round(min(steps), 2),
                            "excess_ms": round(median - propagation, 2),
                            "net_excess_ms": round(median - base[push] - propagation, 2),
                        }
                    )
    return {
        "model": "tiny llama (4 blocks, hidden 64), servers [0, 2) and [2, 4)",
        "decode_steps": tokens - 1,
        "base_median_ms": {"pushed": round(base[True], 2), "driven": round(base[False], 2)},
        "rows": rows,
    }


async def run_server() -> None:
    node = await Node.start(CONFIG)
    print(json.dumps({"ticket": str(node.ticket())}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent ends
    await node.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rtts", type=lambda s: [float(x) for x in s.split(",")], default=[20.0, 50.0, 100.0])
    parser.add_argument("--transfer-mb", type=int, default=4)
    parser.add_argument("--transfer-rtt", type=float, default=20.0)
    parser.add_argument("--bandwidth-mbit", type=float, default=50.0)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--no-transfer", action="store_true", help="round trips only")
    parser.add_argument("--swarm-rtts", type=lambda s: [float(x) for x in s.split(",")], default=[20.0, 50.0])
    parser.add_argument("--swarm-tokens", type=int, default=16)
    parser.add_argument("--no-swarm", action="store_true", help="no swarm rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        run_loop(run_server())
        return
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.wan", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_environment(),
    )
    try:
        ticket = Ticket.parse(json.loads(server.stdout.readline())["ticket"])
        result = run_loop(run_client(args, server, ticket))
    finally:
        server.stdin.close()
        server.wait(timeout=10)
    if not args.no_swarm:
        result["swarm"] = measure_swarm(args.swarm_rtts, args.swarm_tokens, args.seed)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
