"""The stall of a long session whose server drains: KV pages handed over (migration) against a replay.

    scripts/isolated nice python -m bench.migration [--prompt-tokens 2000] [--runs 2]

SmolLM2-135M (``shoal models fetch smollm2``, outside the namespace), two servers of all its blocks in
one in-process swarm (the in-memory transport, one compute thread each). A session prefills a
``--prompt-tokens`` prompt (random ids, seeded) and decodes greedily; after its ``DRAIN_AT``-th new
token its server starts draining, so the next step moves the session to the other server first:
by migration (the leaving server sends its pages, :mod:`shoal.server.migrate`), or, with servers
that do not announce the ``migrate`` capability, by replaying the history there (a full prefill).
Both modes run side by side in one process, ``--runs`` times each, alternating.

Prints one JSON object: ``stall_ms_migrate`` and ``stall_ms_replay`` (medians over runs of the time
the session spent moving: planning, opening the new session and migrating or replaying, as its
recovery record says: the pause the drain adds to that step), ``ratio`` (replay / migrate),
``step_ms_migrate`` / ``step_ms_replay`` (the moving steps' whole times, token to token),
``decode_step_ms`` (median undisturbed step), ``migrated`` and ``replayed`` (positions, as the
sessions' recovery records say), ``tokens_equal`` (every run's tokens equal an undisturbed local
``transformers`` generation), and the settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import msgspec
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor

from shoal.checkpoints.fetch import model_cache_dir
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.server.handler import BlockServer
from shoal.wire.schema import MIGRATE

DRAIN_AT = 3  # new tokens decoded before the drain starts
NEW_TOKENS = 8


class Stamps(LogitsProcessor):
    """When each new token's scores were asked for; at step ``at``, ``action()``."""

    def __init__(self, at: int, action):
        self.at, self.action, self.stamps = at, action, []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == self.at + 1:
            self.action()
        return scores


def no_migration(server: BlockServer) -> BlockServer:
    """A server that does not announce :data:`MIGRATE`: its clients replay instead."""
    server.info = msgspec.structs.replace(server.info, capabilities=server.info.capabilities - {MIGRATE})
    return server


def one_run(model_dir, span: BlockRange, prompt: torch.Tensor, migrate: bool) -> dict:
    with InProcessSwarm(model_dir, [], cache_tokens=prompt.shape[1] + 64) as swarm:
        for _ in range(2):
            swarm.add(span, None if migrate else no_migration)
        model = swarm.connect(refresh_period=0, routing_seed=0)
        threads: list[threading.Thread] = []
        with model.inference_session(max_length=prompt.shape[1] + NEW_TOKENS) as cache:
            leaving = next(s for s in swarm.servers if s.node.id == cache.session.chain[0].peer_id)

            def drain() -> None:
                thread = threading.Thread(target=swarm.runtime.run, args=(leaving.server.drain(120.0),))
                thread.start()
                threads.append(thread)
                while not leaving.server.draining:
                    time.sleep(0.001)

            stamps = Stamps(DRAIN_AT, drain)
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=[stamps])
            (record,) = cache.session.recoveries
        for thread in threads:
            thread.join(120)
    gaps = [b - a for a, b in zip(stamps.stamps, stamps.stamps[1:], strict=False)]
    # the drain begins after step DRAIN_AT; the next step's reply says so; the one after moves first
    moving = gaps[DRAIN_AT + 1]
    decode = statistics.median(g for i, g in enumerate(gaps) if i != DRAIN_AT + 1)
    return {
        "tokens": out,
        "step_ms": moving * 1e3,
        "stall_ms": record.seconds * 1e3,
        "decode_ms": decode * 1e3,
        "migrated": sum(record.migrated.values()),
        "replayed": sum(record.replayed.values()),
    }


def run(prompt_tokens: int, runs: int) -> dict:
    model_dir = model_cache_dir("smollm2")
    if not model_dir.is_dir():
        raise SystemExit(f"SmolLM2 is not fetched ({model_dir}): run `shoal models fetch smollm2` first")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    span = BlockRange(0, reference.config.num_hidden_layers)
    prompt = torch.randint(100, reference.config.vocab_size - 100, (1, prompt_tokens),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    expected = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    del reference
    results: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(runs):
        for migrate in (True, False):
            result = one_run(model_dir, span, prompt, migrate)
            results[migrate].append(result)
            print(f"# run {i} {'migrate' if migrate else 'replay'}: step {result['step_ms']:.0f} ms, "
                  f"stall {result['stall_ms']:.0f} ms", file=sys.stderr)  # fmt: skip
    median = lambda mode, key: statistics.median(r[key] for r in results[mode])  # noqa: E731
    stall_migrate, stall_replay = median(True, "stall_ms"), median(False, "stall_ms")
    return {
        "stall_ms_migrate": round(stall_migrate, 1),
        "stall_ms_replay": round(stall_replay, 1),
        "ratio": round(stall_replay / max(stall_migrate, 1e-3), 2),
        "step_ms_migrate": round(median(True, "step_ms"), 1),
        "step_ms_replay": round(median(False, "step_ms"), 1),
        "decode_step_ms": round(statistics.median(r["decode_ms"] for rs in results.values() for r in rs), 1),
        "migrated": [r["migrated"] for r in results[True]],
        "replayed": [r["replayed"] for r in results[False]],
        "tokens_equal": all(torch.equal(r["tokens"], expected) for rs in results.values() for r in rs),
        "model": "smollm2",
        "prompt_tokens": prompt_tokens,
        "runs": runs,
        "servers": f"2 x blocks 0:{span.end}, float32, in-memory transport, 1 compute thread each",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(run(args.prompt_tokens, args.runs), indent=2))


if __name__ == "__main__":
    main()
