"""Helpers for the gateway tests: a tiny chat model, a 3-server swarm with metrics, processes that
announce a URL, Prometheus scrapes.

The model is a random 6-block llama (hidden 64) with SmolLM2's tokenizer and chat template (vocab
49152), saved with one shard per block. Its large init keeps greedy choices far from ties, so the
swarm's greedy answers equal plain transformers' exactly.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from shoal.launch import ChildProcess, ServerProcess
from shoal.transport import Ticket, TransportConfig
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.registry import ENV, process_swarm

LOOPBACK = TransportConfig(bind_addr="127.0.0.1:0")
SPANS = [(0, 2), (2, 4), (4, 6)]
CACHE_TOKENS = 1024  # per block: a request for more positions than this is one the swarm cannot serve


def build_chat_model(out_dir: Path, tokenizer_dir: Path, seed: int = 11):
    """Save the tiny chat model (with the tokenizer of ``tokenizer_dir``) to ``out_dir``; return
    the in-memory reference model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = tiny_model(
        "llama",
        seed=seed,
        vocab_size=len(tokenizer),
        num_hidden_layers=len(SPANS) * 2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    save_checkpoint(model, out_dir, tokenizer=tokenizer)
    return model


def reference_answer(model, tokenizer, messages: list[dict], max_new_tokens: int) -> tuple[str, list[int]]:
    """What plain transformers answers (greedy) to ``messages`` through the chat template."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return reference_continuation(model, tokenizer, ids, max_new_tokens)


def reference_continuation(model, tokenizer, ids: list[int], max_new_tokens: int) -> tuple[str, list[int]]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, len(ids) :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on loopback (all bound at once while chosen: a port let go
    can be the kernel's next pick, and two servers given one port fail to start)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


class UrlProcess(ChildProcess):
    """A child ``python ARGS...`` that prints ``PREFIX: URL`` when ready; its output is kept."""

    def __init__(self, args: Sequence[str], prefix: str, timeout: float = 120.0, stdin=subprocess.DEVNULL):
        super().__init__(args, f"{prefix}: ", timeout, ENV, stdin)

    @property
    def url(self) -> str:
        return self.ready_value


@dataclass
class Server:
    span: tuple[int, int]
    process: ServerProcess
    metrics_port: int

    @property
    def peer(self) -> str:
        return self.process.ticket.peer_id

    def metrics(self) -> dict[str, float]:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")


@dataclass
class MetricsSwarm:
    """Servers of one swarm over ``model_dir``, each with ``--metrics-port``."""

    model_dir: Path
    servers: list[Server] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.processes = process_swarm(self.model_dir, "--throughput", "100", "--cache-tokens", str(CACHE_TOKENS))

    @property
    def ticket(self) -> Ticket:
        return self.servers[0].process.ticket

    def start(self, spans: Sequence[tuple[int, int]] = SPANS, extra: Sequence[str] = ()) -> MetricsSwarm:
        """The first span founds the swarm, the others join it in parallel; returns once every
        server's table lists every server online."""
        try:
            ports = free_ports(len(spans))
            started = self.processes.start(spans, [("--metrics-port", str(port), *extra) for port in ports])
            self.servers += [Server(*spec) for spec in zip(spans, started, ports, strict=True)]
            self.processes.wait_converged(60.0)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self.processes.stop()


def scrape(url: str) -> dict[str, float]:
    """``{'name{label="value",...}': value}`` of every sample at a Prometheus endpoint."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def total(swarm: MetricsSwarm, name: str) -> float:
    """``name`` summed over every server of ``swarm``."""
    return sum(server.metrics().get(name, 0.0) for server in swarm.servers)


def wait_for(condition, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(interval)


def gateway_args(model_dir: Path, ticket: Ticket, *extra: str) -> list[str]:
    return [
        "-m", "shoal.cli.main", "api", str(model_dir), "--join", str(ticket), "--port", "0",
        "--bind", "127.0.0.1:0", "--num-threads", "1", *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def gateway(model_dir: Path, ticket: Ticket, *extra: str):
    process = UrlProcess(gateway_args(model_dir, ticket, *extra), "gateway", timeout=120.0)
    try:
        yield process
    finally:
        process.stop()
