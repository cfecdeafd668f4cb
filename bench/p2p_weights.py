"""Weights peer to peer: how fast a joining server fetches a span from the swarm's members, and what
giving costs the givers' own decode latency.

    scripts/isolated python -m bench.p2p_weights [--model qwen2.5-coder] [--blocks 0:24] [--idle-s 8] [--no-decode]
                                                 [--fetcher-nice 19]

Two ``shoal serve`` processes on loopback hold the model's files (``shoal models list``) and serve
half the blocks each (one compute thread each); both give the model's chunks (``--give-rate``,
default 256 MB/s each). A decoder child process keeps one session decoding through both servers the
whole time (a step per token, sessions of 256 tokens after a 16-token prompt). This process then
fetches ``--blocks`` twice into fresh directories, as a joining server does
(:mod:`shoal.weights`: manifest checked against the model record, every chunk checked, written to a
partial directory): first from one giver, then from both.

In a swarm the fetcher is another machine: nothing it spends comes out of the givers' CPUs. Here all
share the same cores, so the fetcher runs at OS niceness ``--fetcher-nice`` (default 19: it gets
what decoding leaves, as its own machine would), and ``decode_slowdown_of_senders`` measures what
giving costs the givers, not what a third party on their cores costs them. ``--fetcher-nice 0``
measures all of it together (on 2 cores: about 1.4x).

Prints JSON: ``span_mb`` (the span's tensors), ``fetch_s_one_peer``, ``fetch_s_two_peers``,
``mb_per_s`` (span over the two-peer fetch), ``chunks_s_one_peer`` and ``chunks_s_two_peers`` (of
those times, fetching, checking and writing the chunks: the rest is the manifest and the span's
fsync at the end), ``fingerprint_check_s`` (the blocks' fingerprints checked against the model
record once fetched, not in the fetch times), and
``decode_slowdown_of_senders``: the decoder's median step latency while a fetch ran over its median
in the idle windows before and after (``decode_ms_idle``, ``decode_ms_sending``, step counts).
What each side's CPU paid per MB fetched from two givers (Linux: from ``/proc``), what limits the
rate on a machine with few free cores: ``fetcher_cpu_ms_per_mb`` (this process: receiving,
checking, writing) and ``givers_cpu_ms_per_mb`` (both givers' processes together, their decoding
included; with ``--no-decode`` no decoder runs, so it is the giving alone). The machine may be
shared: numbers are what one run measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from shoal.checkpoints import fetch_model, model_name
from shoal.checkpoints.check import check_model
from shoal.ids import BlockRange
from shoal.launch import LocalSwarm
from shoal.launch.process import even_spans
from shoal.server.config import parse_blocks
from shoal.swarm.service import fetch_table, reach_any, table_from_reply
from shoal.transport import Node, Ticket, TransportConfig
from shoal.transport.loop import run as run_loop
from shoal.weights.fetch import fetch_chunks, fetch_manifest
from shoal.weights.join import check_fingerprints, givers_of
from shoal.weights.partial import PartialSpan

SESSION_TOKENS = 256
PROMPT = 16
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_s(pids: list[int]) -> float | None:
    """CPU seconds (user and system, every thread) the processes ``pids`` used so far; None off Linux."""
    try:
        fields = [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() for pid in pids]
    except OSError:
        return None
    return sum(int(f[11]) + int(f[12]) for f in fields) / TICK


def renice_self(niceness: int) -> None:
    """Every thread of this process (Linux: niceness is per thread), and those they start later,
    at ``niceness``; best effort."""
    if niceness == os.getpriority(os.PRIO_PROCESS, 0):
        return
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except OSError:
            pass


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def decoder(spec: str) -> None:
    """The decoder child: steps one session at a time through the servers until stdin closes,
    printing ``wall_time step_ms`` per step."""
    import torch

    from shoal import AutoDistributedModelForCausalLM

    args = json.loads(spec)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args["model"], [Ticket.parse(t) for t in args["tickets"]], transport=TransportConfig(bind_addr="127.0.0.1:0")
    )
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    generator = torch.Generator().manual_seed(0)
    print("decoding", flush=True)
    while not stop.is_set():
        ids = torch.randint(3, model.config.vocab_size, (1, PROMPT + SESSION_TOKENS), generator=generator)
        with torch.inference_mode():
            hidden = model.get_input_embeddings()(ids).contiguous()
        session = model.blocks.open_session(1, PROMPT + SESSION_TOKENS)
        try:
            session.step(hidden[:, :PROMPT], torch.arange(PROMPT).unsqueeze(0), None)
            for t in range(PROMPT, PROMPT + SESSION_TOKENS):
                if stop.is_set():
                    break
                started = time.perf_counter()
                session.step(hidden[:, t : t + 1], torch.tensor([[t]]), None)
                print(f"{time.time():.6f} {(time.perf_counter() - started) * 1e3:.3f}", flush=True)
        finally:
            session.close()


class Decoder:
    """The decoder child, its steps collected as (wall time, ms) by a reader thread."""

    def __init__(self, model_dir: Path, tickets: list[Ticket]):
        spec = json.dumps({"model": str(model_dir), "tickets": [str(t) for t in tickets]})
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.p2p_weights", "--decoder", spec],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        if self.proc.stdout.readline().strip() != "decoding":
            raise RuntimeError("the decoder child did not start")
        self.steps: list[tuple[float, float]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            at, ms = line.split()
            self.steps.append((float(at), float(ms)))

    def between(self, start: float, end: float) -> list[float]:
        return [ms for at, ms in self.steps if start <= at <= end]

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


async def fetch_once(node: Node, givers: list[Ticket], record, model: str, blocks: BlockRange, root: Path):
    """One fetch of ``blocks`` from ``givers`` into ``root``: (seconds, report)."""
    started = time.perf_counter()
    manifest = await fetch_manifest(node, givers, model, record.manifest, 60.0)
    partial = PartialSpan(root, manifest, record.manifest, manifest.span_items(blocks.start, blocks.end), "span")
    report = await fetch_chunks(node, givers, partial, 60.0, progress=False)
    await asyncio.to_thread(partial.finish)
    return time.perf_counter() - started, report


def run(model: str, blocks: BlockRange, idle_s: float, give_rate: float, decode: bool = True, nice: int = 19) -> dict:
    model_dir = fetch_model(model)
    name = model_name(str(model_dir))
    extra = ["--num-threads", "1", "--throughput", "100", "--give-rate", str(give_rate)]
    spans = even_spans(check_model(str(model_dir)).num_blocks, 2)
    with LocalSwarm(model_dir, spans, extra, swarm=True, ready_timeout=900) as swarm:
        swarm.wait_converged(120)
        tickets = swarm.tickets

        async def table():
            node = await Node.start(TransportConfig(bind_addr="127.0.0.1:0"))
            try:
                for _ in range(120):
                    ticket = await reach_any(node, tickets, 10.0)
                    found = table_from_reply(ticket.swarm_id, await fetch_table(node, ticket, 10.0))
                    record = found.model(name)
                    if record is not None and record.manifest and len(givers_of(found, name)) == 2:
                        return record, givers_of(found, name)
                    await asyncio.sleep(1.0)
            finally:
                await node.close(linger=0.2)
            raise RuntimeError("the givers did not announce the model's manifest")

        record, givers = run_loop(table())
        giver_pids = [s.proc.pid for s in swarm.running if s.ticket.peer_id in {g.peer_id for g in givers}]
        decoder_child = Decoder(model_dir, tickets) if decode else None
        idle_s = idle_s if decode else 0.0
        cpu: dict[str, float | None] = {}
        windows: dict[str, list[tuple[float, float]]] = {"idle": [], "sending": []}
        results = {}
        try:
            renice_self(nice)  # after the children started: they keep their own
            time.sleep(idle_s)
            windows["idle"].append((time.time() - idle_s, time.time()))
            with tempfile.TemporaryDirectory(prefix="p2p-weights-") as scratch:
                for label, chosen in (("one", givers[:1]), ("two", givers)):
                    root = Path(scratch) / label

                    async def fetch(chosen=chosen, root=root):
                        node = await Node.start(TransportConfig(bind_addr="127.0.0.1:0"))
                        try:
                            return await fetch_once(node, chosen, record, name, blocks, root)
                        finally:
                            await node.close(linger=0.2)

                    begin, fetcher_before, givers_before = time.time(), own_cpu_s(), cpu_s(giver_pids)
                    results[label] = run_loop(fetch())
                    windows["sending"].append((begin, time.time()))
                    cpu["fetcher"], givers_after = own_cpu_s() - fetcher_before, cpu_s(giver_pids)
                    cpu["givers"] = givers_after - givers_before if givers_after is not None else None
                    time.sleep(idle_s)
                    windows["idle"].append((time.time() - idle_s, time.time()))
                checked = time.perf_counter()
                check_fingerprints(Path(scratch) / "two", record, blocks)
                check_s = time.perf_counter() - checked
        finally:
            if decoder_child is not None:
                decoder_child.stop()
    steps = decoder_child.between if decoder_child is not None else lambda start, end: []
    idle = [ms for w in windows["idle"] for ms in steps(*w)]
    sending = [ms for w in windows["sending"] for ms in steps(*w)]
    (one_s, one), (two_s, two) = results["one"], results["two"]
    span_mb = two.bytes / 1e6
    return {
        "model": name,
        "blocks": str(blocks),
        "span_mb": round(span_mb, 1),
        "fetch_s_one_peer": round(one_s, 2),
        "fetch_s_two_peers": round(two_s, 2),
        "chunks_s_one_peer": round(one.seconds, 2),  # the chunks alone: no manifest, no fsync of the span at the end
        "chunks_s_two_peers": round(two.seconds, 2),
        "mb_per_s": round(span_mb / two_s, 1),
        "mb_per_s_one_peer": round(one.bytes / 1e6 / one_s, 1),
        "chunks": two.fetched,
        "chunks_by_giver_two_peers": sorted(two.by_giver.values()),
        "fingerprint_check_s": round(check_s, 2),
        "decode_ms_idle": round(statistics.median(idle), 2) if idle else None,
        "decode_ms_sending": round(statistics.median(sending), 2) if sending else None,
        "decode_steps_idle": len(idle),
        "decode_steps_sending": len(sending),
        "decode_slowdown_of_senders": round(statistics.median(sending) / statistics.median(idle), 3)
        if idle and sending
        else None,
        "fetcher_cpu_ms_per_mb": round(cpu["fetcher"] * 1e3 / span_mb, 2),
        "givers_cpu_ms_per_mb": round(cpu["givers"] * 1e3 / span_mb, 2) if cpu["givers"] is not None else None,
        "give_rate_mb_s_per_giver": give_rate,
        "fetcher_nice": nice,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder", help="a known model, fetched (shoal models list)")
    parser.add_argument("--blocks", default="0:24", help="the span fetched")
    parser.add_argument("--idle-s", type=float, default=8.0, help="seconds of decoding measured with no fetch")
    parser.add_argument("--give-rate", type=float, default=256.0, help="MB/s each giver gives at most")
    parser.add_argument("--no-decode", action="store_true", help="no decoder: the CPU keys are the giving alone")
    parser.add_argument("--fetcher-nice", type=int, default=19,
                        help="the fetcher's OS niceness (it stands for another machine; 0: an equal)")  # fmt: skip
    parser.add_argument("--decoder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decoder:
        decoder(args.decoder)
        return
    result = run(args.model, parse_blocks(args.blocks), args.idle_s, args.give_rate, not args.no_decode,
                 args.fetcher_nice)  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
