"""GPU smoke test: a random Llama-3-8B-shaped model on 2 servers sharing one GPU, vs plain transformers.

    bench/gpu_smoke.sh [--device cuda] [--dtype bfloat16] [--new-tokens 32] [--repeats 3] [--tiny]

(run it through ``bench/gpu_smoke.sh``, which installs shoal and enters a loopback-only network
namespace; ``python -m bench.gpu_smoke`` refuses to run outside one.)

1. Writes a random-weight checkpoint once (``save_sharded``, in ``--dtype``) under ``--work-dir``:
   Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 kv heads, intermediate 14336, vocab
   128256, rope_theta 500000), or with ``--tiny`` a 4-block toy (for a CPU run of this script).
2. Starts 2 ``shoal serve`` processes (``--device --dtype``, blocks ``0:n/2`` and ``n/2:n``) while
   this process loads the same checkpoint with ``AutoModelForCausalLM.from_pretrained`` on the
   same device.
3. Greedy parity: ``--new-tokens`` tokens from a fixed prompt, swarm vs local, token by token.
4. Decode speed: ``--repeats`` alternated runs each; tokens/s excludes the first token (TTFT).

Prints one JSON object (also written to ``--json`` if given). Exit status 0 only if the tokens match.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

from bench.measure import BlockTimer, Server, halves, run_once, summarize
from testkit.tiny import LARGE_INIT, TINY_SHAPE

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    pad_token_id=None,
)
# the tests' tiny llama (testkit.tiny), with Llama 3's rope and norm settings
TINY = {**TINY_SHAPE, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "eos_token_id": 2, "pad_token_id": None}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**shape)  # transformers 5 turns rope_theta into rope_parameters


def write_checkpoint(out: Path, shape: dict, dtype: torch.dtype, device: str, seed: int, initializer_range: float):
    """Random weights, built directly on ``device`` in ``dtype`` (an 8B model in fp32 on the CPU would
    take 32 GB and minutes), saved sharded one block per file. Skipped when ``out`` is complete."""
    from transformers import LlamaForCausalLM

    from shoal.checkpoints import save_sharded

    stamp = json.dumps({"shape": shape, "dtype": str(dtype), "seed": seed, "init": initializer_range}, sort_keys=True)
    marker = out / ".smoke-complete"
    if marker.is_file() and marker.read_text() == stamp:
        return False
    config = make_config(shape)
    config.initializer_range = initializer_range
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    save_sharded(model, config, out, dtype=dtype)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    marker.write_text(stamp)
    return True


def load_local(path: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map=device)
    except Exception as exc:  # device_map may want accelerate
        print(f"gpu_smoke: from_pretrained(device_map=...) failed ({exc}); loading on cpu, then .to()", file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
    return model.eval()


def check_isolated() -> list[str]:
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"] and os.environ.get("SHOAL_SMOKE_ALLOW_NETWORK") != "1":
        raise SystemExit(f"gpu_smoke: not in a loopback-only namespace (interfaces {names}); use bench/gpu_smoke.sh")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--tiny", action="store_true", help="a 4-block toy model instead of the 8B shape")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--work-dir", default=os.environ.get("SHOAL_SMOKE_DIR", "/tmp/shoal-gpu-smoke"))
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args(argv)
    interfaces = check_isolated()
    dtype = DTYPES[args.dtype]
    device = args.device
    is_cuda = device.startswith("cuda")
    if is_cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_smoke: --device cuda but torch.cuda.is_available() is False")
    sync = torch.cuda.synchronize if is_cuda else None
    shape = TINY if args.tiny else LLAMA3_8B
    # LARGE_INIT keeps a toy model's greedy choices far from ties; 0.02 is Llama's own.
    initializer_range = LARGE_INIT if args.tiny else 0.02
    started = time.perf_counter()
    timings: dict[str, float] = {}
    result: dict = {
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if is_cuda else "cpu",
        "dtype": args.dtype,
        "model": {"shape": "tiny" if args.tiny else "llama-3-8b", **{k: v for k, v in shape.items() if v is not None}},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "interfaces": interfaces,
    }
    import transformers

    result["versions"]["transformers"] = transformers.__version__

    path = Path(args.work_dir) / ("tiny" if args.tiny else "llama3-8b-random") / args.dtype
    t = time.perf_counter()
    result["checkpoint_written"] = write_checkpoint(path, shape, dtype, device, 0, initializer_range)
    timings["checkpoint_s"] = time.perf_counter() - t
    result["checkpoint"] = str(path)

    from shoal import AutoDistributedModelForCausalLM
    from shoal.checkpoints import load_config
    from shoal.transport import TransportConfig

    config = load_config(path)
    blocks = halves(config.num_hidden_layers)
    t = time.perf_counter()
    flags = ["--device", device, "--dtype", args.dtype, "--share-counters"]
    servers = [Server(path, b, extra_args=flags) for b in blocks]
    try:
        local = load_local(path, dtype, device)  # while the servers load
        result["model"]["params_m"] = round(sum(p.numel() for p in local.parameters()) / 1e6, 3)
        timings["local_load_s"] = time.perf_counter() - t
        tickets = [s.wait_ready(timeout=360) for s in servers]
        timings["servers_ready_s"] = time.perf_counter() - t
        t = time.perf_counter()
        swarm = AutoDistributedModelForCausalLM.from_pretrained(
            str(path), tickets, dtype=dtype, device=device, transport=TransportConfig(bind_addr="127.0.0.1:0")
        )
        timings["client_connect_s"] = time.perf_counter() - t
        result["route"] = swarm.blocks.describe_route()
        remote = swarm.blocks
        swarm.blocks = BlockTimer(remote)  # per-token split: inside the remote block calls vs the client

        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(3, config.vocab_size, (1, args.prompt_tokens), generator=generator).to(device)
        pad = 0

        # warm-up (CUDA context, cuBLAS handles, first connections), then parity on a fresh run
        for model in (local, swarm):
            run_once(model, ids, 2, pad, sync)
        _, expected = run_once(local, ids, args.new_tokens, pad, sync)
        _, got = run_once(swarm, ids, args.new_tokens, pad, sync)
        expected, got = expected[0, ids.shape[1] :].tolist(), got[0, ids.shape[1] :].tolist()
        mismatch = next((i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b), None)
        result["parity"] = {
            "new_tokens": args.new_tokens,
            "identical": mismatch is None,
            "first_mismatch": mismatch,
            "local_tokens": expected,
            "swarm_tokens": got,
        }
        if mismatch is not None:  # a near-tie (numerics) or a real divergence? the local top-2 gap there
            out = local.generate(
                ids, max_new_tokens=mismatch + 1, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=pad,
            )  # fmt: skip
            top2 = out.logits[mismatch][0].float().topk(2).values
            result["parity"]["local_top2_logit_gap_at_mismatch"] = round(float(top2[0] - top2[1]), 5)

        before = [info.counters for info in remote.server_infos()]
        runs: dict[str, list[dict]] = {"local": [], "swarm": []}
        for rep in range(args.repeats):
            order = ["local", "swarm"] if rep % 2 == 0 else ["swarm", "local"]
            for label in order:
                model = local if label == "local" else swarm
                runs[label].append(run_once(model, ids, args.new_tokens, pad, sync)[0])
        speed = {label: summarize(rs) for label, rs in runs.items()}  # swarm: blocks_ms, client_ms too
        speed["ratio"] = round(speed["swarm"]["decode_tok_s_median"] / speed["local"]["decode_tok_s_median"], 3)
        # the servers' own compute per step, from their step_seconds counters (prefill steps
        # included, so a slight overestimate): the part of blocks_ms that is not transport
        after = [info.counters for info in remote.server_infos()]
        speed["swarm"]["server_compute_ms"] = [
            round((a.step_seconds - b.step_seconds) / max(1, a.steps - b.steps) * 1e3, 3)
            for a, b in zip(after, before, strict=True)
        ]
        result["decode"] = speed
        if is_cuda:
            result["gpu_memory_gb_this_process"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        remote.close()
    finally:
        for server in servers:
            server.stop()
    timings["total_s"] = time.perf_counter() - started
    result["timings"] = {k: round(v, 2) for k, v in timings.items()}
    result["ok"] = result["parity"]["identical"]
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
