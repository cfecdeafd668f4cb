"""What a server can do: its measured throughput per block, and how many blocks fit in its memory.

A measurement runs one block of the model's family (random weights of the real shapes, in the
serving dtype, on the serving device) on the server's compute thread (see
:func:`shoal.server.backend.compute_thread`; call :func:`measure_compute` through it):

* ``step_ms``: median latency of a one-token cached decode step (after a long prompt);
* ``prefill_tokens_per_s``: tokens/s of that prompt (512 tokens, fewer when a big model would take
  longer than the time budget);
* network capacity (:func:`measure_network`): bytes/s of a 2 MiB echo through a peer's
  ``shoal/meta/1`` ping, when the server has a peer to ask.

The throughput a server announces (tokens/s per block, what placement weighs by) is
``min(1000 / step_ms, network bytes/s / (hidden_size * 4 * 2))``: a decode step moves one float32
hidden state in and one out. Compute measurements are cached in ``$SHOAL_HOME/throughput.json``
(default ``~/.cache/shoal``), keyed by the model config, device, dtype, torch threads and torch
version; the network is measured at every start (it depends on the peer, and costs milliseconds).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shoal.checkpoints.fetch import shoal_home
from shoal.models import get_family
from shoal.models.packed import packed_bytes
from shoal.quantization import Quantization
from shoal.quantization.weights import block_quantizer, planned_bytes
from shoal.transport import META, Node, Ticket
from shoal.wire import Message
from shoal.wire.schema import Ping

log = logging.getLogger(__name__)

CACHE_FILE = "throughput.json"
PROMPT_TOKENS = 512
DECODE_STEPS = 8
TIME_BUDGET_S = 3.0  # a big model on a slow device measures for about this long
ECHO_BYTES = 2 << 20
MEMORY_MARGIN = 0.1  # of the free memory, kept free (at least MIN_MARGIN_BYTES)
MIN_MARGIN_BYTES = 1 << 30


@dataclass(frozen=True)
class ComputeMeasurement:
    step_ms: float  # one-token cached decode step through one block, median
    prefill_tokens_per_s: float  # through one block
    prompt_tokens: int  # the prompt length the prefill figure comes from

    @property
    def decode_tokens_per_s(self) -> float:
        return 1000.0 / self.step_ms


def network_tokens_per_s(bytes_per_s: float, hidden_size: int) -> float:
    """Decode tokens/s a link carries: one float32 hidden state each way per token."""
    return bytes_per_s / (hidden_size * 4 * 2)


def announced_throughput(compute: ComputeMeasurement, network_bytes_per_s: float | None, hidden_size: int) -> float:
    if network_bytes_per_s is None:
        return compute.decode_tokens_per_s
    return min(compute.decode_tokens_per_s, network_tokens_per_s(network_bytes_per_s, hidden_size))


# ---- one block of the family, with random weights ---------------------------------------------------
def meta_block(hf_config, index: int = 0):
    """Block ``index`` of the family on the meta device (shapes only)."""
    from shoal.models.decoder import prepare_config

    family = get_family(hf_config)
    layer_cls = getattr(family, "layer_cls", None)
    if layer_cls is None:
        raise ValueError(f"cannot size or measure blocks of {hf_config.model_type!r}: pass --throughput/--num-blocks")
    with torch.device("meta"):
        return layer_cls(prepare_config(hf_config), index)


def block_bytes(
    hf_config, dtype: torch.dtype, quantization: Quantization = Quantization.NONE, device: str = "cpu"
) -> int:
    """Bytes of one block's weights in ``dtype`` on ``device``, its weight matrices held as
    ``quantization`` says."""
    return planned_bytes(meta_block(hf_config), dtype, quantization, device)


def _random_span(hf_config, dtype: torch.dtype, device: str, quantization: Quantization = Quantization.NONE):
    family = get_family(hf_config)
    generator = torch.Generator(device=device).manual_seed(0)
    tensors = {}  # named as the layer holds them (relative to the block, experts already fused)
    for name, meta in meta_block(hf_config).state_dict().items():
        tensor = torch.empty(meta.shape, dtype=dtype, device=device)
        if meta.dim() >= 2:
            tensor.normal_(0.0, 0.02, generator=generator)
        else:
            tensor.fill_(1.0)
        tensors[name] = tensor
    block = block_quantizer(quantization)(family.build_block(hf_config, 0, tensors, dtype, device))
    return family.assemble_span(hf_config, 0, 1, [block], dtype, device)


# ---- compute -----------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover (a dependency)
        return None
    if not sys.stderr.isatty():
        return None
    return tqdm(total=total, desc="measuring throughput", unit="step", leave=False, file=sys.stderr)


def measure_compute(
    hf_config,
    dtype: torch.dtype,
    device: str,
    time_budget: float = TIME_BUDGET_S,
    quantization: Quantization = Quantization.NONE,
) -> ComputeMeasurement:
    """Time one block (its weight matrices held as ``quantization`` says): a prompt of up to
    ``PROMPT_TOKENS`` and ``DECODE_STEPS`` cached steps after it. Runs on the calling thread: call
    it on the server's compute thread."""
    started = time.perf_counter()
    bar = _progress(3 + DECODE_STEPS)
    try:
        with torch.inference_mode():
            span = _random_span(hf_config, dtype, device, quantization)
            hidden_size = hf_config.hidden_size
            cache = span.allocate_cache(1, PROMPT_TOKENS + DECODE_STEPS + 1)

            def run(tokens: int, past: int) -> float:
                hidden = torch.randn(1, tokens, hidden_size, device=device, dtype=dtype)
                positions = torch.arange(past, past + tokens, device=device).unsqueeze(0)
                _sync(device)
                t0 = time.perf_counter()
                span(hidden, positions, None, cache=cache, past_length=past)
                _sync(device)
                if bar is not None:
                    bar.update(1)
                return time.perf_counter() - t0

            run(8, 0)  # warm-up: lazy initialisation, kernels
            run(1, 8)
            probe = 32
            per_token = run(probe, 0) / probe
            left = time_budget - (time.perf_counter() - started)
            # prompt length that fits half the remaining budget (the steps take the rest)
            prompt = int(min(PROMPT_TOKENS, max(probe, left / 2 / max(per_token, 1e-9))))
            prefill_s = run(prompt, 0)
            steps = []
            for i in range(DECODE_STEPS):
                steps.append(run(1, prompt + i))
                if len(steps) >= 3 and time.perf_counter() - started > time_budget:
                    break
    finally:
        if bar is not None:
            bar.close()
    return ComputeMeasurement(
        step_ms=statistics.median(steps) * 1e3, prefill_tokens_per_s=prompt / prefill_s, prompt_tokens=prompt
    )


def _config_hash(hf_config) -> str:
    config = hf_config.to_dict()
    for key in ("_name_or_path", "transformers_version", "architectures"):
        config.pop(key, None)
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_key(
    hf_config, dtype: torch.dtype, device: str, threads: int, quantization: Quantization = Quantization.NONE
) -> str:
    where = device
    if device.startswith("cuda"):
        where = f"{device} {torch.cuda.get_device_name(device)}"
    dtype_name = str(dtype).removeprefix("torch.")
    if quantization is not Quantization.NONE:
        dtype_name += f"+{quantization}"
    return f"{_config_hash(hf_config)}|{where}|{dtype_name}|threads={threads}|torch={torch.__version__}"


def cache_path() -> Path:
    return shoal_home() / CACHE_FILE


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock beside ``path`` (servers starting together share the cache file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover (not POSIX)
            pass
        yield


def cached_compute(
    hf_config,
    dtype: torch.dtype,
    device: str,
    path: Path | None = None,
    time_budget: float = TIME_BUDGET_S,
    *,
    quantization: Quantization = Quantization.NONE,
) -> tuple[ComputeMeasurement, bool]:
    """The compute measurement for this config (and weight format) on this machine: from the cache,
    or measured now (and cached). Returns it and whether it came from the cache. Call on the compute
    thread."""
    path = path or cache_path()
    key = cache_key(hf_config, dtype, device, torch.get_num_threads(), quantization)
    saved = _read_cache(path).get(key)
    if isinstance(saved, dict):
        try:
            return ComputeMeasurement(**saved), True
        except TypeError:
            pass
    measured = measure_compute(hf_config, dtype, device, time_budget, quantization)
    try:
        with _locked(path):
            data = _read_cache(path)
            data[key] = asdict(measured)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not cache the throughput measurement in %s: %s", path, exc)
    return measured, False


# ---- network -------------------------------------------------------------------------------------
async def measure_network(node: Node, ticket: Ticket, nbytes: int = ECHO_BYTES, timeout: float = 5.0) -> float | None:
    """Bytes/s of an ``nbytes`` echo to ``ticket``'s peer (both directions counted); None if it
    does not answer in time."""
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    try:
        await node.request(ticket, META, Message("ping", 1, Ping(), []), timeout=timeout)  # connect first
        started = time.perf_counter()
        reply = await node.request(ticket, META, Message("ping", 2, Ping(), [payload]), timeout=timeout)
    except Exception as exc:  # any failure: no figure (placement then uses compute alone)
        log.info("network measurement to %s failed: %s", ticket.peer_id[:10], exc)
        return None
    elapsed = time.perf_counter() - started
    if len(reply.tensors) != 1 or reply.tensors[0].numel() != nbytes:
        return None
    return 2 * nbytes / max(elapsed, 1e-6)


# ---- memory ------------------------------------------------------------------------------------
def free_memory(device: str) -> int:
    """Bytes available for weights and caches on ``device``."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def default_num_blocks(
    hf_config,
    dtype: torch.dtype,
    device: str,
    cache_tokens: int,
    free_bytes: int | None = None,
    quantization: Quantization = Quantization.NONE,
    packed: bool = False,
) -> int:
    """How many blocks fit in the free memory (less a margin): weights (quantised ones at their
    quantised size, ``packed`` ones twice: :mod:`shoal.models.packed`) plus the per-block KV cache
    budget of ``cache_tokens`` tokens, and room to load one more block in full precision; at most
    the model's blocks. Raises when not even one fits."""
    family = get_family(hf_config)
    total = family.num_blocks(hf_config)
    free = free_memory(device) if free_bytes is None else free_bytes
    usable = free - max(MIN_MARGIN_BYTES, int(MEMORY_MARGIN * free))
    if quantization is not Quantization.NONE:
        usable -= block_bytes(hf_config, dtype)  # the block being loaded, before it is quantised
    per_block = block_bytes(hf_config, dtype, quantization, device)
    if packed:
        per_block += packed_bytes(meta_block(hf_config))
    per_block += cache_tokens * family.cache_geometry(hf_config, dtype).bytes_per_token_per_block()
    fits = usable // per_block
    if fits < 1:
        raise ValueError(
            f"not enough free memory on {device} for one block ({per_block / 2**20:.0f} MiB with its KV cache; "
            f"{free / 2**20:.0f} MiB free): pass --num-blocks or a smaller --cache-tokens"
        )
    return int(min(total, fits))
