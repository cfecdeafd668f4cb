"""A real swarm for tests: ``shoal serve`` processes on loopback, and clients built over them.

    with start_swarm(model_dir, [(0, 2), (2, 4), (0, 1), (1, 2)]) as swarm:
        model = swarm.connect([(0, 1), (1, 2), (2, 4)])  # the client plans its chain over these peers
        ...

Servers run with one torch thread each and bind 127.0.0.1 (callers must be inside the loopback-only
namespace of ``scripts/test``). :meth:`Swarm.close` closes every client, then stops every server
(SIGTERM, then SIGKILL); it runs even when starting some of the servers failed.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import torch

from shoal.checkpoints import save_sharded
from shoal.client import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from shoal.transport import TransportConfig
from tests.helpers.processes import PeerProcess

Span = tuple[int, int]
LOOPBACK = TransportConfig(bind_addr="127.0.0.1:0")


def chain_spans(num_blocks: int, hops: int) -> list[Span]:
    """``hops`` contiguous spans covering ``[0, num_blocks)``, as even as possible."""
    if not 1 <= hops <= num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks into {hops} spans")
    edges = [round(i * num_blocks / hops) for i in range(hops + 1)]
    return list(pairwise(edges))


def two_and_three_hop_spans(num_blocks: int) -> tuple[list[Span], list[Span]]:
    """Spans for a swarm of 4 servers that offers a 2-hop chain and a 3-hop chain sharing the last
    server: ``[0:h], [h:n]`` and ``[0:q], [q:h], [h:n]``."""
    if num_blocks < 3:
        raise ValueError("need at least 3 blocks for a 3-hop chain")
    (_, half), (_, last) = chain_spans(num_blocks, 2)
    quarter = max(1, half // 2)
    return [(0, half), (half, last)], [(0, quarter), (quarter, half), (half, last)]


def write_checkpoint(model: torch.nn.Module, out_dir: str | Path, tokenizer=None) -> Path:
    """``model`` as a sharded checkpoint (one shard per block) with its generation config."""
    return save_sharded(model, model.config, out_dir, tokenizer=tokenizer)


class Swarm:
    """Server processes by span (one per span) over one model directory, and the clients made here."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.servers: dict[Span, PeerProcess] = {}
        self.clients: list[DistributedModelForCausalLM] = []

    def tickets(self, spans: Iterable[Span]) -> list[str]:
        return [str(self.servers[tuple(span)].ticket) for span in spans]

    def connect(self, spans: Iterable[Span], **kwargs) -> DistributedModelForCausalLM:
        """A client given exactly the servers of ``spans`` as ``initial_peers``."""
        self.check_alive()
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(self.model_dir), initial_peers=self.tickets(spans), transport=LOOPBACK, **kwargs
        )
        self.clients.append(model)
        return model

    def check_alive(self) -> None:
        dead = {span: p for span, p in self.servers.items() if p.proc.poll() is not None}
        if dead:
            logs = "\n".join(
                f"--- server {s} (exit {p.proc.returncode}):\n{''.join(p.output)[-2000:]}" for s, p in dead.items()
            )
            raise RuntimeError(f"swarm servers died:\n{logs}")

    def server_output(self, span: Span) -> str:
        return "".join(self.servers[span].output)

    def close(self, timeout: float = 10.0, graceful: bool = True) -> None:
        """Close the clients, then stop the servers (see :func:`stop_processes`)."""
        clients, self.clients = self.clients, []
        for model in clients:
            try:
                model.blocks.close()
            except Exception:  # a client that failed half-way must not keep the servers alive
                pass
        stop_processes(list(self.servers.values()), timeout, graceful)

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_swarm(
    model_dir: str | Path,
    spans: Sequence[Span],
    *,
    num_threads: int = 1,
    extra_args: Sequence[str] = (),
    ready_timeout: float = 120.0,
) -> Swarm:
    """Start one ``shoal serve`` process per span, all at once; return when every one is ready.
    If any fails to start, the others are stopped and the error names it (with its output)."""
    swarm = Swarm(Path(model_dir))
    spans = [tuple(s) for s in spans]
    if len(set(spans)) != len(spans):
        raise ValueError(f"duplicate spans {spans}")

    def start(span: Span) -> PeerProcess:
        args = ["-m", "shoal.cli.main", "serve", str(model_dir), "--blocks", f"{span[0]}:{span[1]}"]
        args += ["--host", "127.0.0.1", "--num-threads", str(num_threads), *extra_args]
        return PeerProcess(args, ready_timeout=ready_timeout)

    errors = []
    with ThreadPoolExecutor(max_workers=len(spans)) as pool:
        futures = {span: pool.submit(start, span) for span in spans}
        for span, future in futures.items():
            try:
                swarm.servers[span] = future.result()
            except Exception as exc:
                errors.append(f"server {span}: {exc}")
    if errors:
        swarm.close()
        raise RuntimeError("swarm did not start:\n" + "\n".join(errors))
    return swarm


def stop_processes(processes: Sequence[PeerProcess], timeout: float = 10.0, graceful: bool = True) -> None:
    """Stop servers: SIGTERM all (they shut down on it) and wait up to ``timeout`` for each, then
    SIGKILL stragglers; with ``graceful=False``, SIGKILL at once (nothing left to flush in tests)."""
    for p in processes:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
    for p in processes:
        try:
            p.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
        finally:
            if p.proc.stdin and not p.proc.stdin.closed:
                try:
                    p.proc.stdin.close()
                except OSError:
                    pass
