"""Helpers for the gateway tests: a tiny chat model, a 3-server swarm with metrics, processes that
announce a URL, Prometheus scrapes.

The model is a random 6-block llama (hidden 64) with SmolLM2's tokenizer and chat template (vocab
49152), saved with one shard per block. Its large init keeps greedy choices far from ties, so the
swarm's greedy answers equal plain transformers' exactly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from shoal.launch import ServerProcess, serve_args
from shoal.swarm.status import swarm_status
from shoal.transport import Ticket, TransportConfig
from tests.helpers.aio import run
from tests.helpers.parity import tiny_causal_lm
from tests.helpers.swarm import write_checkpoint

LOOPBACK = TransportConfig(bind_addr="127.0.0.1:0")
SPANS = [(0, 2), (2, 4), (4, 6)]
GOSSIP = ("--gossip-period", "0.5", "--refresh-period", "1", "--expiry", "3")
CACHE_TOKENS = 1024  # per block: a request for more positions than this is one the swarm cannot serve
ENV = {"OMP_NUM_THREADS": "1"}


def build_chat_model(out_dir: Path, tokenizer_dir: Path, seed: int = 11):
    """Save the tiny chat model (with the tokenizer of ``tokenizer_dir``) to ``out_dir``; return
    the in-memory reference model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = tiny_causal_lm(
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
    write_checkpoint(model, out_dir, tokenizer=tokenizer)
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class UrlProcess:
    """A child ``python ARGS...`` that prints ``PREFIX: URL`` when ready; its output is kept."""

    def __init__(self, args: Sequence[str], prefix: str, timeout: float = 120.0, stdin=subprocess.DEVNULL):
        self.args = list(args)
        self.proc = subprocess.Popen(
            [sys.executable, *self.args],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **ENV},
        )
        self.output: list[str] = []
        deadline = time.monotonic() + timeout
        self.url = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            if line.startswith(f"{prefix}: "):
                self.url = line.split(" ", 1)[1].strip()
                break
        if self.url is None:
            self.stop()
            raise RuntimeError(f"{self.args} did not print '{prefix}: ...':\n{''.join(self.output)[-4000:]}")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


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

    @property
    def ticket(self) -> Ticket:
        return self.servers[0].process.ticket

    def start(self, spans: Sequence[tuple[int, int]] = SPANS, extra: Sequence[str] = ()) -> MetricsSwarm:
        """The first span founds the swarm; the others join it in parallel."""
        try:
            self.servers.append(self._start(spans[0], ["--new-swarm", *extra]))
            joined: list[Server | Exception] = [None] * (len(spans) - 1)

            def one(i: int) -> None:
                try:
                    joined[i] = self._start(spans[i + 1], ["--join", str(self.ticket), *extra])
                except Exception as exc:
                    joined[i] = exc

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(joined))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            self.servers += [s for s in joined if isinstance(s, Server)]
            errors = [e for e in joined if isinstance(e, Exception)]
            if errors:
                raise RuntimeError(f"servers did not start: {errors}")
            self.wait_online(len(spans))
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, span: tuple[int, int], extra: Sequence[str]) -> Server:
        port = free_port()
        args = serve_args(self.model_dir, span, "--num-threads", "1", "--throughput", "100")
        args += ["--cache-tokens", str(CACHE_TOKENS), "--metrics-port", str(port), *GOSSIP, *extra]
        return Server(span, ServerProcess(args, ready_timeout=120.0, env=ENV), port)

    def wait_online(self, count: int, timeout: float = 60.0) -> dict:
        """Until the swarm's table (through the first server) lists ``count`` servers online."""
        deadline = time.monotonic() + timeout
        while True:
            status = run(swarm_status(self.ticket, LOOPBACK), 20)
            online = [s for m in status["models"] for s in m["servers"] if s["state"] == "online"]
            if len(online) >= count:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} servers not online within {timeout} s: {status}")
            time.sleep(0.2)

    def close(self) -> None:
        for server in self.servers:
            if server.process.proc.poll() is None:
                server.process.proc.terminate()
        for server in self.servers:
            server.process.stop()


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
