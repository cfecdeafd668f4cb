"""Server settings: the one place CLI values become a frozen object the server runs from."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shoal.devices import check_device
from shoal.errors import UsageError
from shoal.ids import BlockRange
from shoal.models.kv import DEFAULT_PAGE_SIZE
from shoal.quantization import Quantization
from shoal.swarm.gossip import GossipConfig
from shoal.transport import Ticket, TransportConfig

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def parse_blocks(text: str) -> BlockRange:
    """``START:END``, half-open."""
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise UsageError(f"--blocks takes START:END (half-open), got {text!r}") from None
    if not 0 <= start < end:
        raise UsageError(f"--blocks {text}: need 0 <= START < END")
    return BlockRange(start, end)


#: what :data:`shoal.wire.schema.AdapterName` accepts (64 characters at most)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_ADAPTERS = 64  # what a server's span info announces at most


def parse_adapter(text: str) -> tuple[str, Path]:
    """``NAME=PATH``: a LoRA adapter (peft's format) the server runs its span with, under ``NAME``."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise UsageError(f"--adapter takes NAME=PATH, got {text!r}")
    if not ADAPTER_NAME.fullmatch(name):
        raise UsageError(
            f"--adapter {text}: NAME must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    if not Path(path).exists():
        raise UsageError(f"--adapter {text}: no adapter at {path}")
    return name, Path(path)


@dataclass(frozen=True)
class ServerConfig:
    model: str  # local Hugging Face directory, known model name or Hub id; "": chosen where the swarm is short
    blocks: BlockRange | None = None  # half-open [start, end); None: placed automatically (needs a swarm)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    quant: Quantization = Quantization.NONE  # how the span's weight matrices are held (shoal.quantization)
    gguf: Path | None = None  # --quant gguf: the GGUF file served (None: the one beside the checkpoint)
    cache_tokens: int = 8192  # KV cache budget per hosted block, in tokens (all sessions together)
    page_size: int = DEFAULT_PAGE_SIZE  # positions per KV page (the cache is taken and shared in pages)
    kv_overcommit: float = 1.0  # admit sessions whose max_lengths commit up to this many times the pages
    max_batch: int = 32  # session rows one batched forward takes at most (1: no batching)
    prefill_chunk: int = 128  # new positions (rows x tokens) a step runs per compute task at most
    contended_cost: float = 1.25  # while peers compete, a batch costs at most ~this many lone steps
    merge_wait: float = 1.5  # a free compute thread waits up to this many lone steps for sessions due back
    packed_weights: bool = False  # fp32 CPU: add oneDNN's packed copy of the linear weights (shoal.models.packed)
    identity_file: Path | None = None
    ticket_file: Path | None = None
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)
    transport: TransportConfig = field(default_factory=TransportConfig)  # its limits bound peers (shoal.limits)
    new_swarm: bool = False  # create a swarm (its id goes into this server's ticket)
    join: tuple[Ticket, ...] = ()  # tickets of peers of the swarm to join
    member_cert: bytes | None = None  # a private swarm's member certificate for this node (shoal.swarm.members)
    join_anyway: bool = False  # start even when no peer of ``join`` answers (else: fail, see Presence.join)
    throughput: float | None = None  # tokens/s per block to announce; None: measure (see shoal.server.throughput)
    num_blocks: int | None = None  # blocks to host when placed automatically; None: as many as memory allows
    rebalance: bool = True  # placed automatically: re-check the swarm's balance and move when it clearly helps
    balance_period: float = 120.0  # seconds between re-checks (randomised +-20% per check)
    balance_margin: float = 1.2  # move only if the swarm's bottleneck rises by this factor (or a hole closes)
    drain_timeout: float = 5.0  # seconds open sessions get to move away when the server leaves or moves
    gossip: GossipConfig = field(default_factory=GossipConfig)
    metrics_port: int | None = None  # serve Prometheus metrics on this TCP port (0: any free one; None: off)
    metrics_host: str = "127.0.0.1"
    share_counters: bool = False  # info answers any peer with this server's counters (else: the metrics endpoint)
    adapters: tuple[tuple[str, Path], ...] = ()  # LoRA adapters (name, peft directory) for the span
    give_weights: bool = True  # in a swarm, holding every file: give the model's chunks to peers (shoal.weights)
    give_rate: float = 256e6  # bytes/s given to all peers together, at most (reads are the lowest-priority work)
    weights_chunk: int = 4 << 20  # bytes per chunk of the manifest this server builds (every giver must agree)

    def __post_init__(self):
        check_device(self.device)
        if not self.model and not (self.join and self.blocks is None):
            raise UsageError(
                "a server without a model chooses one in the swarms it joins: give --join TICKET (and no --blocks), "
                "or name the model"
            )
        if self.blocks is None and not (self.new_swarm or self.join):
            raise UsageError(
                "--blocks START:END is required outside a swarm; to let the server choose its blocks, "
                "start it in a swarm (--new-swarm, or --join TICKET)"
            )
        if self.new_swarm and self.join:
            raise UsageError(
                "--new-swarm and --join exclude each other (--new-swarm starts a swarm, --join enters one)"
            )
        if self.join_anyway and not self.join:
            raise UsageError("--join-anyway goes with --join TICKET")
        if self.blocks is not None and self.num_blocks is not None:
            raise UsageError("--blocks and --num-blocks exclude each other (--num-blocks: placed automatically)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise UsageError(f"--num-blocks must be at least 1, got {self.num_blocks}")
        if self.throughput is not None and not 0 <= self.throughput < 1e12:
            raise UsageError(f"--throughput must be a non-negative number, got {self.throughput}")
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise UsageError(f"--max-batch and --prefill-chunk must be at least 1, got {self.max_batch}, "
                             f"{self.prefill_chunk}")  # fmt: skip
        if self.page_size < 1 or self.cache_tokens < self.page_size:
            raise UsageError(f"--page-size must be in [1, --cache-tokens {self.cache_tokens}], got {self.page_size}")
        if self.packed_weights and not (
            self.device == "cpu" and self.dtype == torch.float32 and self.quant is Quantization.NONE
        ):
            raise UsageError("--packed-weights is for fp32 weights on the CPU (not with --device, --dtype or --quant)")
        if not 0.0 <= self.merge_wait <= 4.0:
            raise UsageError(f"--merge-wait must be in [0, 4], got {self.merge_wait}")
        if not self.contended_cost >= 1.0:
            raise UsageError(f"--contended-cost must be at least 1, got {self.contended_cost}")
        if not 1.0 <= self.kv_overcommit <= 64.0:
            raise UsageError(f"--kv-overcommit must be in [1, 64], got {self.kv_overcommit}")
        if not self.balance_period > 0:
            raise UsageError(f"--balance-period must be positive, got {self.balance_period}")
        if self.adapters and self.quant is not Quantization.NONE:
            raise UsageError("LoRA adapters on quantised servers are not supported (drop --quant or --adapter)")
        if len(self.adapters) > MAX_ADAPTERS:
            raise UsageError(f"at most {MAX_ADAPTERS} --adapter flags, got {len(self.adapters)}")
        names = [name for name, _ in self.adapters]
        if len(set(names)) != len(names):
            raise UsageError(f"--adapter names must differ, got {', '.join(names)}")

    @property
    def placed_automatically(self) -> bool:
        return self.blocks is None
