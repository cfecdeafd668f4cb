"""Prompt tuning through a swarm: train a soft prompt for SmolLM2 whose blocks run on servers.

    shoal models fetch smollm2
    scripts/isolated python examples/prompt_tuning.py [--steps 30] [--mode ptune|deep_ptune]

The servers stay frozen: the client owns the only trainable tensors, ``--pre-seq-len`` prompt
embeddings placed before every input (``deep_ptune``: also one prompt per block, added on the
servers), and gradients flow back through the servers' blocks (each server recomputes its span's
forward with autograd and returns the gradient of its inputs). The task is built here: label short
made-up reviews with `` happy`` or `` sad``. SmolLM2 does not know the format, so the loss on the
label starts high; the printed loss falls as the prompt learns it. At the end the trained prompt
classifies reviews it never saw, through ``generate``, and is saved with ``save_prompts``.

Two servers in this process (``shoal.launch.InProcessSwarm``: the servers ``shoal serve`` builds,
on an in-memory network) hold blocks 0-14 and 15-29; point ``from_pretrained`` at real servers'
tickets to train against a real swarm the same way.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from shoal.checkpoints import fetch_model
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm

GOOD = ["loved", "enjoyed", "adored", "admired", "liked", "praised"]
BAD = ["hated", "disliked", "loathed", "regretted", "despised", "resented"]
THINGS = ["the film", "this book", "the soup", "the concert", "my new phone", "the hotel", "that game", "the show"]
HELD_OUT = ["the museum", "our trip", "the bakery", "his speech"]  # never seen in training
LABELS = {True: " happy", False: " sad"}


def review(rng: random.Random, things: list[str]) -> tuple[str, bool]:
    good = rng.random() < 0.5
    return f"I {rng.choice(GOOD if good else BAD)} {rng.choice(things)}. Sentiment:", good


def batch_tensors(tokenizer, texts: list[str], labels: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded ids of text + label, with the loss on the label's token only."""
    rows = [tokenizer(t).input_ids + tokenizer(lab).input_ids for t, lab in zip(texts, labels, strict=True)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    targets = torch.full_like(input_ids, -100)
    targets[:, -1] = input_ids[:, -1]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": targets}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="Adam steps")
    parser.add_argument("--batch", type=int, default=8, help="reviews per step")
    parser.add_argument("--pre-seq-len", type=int, default=8, help="trainable prompt positions")
    parser.add_argument("--mode", choices=["ptune", "deep_ptune"], default="ptune", help="tuning mode")
    parser.add_argument("--lr", type=float, default=3e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the prompt's initialisation")
    parser.add_argument("--save", type=Path, default=None, help="where to save the trained prompts (safetensors)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    model_dir = fetch_model("smollm2", progress=False)
    with InProcessSwarm(model_dir, [BlockRange(0, 15), BlockRange(15, 30)], num_threads=1) as swarm:
        model = swarm.connect(tuning_mode=args.mode, pre_seq_len=args.pre_seq_len)
        tokenizer = model.tokenizer
        with torch.no_grad():  # start from the embeddings of random words (trains faster than N(0, 1) noise)
            vocabulary = model.get_input_embeddings().weight
            start = vocabulary[torch.randint(0, vocabulary.shape[0], (args.pre_seq_len,))]
            model.ptune.prompt_embeddings.weight.copy_(start)
        trainable = [p for p in model.parameters() if p.requires_grad]  # the prompts only: the rest is frozen
        optimizer = torch.optim.Adam(trainable, lr=args.lr)
        print(
            f"training {sum(p.numel() for p in trainable):,} prompt values ({args.mode}, {args.pre_seq_len} positions)"
        )
        losses = []
        started = time.perf_counter()
        for step in range(args.steps):
            examples = [review(rng, THINGS) for _ in range(args.batch)]
            inputs = batch_tensors(tokenizer, [t for t, _ in examples], [LABELS[good] for _, good in examples])
            loss = model(**inputs).loss
            optimizer.zero_grad()
            loss.backward()  # through the client head, then each server's blocks in reverse
            optimizer.step()
            losses.append(loss.item())
            print(f"step {step + 1:3d}  loss {losses[-1]:.4f}  ({time.perf_counter() - started:.1f} s)", flush=True)

        correct, tests = 0, [review(random.Random(1000 + i), HELD_OUT) for i in range(16)]
        with torch.no_grad():
            for text, good in tests:
                ids = tokenizer(text, return_tensors="pt").input_ids
                out = model.generate(ids, max_new_tokens=1, do_sample=False)
                correct += tokenizer.decode(out[0, -1]) == LABELS[good]
        if args.save is not None:
            model.save_prompts(args.save)
            print(f"saved the prompts to {args.save}")

    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    summary = {"first_5_mean_loss": first, "last_5_mean_loss": last, "held_out_accuracy": correct / len(tests)}
    print(
        f"mean loss of the first 5 steps {first:.3f}, of the last 5 {last:.3f}; "
        f"held-out reviews labelled right: {correct}/{len(tests)}"
    )
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
