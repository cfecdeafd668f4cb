"""Speculative decoding through a 2-server chain behind an emulated wide-area network.

    scripts/isolated python -m bench.speculative [--rtts 0,20,50,100] [--new-tokens 64]
        [--pairs lookup,controlled08,controlled05,real]

Fetch the models first (``shoal models fetch smollm2 qwen2.5-coder``, outside the namespace). For
every per-link RTT (``testkit.wan``: every link of client -> s0 -> s1 -> client, both directions)
and every pair, a fresh 2-server in-process swarm (iroh nodes behind the emulator) generates
``--new-tokens`` greedy tokens for each of the pair's named prompts, plain and speculative (shoal's
window planner choosing every round's window), side by side in the same swarm. Pairs:

- ``lookup``: prompt lookup (``prompt_lookup_num_tokens=10``) with SmolLM2-135M-Instruct on prompts
  that quote a text and ask for it edited (the answer copies long runs of the prompt);
- ``real``: SmolLM2-135M-Instruct drafting for Qwen2.5-Coder-0.5B-Instruct: different tokenizers,
  so transformers' universal assisted decoding (greedy);
- ``controlled08``, ``controlled05``: the ~270M random llama of ``bench.models`` (hidden 1024, 16
  layers, 32k vocabulary) as the target, built so that a draft at 1/50 of its multiply-adds per token
  can predict it: its LM head has rank 128 (``U @ P``, ``P`` orthonormal rows) and its blocks' output
  projections are scaled by ``BLOCK_SCALE``, so its next token depends mostly on the last one. The
  draft is a 0-block llama of width 128 made from it (embeddings ``P @ norm(E)``, head ``U``) plus
  seeded noise of a scale bisected until the draft's per-token agreement with the target's greedy
  choices (teacher-forced on the benchmark's prompts: the acceptance of a window of 1) is 0.8 or 0.5.

Each row is written as it finishes (a ``#`` line on stderr, and a JSON line appended to ``--rows``
if given); a pair that raises gets ``{"error": ...}`` as its entry (with the rows it finished under
``rows``) and the run goes on with the next pair. Prints one JSON object: ``pairs[pair][rtt]`` with
``plain_tokens_per_s``, ``speculative_tokens_per_s`` (medians over prompts of generated tokens /
wall time), ``speedup``, ``acceptance_rate`` (accepted / drafted draft tokens), ``mean_window``
(drafted tokens / rounds), ``windows`` (how often shoal chose each window) and ``tokens_equal``
(speculative == plain greedy, every prompt); ``controlled`` (the pair's construction, calibration
and per-token costs), and the headline keys ``speedup_rtt50_lookup``,
``speedup_rtt50_controlled08``, ``speedup_rtt0_controlled08``, ``speedup_rtt50_real`` and
``targets_met`` (lookup and controlled08 >= 2 at 50 ms; controlled08 at 0 ms and the real pair at
every RTT >= 0.95; false when a pair failed), ``failed_pairs`` and ``draft_failures`` (rounds whose
drafter raised and decoded plainly, per pair; 0 expected).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

from bench.compression import chat_ids, spans_of
from shoal.checkpoints import fetch_model, save_sharded
from shoal.checkpoints.fetch import shoal_home
from testkit.wan import LinkConditions, WanSwarm

RTTS = (0, 20, 50, 100)
LOOKUP_WINDOW = 10
DRAFT_WINDOW = 8  # the largest window the planner may choose for a draft model
BLOCK_SCALE = 5e-4  # the controlled target's block outputs (o_proj, down_proj) are scaled by this
HEAD_RANK = 128
CONTROLLED_PROMPT_TOKENS = 24
CONTROLLED_PROMPTS = {"random-a": 1, "random-b": 2, "random-c": 3}  # name -> seed of its token ids

EDIT_TEXT = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
    "the one hundred and twelve steps, trimmed the wick, wound the clockwork and watched the lamp turn "
    "until the sun came up over the grey water."
)
LOOKUP_PROMPTS = {
    "edit-tense": f"Rewrite this paragraph in the present tense, changing nothing else:\n\n{EDIT_TEXT}",
    "edit-name": f"Repeat this paragraph exactly, but call the lighthouse 'Saint Agnes':\n\n{EDIT_TEXT}",
}
REAL_PROMPTS = {
    "python-sum": "Write a Python function that returns the sum of the squares of a list of numbers.",
    "explain-list": "Explain in two sentences what a Python list comprehension is.",
}


# ---- the controlled pair ------------------------------------------------------------------------


def controlled_target() -> tuple[Path, torch.Tensor, torch.Tensor]:
    """The controlled target's checkpoint (written once under ``$SHOAL_HOME/bench``), and the head's
    factors ``U`` [vocab, rank] and ``P`` [rank, hidden]."""
    from transformers import LlamaForCausalLM

    from bench.models import llama270m_config

    out = shoal_home() / "bench" / f"spec-target-{BLOCK_SCALE:g}"
    factors = out / "head_factors.pt"
    if (out / ".bench-complete").is_file():
        u, p = torch.load(factors)
        return out, u, p
    config = llama270m_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        p = torch.linalg.qr(torch.randn(config.hidden_size, HEAD_RANK))[0].T.contiguous()
        u = torch.randn(config.vocab_size, HEAD_RANK) * 0.02 * (config.hidden_size / HEAD_RANK) ** 0.5
        model.lm_head.weight.copy_(u @ p)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(BLOCK_SCALE)
            layer.mlp.down_proj.weight.mul_(BLOCK_SCALE)
    save_sharded(model, config, out)
    torch.save((u, p), factors)
    (out / ".bench-complete").write_text("ok\n")
    return out, u, p


def controlled_draft(target, u: torch.Tensor, p: torch.Tensor, noise: float, seed: int = 7):
    """A 0-block llama of width ``HEAD_RANK`` predicting ``target`` from the last token alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    config = LlamaConfig(
        hidden_size=HEAD_RANK, intermediate_size=HEAD_RANK, num_hidden_layers=0, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=tc.vocab_size, tie_word_embeddings=False,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
    )  # fmt: skip
    draft = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embed = target.model.embed_tokens.weight
        normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + tc.rms_norm_eps)
        table = normed @ p.T
        draft.model.embed_tokens.weight.copy_(
            table + noise * table.std() * torch.randn(table.shape, generator=generator)
        )
        draft.lm_head.weight.copy_(u)
    draft.generation_config.num_assistant_tokens = DRAFT_WINDOW
    return draft


@torch.inference_mode()
def agreement(draft, target_argmax: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """How often the draft's greedy token equals the target's, given the target's greedy prefix."""
    hits = total = 0
    for sequence, wanted in target_argmax:
        got = draft(sequence).logits.argmax(-1)[0, CONTROLLED_PROMPT_TOKENS - 1 : -1]
        hits, total = hits + int((got == wanted).sum()), total + wanted.numel()
    return hits / total


def controlled_pair(new_tokens: int) -> tuple[Path, dict[str, torch.Tensor], dict, dict]:
    """The target's directory, its prompts, drafts tuned to agreement 0.8 and 0.5, and what was measured."""
    from transformers import AutoModelForCausalLM

    path, u, p = controlled_target()
    target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    vocab = target.config.vocab_size
    prompts = {
        name: torch.randint(3, vocab, (1, CONTROLLED_PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed))
        for name, seed in CONTROLLED_PROMPTS.items()
    }
    started = time.perf_counter()
    with torch.inference_mode():
        greedy = [
            target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            for ids in prompts.values()
        ]
        target_ms = 1000 * (time.perf_counter() - started) / (new_tokens * len(prompts))
        wanted = [(seq, target(seq).logits.argmax(-1)[0, CONTROLLED_PROMPT_TOKENS - 1 : -1]) for seq in greedy]
    drafts, info = (
        {},
        {"block_scale": BLOCK_SCALE, "head_rank": HEAD_RANK, "target_local_ms_per_token": round(target_ms, 2)},
    )
    exact = agreement(controlled_draft(target, u, p, 0.0), wanted)
    info["agreement_without_noise"] = round(exact, 3)
    for name, goal in (("controlled08", 0.8), ("controlled05", 0.5)):
        low, high = 0.0, 2.0  # noise scale: agreement falls as it grows
        for _ in range(12):
            mid = (low + high) / 2
            if agreement(controlled_draft(target, u, p, mid), wanted) > goal:
                low = mid
            else:
                high = mid
        noise = (low + high) / 2
        draft = controlled_draft(target, u, p, noise)
        drafts[name] = draft
        info[name] = {"noise": round(noise, 4), "agreement": round(agreement(draft, wanted), 3)}
    draft_ms = draft_cost_ms(drafts["controlled08"], prompts["random-a"], new_tokens)
    info["draft_local_ms_per_token"] = round(draft_ms, 2)
    info["draft_macs_per_token"] = HEAD_RANK * target.config.vocab_size
    info["target_macs_per_token"] = sum(
        x.numel() for n, x in target.named_parameters() if "embed" not in n and x.dim() == 2
    )
    del target
    return path, prompts, drafts, info


@torch.inference_mode()
def draft_cost_ms(draft, ids: torch.Tensor, new_tokens: int) -> float:
    started = time.perf_counter()
    draft.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return 1000 * (time.perf_counter() - started) / new_tokens


# ---- running a pair ------------------------------------------------------------------------------


def timed(model, ids: torch.Tensor, new_tokens: int, **speculation) -> tuple[float, list[int], object]:
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, **speculation
        )
    elapsed = time.perf_counter() - started
    tokens = out[0, ids.shape[1] :].tolist()
    return len(tokens) / elapsed, tokens, model.last_speculation if speculation else None


def run_pair(model_dir: Path, prompts: dict[str, torch.Tensor], rtt: float, new_tokens: int, speculation: dict) -> dict:
    """Plain and speculative greedy generation of every prompt through 2 servers, every link ``rtt``."""
    plain_rates, spec_rates, equal = [], [], True
    windows: Counter[int] = Counter()
    drafted = accepted = rounds = failures = 0
    with WanSwarm(model_dir, spans_of(model_dir), default=LinkConditions(rtt_ms=float(rtt))) as swarm:
        model = swarm.connect()
        warm = next(iter(prompts.values()))
        timed(model, warm, 2)  # connections and sessions warm
        for ids in prompts.values():
            plain_rate, plain_tokens, _ = timed(model, ids, new_tokens)
            spec_rate, spec_tokens, stats = timed(model, ids, new_tokens, **speculation)
            plain_rates.append(plain_rate)
            spec_rates.append(spec_rate)
            equal &= plain_tokens == spec_tokens
            windows.update(r.window for r in stats.rounds)
            drafted, accepted, rounds = drafted + stats.drafted, accepted + stats.accepted, rounds + len(stats.rounds)
            failures += stats.failures
    plain, spec = statistics.median(plain_rates), statistics.median(spec_rates)
    return {
        "plain_tokens_per_s": round(plain, 2),
        "speculative_tokens_per_s": round(spec, 2),
        "speedup": round(spec / plain, 3),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "mean_window": round(drafted / rounds, 2) if rounds else 0.0,
        "windows": dict(sorted(windows.items())),
        "tokens_equal": equal,
        "draft_failures": failures,
    }


def run_rows(name: str, path: Path, prompts: dict, rtts: list[int], new_tokens: int, speculation: dict, out) -> dict:
    """One pair at every RTT; each row is reported as it finishes. A pair that raises gets its error
    (and the rows it finished) as its entry: one pair must not cost the others."""
    rows: dict = {}
    try:
        for rtt in rtts:
            rows[str(rtt)] = run_pair(path, prompts, rtt, new_tokens, speculation)
            report(out, {"pair": name, "rtt_ms": rtt, **rows[str(rtt)]})
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        failed = {"error": f"{type(error).__name__}: {error}", "rows": rows}
        report(out, {"pair": name, "rtt_ms": rtt, "error": failed["error"]})
        return failed
    return rows


def report(out, row: dict) -> None:
    """A finished row: on stderr, and as a JSON line on ``out`` (if any), flushed at once."""
    print(f"# {row}", file=sys.stderr, flush=True)
    if out is not None:
        out.write(json.dumps(row) + "\n")
        out.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtts", default=",".join(map(str, RTTS)), help="per-link round trips, ms")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pairs", default="lookup,controlled08,controlled05,real")
    parser.add_argument("--rows", type=Path, help="append each finished row to this file as a JSON line")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rtts = [int(r) for r in args.rtts.split(",")]
    wanted = args.pairs.split(",")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    setups: dict[str, tuple[Path, dict, dict]] = {}
    result: dict = {"rtts_ms": rtts, "new_tokens": args.new_tokens, "pairs": {}}
    if "lookup" in wanted:
        path = fetch_model("smollm2", progress=False)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        prompts = {name: chat_ids(tokenizer, text) for name, text in LOOKUP_PROMPTS.items()}
        setups["lookup"] = (path, prompts, {"prompt_lookup_num_tokens": LOOKUP_WINDOW})
    if any(p.startswith("controlled") for p in wanted):
        path, prompts, drafts, info = controlled_pair(args.new_tokens)
        result["controlled"] = info
        print(f"# controlled pair: {info}", file=sys.stderr, flush=True)
        for name, draft in drafts.items():
            if name in wanted:
                setups[name] = (path, prompts, {"assistant_model": draft})
    if "real" in wanted:
        target_path, draft_path = fetch_model("qwen2.5-coder", progress=False), fetch_model("smollm2", progress=False)
        target_tokenizer = AutoTokenizer.from_pretrained(str(target_path))
        draft_tokenizer = AutoTokenizer.from_pretrained(str(draft_path))
        draft = AutoModelForCausalLM.from_pretrained(str(draft_path), dtype=torch.float32).eval()
        draft.generation_config.num_assistant_tokens = DRAFT_WINDOW
        prompts = {name: chat_ids(target_tokenizer, text) for name, text in REAL_PROMPTS.items()}
        speculation = {"assistant_model": draft, "tokenizer": target_tokenizer, "assistant_tokenizer": draft_tokenizer}
        setups["real"] = (target_path, prompts, speculation)
    out = args.rows.open("a") if args.rows else None
    try:
        for name, (path, prompts, speculation) in setups.items():
            result["pairs"][name] = run_rows(name, path, prompts, rtts, args.new_tokens, speculation, out)
    finally:
        if out is not None:
            out.close()
    failed = sorted(name for name, rows in result["pairs"].items() if "error" in rows)
    complete = {name: rows for name, rows in result["pairs"].items() if name not in failed}

    def speedup(pair: str, rtt: int) -> float | None:
        row = complete.get(pair, {}).get(str(rtt))
        return row["speedup"] if row else None

    result["speedup_rtt50_lookup"] = speedup("lookup", 50)
    result["speedup_rtt50_controlled08"] = speedup("controlled08", 50)
    result["speedup_rtt0_controlled08"] = speedup("controlled08", 0)
    result["speedup_rtt50_real"] = speedup("real", 50)
    checks = [
        (result["speedup_rtt50_lookup"], 2.0),
        (result["speedup_rtt50_controlled08"], 2.0),
        (result["speedup_rtt0_controlled08"], 0.95),
        *((row["speedup"], 0.95) for row in complete.get("real", {}).values()),
    ]
    result["failed_pairs"] = failed
    result["targets_met"] = not failed and all(value is not None and value >= bar for value, bar in checks)
    result["tokens_equal"] = all(row["tokens_equal"] for rows in complete.values() for row in rows.values())
    result["draft_failures"] = {
        name: sum(row["draft_failures"] for row in rows.values()) for name, rows in complete.items()
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
