"""Calibrates the tolerance of :mod:`shoal.verify.compare`: how far honest replicas of a span are apart,
and how small a corruption the calibrated tolerance still catches.

    scripts/isolated python -m bench.calibrate_verify [--quick]

Honest replicas compute the same blocks on the same inputs but differ in what a server may honestly
differ in. Against a reference (torch threads 2, batch 1, sdpa, one stateless forward of all positions)
each case measures :func:`~shoal.verify.compare.row_discrepancy` of these variants:

- ``threads1``: torch threads 1 in this process (``torch.set_num_threads`` between calls);
- ``child_threads1``: a fresh child process with one torch thread (same inputs, sent by file);
- ``batch3``: the row inside a batch of 3 with two other rows, itself and one other left-padded;
- ``session_prefill``: one session step over all positions (through the KV cache);
- ``decode1`` / ``chunk8``: a session prefills a prompt, then steps 1 (8) positions at a time;
- ``combined``: threads 1, batch 3 left-padded and decode 1 at a time, all at once;
- ``sdpa_math``: sdpa's math backend instead of the one torch picks (flash attention on CPU);
- ``eager`` / ``combined_eager``: eager attention instead of sdpa (alone; with ``combined``).

The last three change the attention kernel. Every shoal server runs sdpa with torch's choice of backend
(``shoal.models.decoder.prepare_config``), so between CPU servers the kernel does not vary; the
``*_same_kernel`` keys leave those variants out.

Two statistics per case: the *spike*, the largest discrepancy at any position, and the *pair*, the
largest over positions of ``min(d[j], d[j+1])`` in one row (what :class:`~shoal.verify.compare.Tolerance`'s
``sustained`` level is compared with: honest replicas spike at isolated positions, corruption persists).

Models: tiny random llama, qwen2, gemma3 and mistral (``testkit.tiny``, four weight seeds each, spans
0:4 and 2:4, 24 and 64 positions decoded in full, and 300 positions for one seed) and SmolLM2-135M
(spans 0:15 and 15:30, inputs: embeddings of the GPL-3 text, the second span's from the first's
output; 32 and 300 positions), in float32 and bfloat16.

Corruption, through the fault seam's own backend (:class:`testkit.faulty.FaultyBackend`) in a session
that prefills a prompt and then decodes 8 positions one at a time, compared with an honest one-pass
forward (so honest discrepancy is part of each trial): :class:`testkit.faults.Noise` of relative sizes
1e-5 .. 0.3 (those near the dtype's tolerance) on all 8 decoded positions (*sustained*) or on the first
of them only (*single*). A size is detected when :func:`~shoal.verify.compare.first_disagreement` at the
calibrated tolerance names the first corrupted position in every trial.

Prints one JSON object, per dtype: ``honest_max_<dtype>`` (largest spike, all variants),
``honest_max_same_kernel_<dtype>``, ``honest_pair_max_same_kernel_<dtype>``, ``threshold_<dtype>`` and
``sustained_threshold_<dtype>`` (the constants in use, :func:`~shoal.verify.compare.tolerance_for`) with
their ratios to the honest maxima, ``smallest_detected_noise_<dtype>`` (sustained) and
``smallest_detected_single_noise_<dtype>``, ``detected_at_bar_<dtype>``, ``false_alarm_variants_<dtype>``
(variants an honest case of which the tolerance flags), ``bar_met_<dtype>`` / ``bar_met_same_kernel_<dtype>``
(the issue's bar: the smallest detected noise at most 1e-3 in fp32 and 5e-2 in bf16 and at most 10x the
largest honest discrepancy, and no honest case flagged), ``largest_honest_<dtype>`` (the top cases),
``relative_l2_max_<dtype>`` (the plain relative L2, for comparison); ``honest_by_variant`` (spike, pair
and flagged cases per variant), ``honest_by_model`` and ``noise`` (per dtype, kind and size: the smallest
reading over the trials and how many were detected at the right position).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from shoal.models import get_family
from shoal.verify.compare import first_disagreement, row_discrepancy, tolerance_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PARENT_THREADS = 2
#: the issue's bar: the smallest detected corruption at most this (relative) per dtype, and at most 10x honest
BAR = {"fp32": 1e-3, "bf16": 5e-2}
#: 1e-5 .. 0.3, 4 per decade, and the bar's sizes themselves; each dtype tries those near its tolerance
NOISE_SIZES = sorted({*(10 ** (k / 4) for k in range(-20, -1)), *BAR.values()})


def noise_sizes(dtype: torch.dtype) -> list[float]:
    """The sizes worth trying: from a quarter of the lowest level to 5x the highest, and the bar's."""
    tolerance = tolerance_for(dtype)
    low = (tolerance.sustained or tolerance.relative) / 4
    return [s for s in NOISE_SIZES if low <= s <= 5 * tolerance.relative or s in BAR.values()]


KERNEL_VARIANTS = frozenset({"eager", "sdpa_math", "combined_eager"})
NOISE_DECODED = 8  # positions a noise trial decodes one at a time after its prompt


@dataclass
class Model:
    """A checkpoint's blocks as a state dict, and how to make inputs for its first span."""

    name: str
    config: object
    state_dict: dict[str, torch.Tensor]
    spans: list[tuple[int, int]]
    embed: Callable[[int, int], torch.Tensor]  # (seed, length) -> [1, length, hidden] fp32
    lengths: list[int]
    prompt: Callable[[int], int]  # length -> positions prefilled before decoding one at a time
    noise_trials: bool = True
    built: dict = field(default_factory=dict)

    def span(self, start: int, end: int, dtype: torch.dtype, attn: str = "sdpa"):
        key = (start, end, dtype, attn)
        if key not in self.built:
            config = copy.deepcopy(self.config)
            config._attn_implementation = attn
            self.built[key] = get_family(config).build_span(config, start, end, self.state_dict, dtype, "cpu")
        return self.built[key]


def tiny(family: str, seed: int, lengths: list[int]) -> Model:
    from testkit.tiny import tiny_model

    model = tiny_model(family, seed)
    embed_tokens = model.get_input_embeddings()

    def embed(input_seed: int, length: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 * seed + input_seed)
        return embed_tokens(torch.randint(2, model.config.vocab_size, (1, length), generator=generator)).detach()

    state = {k: v.detach() for k, v in model.state_dict().items()}
    prompt = lambda n: 1 if n <= 64 else n - 24  # noqa: E731  (decode short sequences in full)
    return Model(f"tiny-{family}#{seed}", model.config, state, [(0, 4), (2, 4)], embed, lengths, prompt, seed == 0)


def smollm2(lengths: list[int]) -> Model:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from shoal.checkpoints.fetch import fetch_model
    from shoal.checkpoints.loading import load_client_head, load_config, load_tensors
    from testkit.quality import licence_tokens

    directory = fetch_model("smollm2", progress=False)
    state = load_tensors(directory, lambda name: ".layers." in name, progress=False)
    head = load_client_head(directory)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(directory / "tokenizer.json")))
    text = licence_tokens(tokenizer, 4096).reshape(1, -1)

    def embed(input_seed: int, length: int) -> torch.Tensor:
        offset = (input_seed * 997) % (text.shape[1] - length)
        with torch.inference_mode():
            return head.embed(text[:, offset : offset + length]).float().clone()

    spans = [(0, 15), (15, 30)]
    return Model("smollm2", load_config(directory), state, spans, embed, lengths, lambda n: n - 12)


def build_models(quick: bool) -> list[Model]:
    if quick:
        return [tiny("llama", 0, [24]), smollm2([32])]
    families = ("llama", "qwen2", "gemma3", "mistral")
    tinies = [tiny(family, seed, [24, 64, 300] if seed == 0 else [24, 64]) for family in families for seed in range(4)]
    return [*tinies, smollm2([32, 300])]


# ---- the honest variants ------------------------------------------------------------------------
def forward(span, hidden, position_ids=None, mask=None) -> torch.Tensor:
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1])[None].expand(hidden.shape[0], -1)
    with torch.inference_mode():
        return span(hidden, position_ids, mask, cache=None, past_length=0).float()


def session(span, hidden, position_ids, mask, prefill: int, step: int) -> torch.Tensor:
    """A session's outputs: ``prefill`` positions in one step, then ``step`` at a time."""
    batch, n = hidden.shape[:2]
    cache, outs, at = span.allocate_cache(batch, n), [], 0
    with torch.inference_mode():
        while at < n:
            size = prefill if at == 0 else min(step, n - at)
            window = None if mask is None else mask[:, : at + size]
            piece = span(
                hidden[:, at : at + size], position_ids[:, at : at + size], window, cache=cache, past_length=at
            )
            outs.append(piece.float())
            at += size
    return torch.cat(outs, dim=1)


PAD = 5  # left padding of the compared row inside the batch of 3


def batched(hidden: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden`` as row 1 of a batch of 3, left-padded by :data:`PAD`, between a full-width row and a
    row left-padded by 3; returns (batch, position_ids, mask)."""
    width = hidden.shape[1] + PAD
    generator = torch.Generator().manual_seed(seed + 1000)
    scale = hidden.float().std()
    others = torch.randn(2, width, hidden.shape[2], generator=generator) * scale
    garbage = torch.randn(1, PAD, hidden.shape[2], generator=generator) * scale  # padded slots: masked anyway
    rows = torch.cat([others[:1], torch.cat([garbage, hidden.float()], dim=1), others[1:]]).to(hidden.dtype)
    mask = torch.ones(3, width, dtype=torch.bool)
    mask[1, :PAD] = False
    mask[2, :3] = False
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
    return rows, position_ids, mask


@dataclass(frozen=True)
class Reading:
    """One honest comparison: its spike, its pair, whether the tolerance flags it, its plain relative L2."""

    spike: float
    pair: float
    flagged: bool
    relative_l2: float


def reading(reference: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> Reading:
    per_row = row_discrepancy(reference, out)
    pair = float(torch.minimum(per_row[:, :-1], per_row[:, 1:]).max()) if per_row.shape[1] > 1 else 0.0
    l2 = (reference - out).norm(dim=-1) / torch.maximum(reference.norm(dim=-1), out.norm(dim=-1)).clamp_min(1e-30)
    flagged = first_disagreement(reference, out, tolerance_for(dtype)) is not None
    return Reading(float(per_row.max()), pair, flagged, float(l2.max()))


def honest_case(model: Model, span: tuple[int, int], dtype, hidden, seed: int) -> tuple[torch.Tensor, dict]:
    """The reference output and each variant's :class:`Reading` against it."""
    reference, variants = honest_outputs(model, span, dtype, hidden, seed)
    return reference, {name: reading(reference, out, dtype) for name, out in variants.items()}


def honest_outputs(model: Model, span: tuple[int, int], dtype, hidden, seed: int, kernels: bool = True):
    """The reference output and each variant's output (``[1, n, hidden]`` float32); ``kernels``: the
    attention-kernel variants too."""
    sdpa, eager = model.span(*span, dtype), (model.span(*span, dtype, "eager") if kernels else None)
    n = hidden.shape[1]
    prompt = model.prompt(n)
    positions = torch.arange(n)[None]
    rows, batch_positions, mask = batched(hidden, seed)
    torch.set_num_threads(PARENT_THREADS)
    reference = forward(sdpa, hidden)
    variants: dict[str, torch.Tensor] = {}
    torch.set_num_threads(1)
    variants["threads1"] = forward(sdpa, hidden)
    variants["combined"] = session(sdpa, rows, batch_positions, mask, prompt + PAD, 1)[1:2, PAD:]
    if kernels:
        variants["combined_eager"] = session(eager, rows, batch_positions, mask, prompt + PAD, 1)[1:2, PAD:]
    torch.set_num_threads(PARENT_THREADS)
    variants["batch3"] = forward(sdpa, rows, batch_positions, mask)[1:2, PAD:]
    variants["session_prefill"] = session(sdpa, hidden, positions, None, n, n)
    variants["decode1"] = session(sdpa, hidden, positions, None, prompt, 1)
    variants["chunk8"] = session(sdpa, hidden, positions, None, prompt, 8)
    if kernels:
        variants["eager"] = forward(eager, hidden)
        with sdpa_kernel(SDPBackend.MATH):
            variants["sdpa_math"] = forward(sdpa, hidden)
    return reference, variants


# ---- the corruption ------------------------------------------------------------------------------
def noise_trials(span, hidden: torch.Tensor, seed: int, dtype) -> dict[tuple[str, float], tuple[float, bool]]:
    """Per (kind, size): the discrepancy at the first corrupted position and whether
    :func:`first_disagreement` named exactly that position, for a faulty session against an honest
    one-pass forward."""
    from shoal.server.backend import SpanBackend
    from testkit.faults import FaultRecord, Noise, When
    from testkit.faulty import FaultState, FaultyBackend

    n = hidden.shape[1]
    first = n - NOISE_DECODED
    executor = ThreadPoolExecutor(1)
    honest_backend = SpanBackend(span, hidden.shape[-1], executor=executor)
    positions = torch.arange(n)[None]
    tolerance = tolerance_for(dtype)

    async def decode(backend) -> torch.Tensor:
        cache = await backend.allocate_cache(1, n)
        outs = [await backend.run(hidden[:, :first], positions[:, :first], None, cache, 0)]
        for at in range(first, n):
            outs.append(await backend.run(hidden[:, at : at + 1], positions[:, at : at + 1], None, cache, at))
        return torch.cat(outs, dim=1).float()

    async def run_all() -> dict:
        auditor = (await honest_backend.run(hidden, positions, None)).float()
        found = {}
        for kind, last_step in (("sustained", None), ("single", 1)):  # step 0 is the prompt
            for size in noise_sizes(dtype):
                when = When(from_position=first, last_step=last_step)
                state = FaultState([Noise(relative=size, seed=seed, when=when)], FaultRecord(), False)
                lied = await decode(FaultyBackend(honest_backend, state))
                value = float(row_discrepancy(auditor, lied)[:, first].max())
                found[kind, size] = (value, first_disagreement(auditor, lied, tolerance) == first)
        return found

    try:
        return asyncio.run(run_all())
    finally:
        executor.shutdown()


# ---- the child process (threads 1, fresh) --------------------------------------------------------
def child_main(cases_path: str, out_path: str, quick: bool) -> None:
    """Recompute every case's reference with one torch thread in a fresh process."""
    torch.set_num_threads(1)
    cases = torch.load(cases_path)
    models = {m.name: m for m in build_models(quick)}
    outputs = {}
    for key, hidden in cases.items():
        name, start, end, dtype_name = key.split("|")[:4]
        outputs[key] = forward(models[name].span(int(start), int(end), DTYPES[dtype_name]), hidden)
    torch.save(outputs, out_path)


def child_threads(cases: dict[str, torch.Tensor], references: dict[str, torch.Tensor], quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out_path = Path(tmp) / "cases.pt", Path(tmp) / "out.pt"
        torch.save(cases, cases_path)
        command = [sys.executable, "-m", "bench.calibrate_verify", "--child", str(cases_path), str(out_path)]
        subprocess.run([*command, *(["--quick"] if quick else [])], check=True)
        outputs = torch.load(out_path)
    found = {}
    for key, out in outputs.items():
        name, start, end, dtype_name, seed, n = key.split("|")
        found[f"{name}:{start}-{end}", dtype_name, "child_threads1", int(seed), int(n)] = reading(
            references[key], out, DTYPES[dtype_name]
        )
    return found


def run(quick: bool) -> dict:
    started = time.monotonic()
    seeds = [0] if quick else [0, 1]
    honest: dict[tuple, Reading] = {}  # (model span, dtype, variant, seed, n) -> reading
    child_cases: dict[str, torch.Tensor] = {}
    references: dict[str, torch.Tensor] = {}
    noise: dict[str, dict] = {name: defaultdict(list) for name in DTYPES}
    for model in build_models(quick):
        inputs = {(seed, n): model.embed(seed, n) for seed in seeds for n in model.lengths}
        for start, end in model.spans:
            for dtype_name, dtype in DTYPES.items():
                for (seed, n), embedded in inputs.items():
                    hidden = embedded if start == 0 else forward(model.span(0, start, torch.float32), embedded)
                    hidden = hidden.to(dtype)
                    reference, readings = honest_case(model, (start, end), dtype, hidden, seed)
                    key = f"{model.name}|{start}|{end}|{dtype_name}|{seed}|{n}"
                    child_cases[key], references[key] = hidden, reference
                    for variant, value in readings.items():
                        honest[f"{model.name}:{start}-{end}", dtype_name, variant, seed, n] = value
                    if model.noise_trials and n == min(model.lengths) and seed == 0:
                        for noise_seed in (0, 1) if model.name.startswith("tiny") else (0,):
                            trials = noise_trials(model.span(start, end, dtype), hidden, noise_seed, dtype)
                            for kind_size, value in trials.items():
                                noise[dtype_name][kind_size].append(value)
        model.built.clear()
    honest.update(child_threads(child_cases, references, quick))
    return summarise(honest, noise, time.monotonic() - started)


# ---- the summary ---------------------------------------------------------------------------------
def _smallest_detected(trials: dict, kind: str) -> tuple[float | None, dict]:
    """The smallest size from which every larger size was always detected, and the table down to it."""
    table, smallest = {}, None
    for size in sorted((s for k, s in trials if k == kind), reverse=True):
        found = trials[kind, size]
        table[f"{size:.3g}"] = {
            "min_reading": min(v for v, _ in found),
            "detected": f"{sum(c for _, c in found)}/{len(found)}",
        }
        if not all(caught for _, caught in found):
            break
        smallest = size
    return smallest, table


def summarise(honest: dict[tuple, Reading], noise: dict, seconds: float) -> dict:
    result: dict = {}
    by_variant: dict = defaultdict(dict)
    by_model: dict = defaultdict(dict)
    for (model, dtype_name, variant, _seed, _n), r in honest.items():
        entry = by_variant[dtype_name].setdefault(variant, {"spike": 0.0, "pair": 0.0, "flagged": 0, "cases": 0})
        entry["spike"], entry["pair"] = max(entry["spike"], r.spike), max(entry["pair"], r.pair)
        entry["flagged"] += r.flagged
        entry["cases"] += 1
        by_model[dtype_name][model] = max(by_model[dtype_name].get(model, 0.0), r.spike)
    for dtype_name, dtype in DTYPES.items():
        mine = {k: r for k, r in honest.items() if k[1] == dtype_name}
        same = {k: r for k, r in mine.items() if k[2] not in KERNEL_VARIANTS}
        largest, largest_same = max(r.spike for r in mine.values()), max(r.spike for r in same.values())
        pair_same = max(r.pair for r in same.values())
        tolerance = tolerance_for(dtype)
        smallest, sustained_table = _smallest_detected(noise[dtype_name], "sustained")
        smallest_single, single_table = _smallest_detected(noise[dtype_name], "single")
        at_bar = noise[dtype_name]["sustained", BAR[dtype_name]]
        detects = smallest is not None and smallest <= BAR[dtype_name]
        result[f"honest_max_{dtype_name}"] = largest
        result[f"honest_max_same_kernel_{dtype_name}"] = largest_same
        result[f"honest_pair_max_same_kernel_{dtype_name}"] = pair_same
        result[f"threshold_{dtype_name}"] = tolerance.relative
        result[f"sustained_threshold_{dtype_name}"] = tolerance.sustained
        result[f"threshold_over_honest_same_kernel_{dtype_name}"] = tolerance.relative / largest_same
        if tolerance.sustained is not None:
            result[f"sustained_over_honest_pair_same_kernel_{dtype_name}"] = tolerance.sustained / pair_same
        result[f"smallest_detected_noise_{dtype_name}"] = smallest
        result[f"smallest_detected_single_noise_{dtype_name}"] = smallest_single
        result[f"smallest_detected_over_honest_{dtype_name}"] = smallest / largest if smallest else None
        result[f"detected_at_bar_{dtype_name}"] = f"{sum(c for _, c in at_bar)}/{len(at_bar)}"
        result[f"false_alarm_variants_{dtype_name}"] = {
            v: f"{e['flagged']}/{e['cases']}" for v, e in by_variant[dtype_name].items() if e["flagged"]
        }
        result[f"bar_met_{dtype_name}"] = bool(
            detects and smallest <= 10 * largest and not any(r.flagged for r in mine.values())
        )
        result[f"bar_met_same_kernel_{dtype_name}"] = bool(
            detects and smallest <= 10 * largest_same and not any(r.flagged for r in same.values())
        )
        ranked = sorted(((r.spike, r.pair, k) for k, r in mine.items()), reverse=True)[:6]
        result[f"largest_honest_{dtype_name}"] = [
            f"spike {s:.3g} pair {p:.3g}: {m} {variant} seed {sd} n {n}" for s, p, (m, _, variant, sd, n) in ranked
        ]
        result[f"relative_l2_max_{dtype_name}"] = max(r.relative_l2 for r in mine.values())
        result.setdefault("noise", {})[dtype_name] = {"sustained": sustained_table, "single": single_table}
    result["honest_by_variant"] = by_variant
    result["honest_by_model"] = by_model
    result["cases"] = len(honest)
    result["seconds"] = round(seconds, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny model, one seed, short sequences")
    parser.add_argument("--child", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(*args.child, quick=args.quick)
        return
    print(json.dumps(run(args.quick), indent=2))


if __name__ == "__main__":
    main()
