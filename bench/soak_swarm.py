"""The swarm side of :mod:`bench.soak`: the tiny chat model, honest and byzantine ``shoal serve``
processes (the byzantine ones are :mod:`testkit.faulty_server`, the real CLI with a fault seam), the
gateway (``shoal api --verify audit``), who serves what, and the peak memory of every process.

Every process runs on loopback with one torch thread; every one this module starts is ended by
:meth:`Swarm.close` (SIGKILL after a short SIGTERM grace), whatever happened before.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.soak_wan import SoakWan
from shoal.ids import BlockRange
from shoal.launch import ChildProcess, ServerProcess, serve_args, stop_all
from shoal.transport import Ticket
from testkit.faults import (
    DropReply,
    Equivocate,
    Fault,
    Malformed,
    Noise,
    SkipBlock,
    StaleCache,
    When,
    Zeros,
    fault_flags,
    faulty_server_args,
)

SPANS = [BlockRange(0, 2), BlockRange(2, 4)]
REPLICAS = 3  # honest servers per span at the start: a dispute with a liar always finds a third opinion
ENV = {"OMP_NUM_THREADS": "1"}
SERVER_FLAGS = (
    "--num-threads", "1", "--throughput", "100", "--cache-tokens", "1024", "--drain-timeout", "5",
    "--gossip-period", "0.5", "--refresh-period", "1.0", "--expiry", "10.0", "--request-timeout", "10",
)  # fmt: skip
LIE_FROM = 24  # the "lie_from" liar answers honestly before this cache position
#: Servers that compute wrong on purpose: the verification must convict each one that served a step.
LIAR_KINDS = ("noise", "zeros", "skip_block", "stale_cache", "equivocate", "lie_from")
#: Servers that fail without lying (never answer a step; answer garbage): routed around, never convicted.
BROKEN_KINDS = ("stall", "malformed")


def faults_of(kind: str, span: BlockRange, seed: int) -> list[Fault]:
    """The faults a byzantine server of ``kind`` over ``span`` runs with."""
    return {
        "noise": [Noise(0.5, seed=seed)],
        "zeros": [Zeros()],
        "skip_block": [SkipBlock(span.start)],
        "stale_cache": [StaleCache()],
        "equivocate": [Equivocate(1.0, seed=seed)],
        "lie_from": [Noise(1.0, seed=seed, when=When(from_position=LIE_FROM))],
        "stall": [DropReply()],
        "malformed": [Malformed(seed=seed)],
    }[kind]


def build_model(out_dir: Path, seed: int = 11):
    """The tiny chat model: a random 4-block llama (hidden 64) with SmolLM2's tokenizer and chat
    template, saved to ``out_dir``; returns (reference model, tokenizer). The tiny config's large
    init keeps greedy choices far from ties, so the swarm's greedy answers equal transformers'."""
    from transformers import AutoTokenizer

    from shoal.checkpoints import fetch_model
    from testkit.tiny import save_checkpoint, tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(fetch_model("smollm2", progress=False)))
    model = tiny_model(
        "llama", seed=seed, vocab_size=len(tokenizer), num_hidden_layers=SPANS[-1].end, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, name, getattr(tokenizer, name))
    save_checkpoint(model, out_dir, tokenizer=tokenizer)
    return model, tokenizer


@dataclass
class Member:
    """One server process of the soak: ``kind`` is "honest" or a byzantine kind."""

    name: str
    kind: str
    process: ServerProcess
    span: BlockRange | None  # None: placed by the swarm (read it with Swarm.spans)
    record: Path | None = None  # a byzantine server's fault record (JSON lines)
    started: float = field(default_factory=time.monotonic)
    ended: str | None = None  # "killed", "drained", "left", "died"

    @property
    def peer(self) -> str:
        return self.process.ticket.peer_id

    @property
    def alive(self) -> bool:
        return self.ended is None and self.process.alive


class Swarm:
    """The soak's processes. Thread-safe: the chaos thread starts and ends servers while the
    driver's threads read who is alive."""

    def __init__(self, model_dir: Path, work: Path, seed: int, wan: SoakWan | None = None):
        self.model_dir, self.work = model_dir, work
        self.wan = wan  # None: every process on plain loopback
        self.rng = random.Random(seed)
        self.members: list[Member] = []
        self.gateway: ChildProcess | None = None
        self.peak_rss_mb: dict[str, float] = {}
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._pids: dict[int, str] = {}
        self._processes: list[ChildProcess] = []  # every process started, ready or not: close ends them

    # ---- servers ---------------------------------------------------------------------------------
    def start(self, kind: str = "honest", span: BlockRange | None = None, join: Ticket | None = None) -> Member:
        """A new server (a fresh key each: no ``--identity``) of ``kind``; ``span`` None: placement
        chooses (``--join`` without ``--blocks``); ``join`` None: the swarm of a live member, or a
        new swarm when none lives. Waits until it is ready."""
        name = f"{kind}-{next(self._names)}"
        joins = [join] if join is not None else self.join_tickets()
        swarm = ["--new-swarm"] if not joins else [flag for t in joins for flag in ("--join", str(t))]
        record = None
        extra: list[str] = []
        if kind != "honest":
            record = self.work / f"{name}.faults.jsonl"
            extra = list(fault_flags(*faults_of(kind, span, self.rng.randrange(1 << 16)), record=record))
        if self.wan is not None:
            # it announces its proxy: every ticket and record of it sends peers through the emulator.
            # --join-anyway: the check before loading dials from a throwaway endpoint the emulator
            # does not know (its datagrams are dropped); the server's own endpoint still joins first
            extra += ["--announce-addr", self.wan.reserve(name), *(["--join-anyway"] if joins else [])]
        if span is None:
            args = ["-m", "shoal.cli.main", "serve", str(self.model_dir), "--num-blocks", "2", "--host", "127.0.0.1"]
            args += [*SERVER_FLAGS, *swarm, *extra]
        else:
            args = serve_args(self.model_dir, span, *SERVER_FLAGS, *swarm, *extra)
        args = faulty_server_args(args)  # with --faults: the same server under testkit.faulty_server
        process = ServerProcess(args, ready_timeout=None, env=ENV)
        with self._lock:
            self._pids[process.pid] = name
            self._processes.append(process)
        self._attach(name, process)
        try:
            process.wait_ready(240.0)
        except RuntimeError:
            self._detach(name)
            raise
        member = Member(name, kind, process, span, record)
        with self._lock:
            self.members.append(member)
        return member

    def join_tickets(self, most: int = 3) -> list[Ticket]:
        """Tickets of up to ``most`` live honest servers (several: one may be killed meanwhile)."""
        live = [m.process.ticket for m in self.alive("honest")]
        return self.rng.sample(live, min(most, len(live)))

    def alive(self, kind: str | None = None) -> list[Member]:
        with self._lock:
            members = list(self.members)
        return [m for m in members if m.alive and (kind is None or m.kind == kind)]

    def kill(self, member: Member) -> None:
        """SIGKILL: gone mid-step, no goodbye."""
        member.ended = "killed"
        member.process.kill()
        self._detach(member.name)

    def leave(self, member: Member, how: str = "drained") -> None:
        """SIGTERM: the server drains (its sessions get ``--drain-timeout`` to move on) and leaves."""
        member.ended = how
        member.process.stop(30.0)
        self._detach(member.name)

    def spans(self) -> dict[str, BlockRange]:
        """Who serves what, as the swarm's table says (peer id -> blocks)."""
        from shoal.client.remote.listing import swarm_spans
        from shoal.transport import Node, TransportConfig

        tickets = [m.process.ticket for m in self.alive("honest")]

        async def pull() -> dict[str, BlockRange]:
            async with await Node.start(TransportConfig(bind_addr="127.0.0.1:0")) as node:
                name = self.wan.register_here(node.ticket()) if self.wan is not None else None
                try:
                    found = await swarm_spans(node, tickets, self.model_dir.name, 5.0)
                finally:
                    if name is not None:
                        self.wan.remove(name)
            return {s.peer_id: s.blocks for s in found}

        return asyncio.run(pull())

    # ---- gateway ---------------------------------------------------------------------------------
    def start_gateway(self, concurrency: int, audit_every: int) -> str:
        """``shoal api --verify audit --require-verified`` over the swarm; its URL. Without
        ``--require-verified`` a span left with one server (a liar with no one to check it) is
        served unverified, and its lies reach the answer (see docs/performance.md)."""
        args = [
            "-m", "shoal.cli.main", "api", str(self.model_dir), "--join", str(self.join_tickets(1)[0]), "--port", "0",
            "--bind", "127.0.0.1:0", "--num-threads", "1", "--verify", "audit", "--audit-every", str(audit_every),
            "--max-concurrency", str(concurrency), "--request-timeout", "10", "--route-wait", "10",
            "--require-verified",
        ]  # fmt: skip
        self.gateway = ChildProcess(args, "gateway: ", ready_timeout=None, env=ENV, stdin=None)
        with self._lock:
            self._pids[self.gateway.pid] = "gateway"
            self._processes.append(self.gateway)
        self._attach("gateway", self.gateway)  # only dialled out of: it announces nothing
        return self.gateway.wait_ready(120.0)

    def banned(self, url: str) -> list[str]:
        """The peers the gateway's verification convicted (its ``shoal_verify_banned`` metric)."""
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        prefix = 'shoal_verify_banned{peer="'
        return [line[len(prefix) :].split('"', 1)[0] for line in text.splitlines() if line.startswith(prefix)]

    # ---- the emulated network -------------------------------------------------------------------
    def _attach(self, name: str, process: ChildProcess) -> None:
        """Put ``process``'s node behind the emulator as it binds (no-op without one); a process
        that ends or never binds fails as :meth:`ChildProcess.wait_ready` says (its output quoted)."""
        if self.wan is None:
            return
        try:
            self.wan.attach(name, process.pid, timeout=240.0)
        except (ProcessLookupError, TimeoutError, ValueError, OSError) as exc:
            self._detach(name)
            process.kill()
            raise RuntimeError(
                f"{name} could not be put behind the WAN emulator: {exc}\n{process.text()[-2000:]}"
            ) from None

    def _detach(self, name: str) -> None:
        if self.wan is not None:
            self.wan.remove(name)

    # ---- memory ----------------------------------------------------------------------------------
    def sample_rss(self) -> None:
        """Note every live process's resident memory (this one as "driver"): the peak is kept."""
        with self._lock:
            pids = dict(self._pids)
        pids[psutil.Process().pid] = "driver"
        for pid, name in pids.items():
            try:
                mb = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.Error:
                continue
            self.peak_rss_mb[name] = round(max(self.peak_rss_mb.get(name, 0.0), mb), 1)

    def close(self, logs: Path | None = None) -> None:
        """End every process started (SIGTERM, then SIGKILL after a few seconds); with ``logs``,
        write each one's output there (``NAME.log``)."""
        with self._lock:
            processes = list(self._processes)
            names = dict(self._pids)
        stop_all(processes, 10.0)
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            for process in processes:
                (logs / f"{names.get(process.pid, process.pid)}.log").write_text(process.text())


__all__ = ["BROKEN_KINDS", "LIAR_KINDS", "REPLICAS", "SPANS", "Member", "Swarm", "build_model", "faults_of"]
