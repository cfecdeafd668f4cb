"""Calibrates bf16's window rule and channel view (:mod:`shoal.verify.compare`, issue #34): how far honest
pairs read in each, and whether the lies the per-position rules let through are caught.

    scripts/isolated python -m bench.calibrate_window [--quick]

Honest pairs: :mod:`bench.calibrate_verify`'s reference against its same-kernel variants (threads 1,
batch 3 left-padded, cached prefill, decode 1 and 8 at a time, all of them at once), in bfloat16, on its
models and spans (tiny random llama, qwen2, gemma3 and mistral, SmolLM2-135M 0:15 and 15:30) with its
inputs (seeds 0 and 1: the *calibration set*) and with new inputs (seeds from 2 on, adding at least
:data:`EXTRA_POSITIONS` positions per variant: the *extra* set). Every honest pair is compared whole.

Lies, on each honest pair's variant output (so honest discrepancy is part of each trial), over the 8
positions an audit at ``audit_every=8`` compares, from a seeded start:

- ``alternate``: Gaussian noise of norm :data:`NOISE` x the row's norm on every other position;
- ``push``: :data:`PUSH` x the row's norm split over 4 random channels (random signs), at one position.

A trial is caught when :func:`~shoal.verify.compare.first_disagreement` at ``tolerance_for(bfloat16)``
names a position at or before the first corrupted one (``*_exact``: that very position).

Prints one JSON object: ``honest_pairs``, ``honest_positions`` (calibration and extra, summed over the pairs),
``honest_false_alarms``; per statistic the honest maximum and its threshold (``honest_max_window`` /
``window_threshold``: positions beyond the sustained level in any ``window`` consecutive ones;
``honest_max_channels`` / ``channel_threshold``;
``honest_max_position`` and ``honest_max_pair`` against ``threshold`` and ``sustained_threshold``);
``window_caught`` / ``window_trials`` (alternate), ``push_caught`` / ``push_trials``, the exact counts,
and the smallest reading of each lie in its own statistic.
"""

from __future__ import annotations

import argparse
import json
import time
from itertools import chain

import torch

from bench.calibrate_verify import Model, build_models, forward, honest_outputs
from shoal.verify.compare import (
    channel_discrepancy,
    first_disagreement,
    row_discrepancy,
    tolerance_for,
    window_counts,
)
from testkit.lies import alternate_noise, channel_push

NOISE = 0.05
PUSH = 0.5
CHANNELS = 4
CHUNK = 8  # positions one audit compares at audit_every=8
EXTRA_POSITIONS = 1000


def pairs(model: Model, seeds: list[int], quick: bool):
    """(label, reference, variant output) of every honest pair of ``model`` on inputs ``seeds``."""
    dtype = torch.bfloat16
    for seed in seeds:
        for n in model.lengths[:1] if quick else model.lengths:
            embedded = model.embed(seed, n)
            for start, end in model.spans:
                hidden = embedded if start == 0 else forward(model.span(0, start, torch.float32), embedded)
                reference, variants = honest_outputs(model, (start, end), dtype, hidden.to(dtype), seed, kernels=False)
                for name, out in variants.items():
                    yield f"{model.name}:{start}-{end} {name} seed {seed} n {n}", reference, out


def run(quick: bool) -> dict:
    started = time.monotonic()
    tolerance = tolerance_for(torch.bfloat16)
    assert tolerance.sustained is not None and tolerance.window_count is not None and tolerance.channels is not None
    generator = torch.Generator().manual_seed(0)
    found = {"honest_pairs": 0, "honest_false_alarms": 0, "window_caught": 0, "window_exact": 0,
             "window_trials": 0, "push_caught": 0, "push_exact": 0, "push_trials": 0}  # fmt: skip
    positions = {"calibration": 0, "extra": 0}
    honest = {"position": 0.0, "pair": 0.0, "window": 0.0, "channels": 0.0}
    lies = {"alternate_window": float("inf"), "push_channels": float("inf"), "push_position": float("inf")}
    flagged: list[str] = []
    models = build_models(quick)
    per_seed = sum(sum(m.lengths[:1] if quick else m.lengths) * len(m.spans) for m in models)
    extra = -(-EXTRA_POSITIONS // per_seed)  # input seeds to add for that many positions per variant
    for model in models:
        calibration, extras = [0] if quick else [0, 1], list(range(2, 2 + extra))
        for label, reference, out in chain(pairs(model, calibration, quick), pairs(model, extras, quick)):
            kind = "extra" if int(label.split("seed ")[1].split()[0]) >= 2 else "calibration"
            positions[kind] += out.shape[1]
            per_row = row_discrepancy(reference, out)
            honest["position"] = max(honest["position"], float(per_row.max()))
            honest["pair"] = max(honest["pair"], float(torch.minimum(per_row[:, :-1], per_row[:, 1:]).max()))
            counts = window_counts(per_row, tolerance.sustained, tolerance.window)
            honest["window"] = max(honest["window"], float(counts.max()))
            honest["channels"] = max(honest["channels"], float(channel_discrepancy(reference, out).max()))
            found["honest_pairs"] += 1
            if first_disagreement(reference, out, tolerance) is not None:
                found["honest_false_alarms"] += 1
                flagged.append(label)
            first = int(torch.randint(0, out.shape[1] - CHUNK + 1, (1,), generator=generator))
            chunk = slice(first, first + CHUNK)
            corrupted = int(torch.randint(0, 2, (1,), generator=generator))  # position 0 or 1 first
            lied = alternate_noise(out[:, chunk], corrupted, NOISE, generator)
            wrong = first_disagreement(reference[:, chunk], lied, tolerance)
            found["window_trials"] += 1
            found["window_caught"] += wrong is not None and wrong <= corrupted
            found["window_exact"] += wrong == corrupted
            counts = window_counts(row_discrepancy(reference[:, chunk], lied), tolerance.sustained, tolerance.window)
            lies["alternate_window"] = min(lies["alternate_window"], float(counts.max()))
            at = int(torch.randint(0, CHUNK, (1,), generator=generator))
            lied = channel_push(out[:, chunk], at, PUSH, CHANNELS, generator)
            wrong = first_disagreement(reference[:, chunk], lied, tolerance)
            found["push_trials"] += 1
            found["push_caught"] += wrong is not None and wrong <= at
            found["push_exact"] += wrong == at
            channels = channel_discrepancy(reference[:, chunk], lied)[0, at]
            lies["push_channels"] = min(lies["push_channels"], float(channels))
            lies["push_position"] = min(lies["push_position"], float(row_discrepancy(reference[:, chunk], lied)[0, at]))
        model.built.clear()
    return {
        **found,
        "honest_positions": positions,
        "honest_flagged": flagged,
        "honest_max_position": honest["position"], "threshold": tolerance.relative,
        "honest_max_pair": honest["pair"], "sustained_threshold": tolerance.sustained,
        "honest_max_window": honest["window"], "window_threshold": tolerance.window_count, "window": tolerance.window,
        "honest_max_channels": honest["channels"], "channel_threshold": tolerance.channels,
        "smallest_lie_readings": lies,
        "seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny model and SmolLM2, short sequences")
    print(json.dumps(run(parser.parse_args().quick), indent=2))


if __name__ == "__main__":
    main()
