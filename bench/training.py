"""Training through the swarm: forward/backward throughput, and what it costs the swarm's inference users.

    shoal models fetch smollm2
    scripts/isolated python -m bench.training [--steps 8] [--decode-steps 48] [--rounds 2]

Two ``shoal serve`` processes of SmolLM2 (blocks 0-14 and 15-29), one torch thread each, standing
in for two machines. Measured side by side in one run:

- ``fwd_bwd_tok_s_swarm``: a prompt-tuning client (``tuning_mode="ptune"``, 8 prompt positions,
  batch ``--batch`` of made-up reviews, loss on the label token) running forward and backward
  through the servers alone, in tokens (prompt positions included) per second of its loop (the
  same beside the decoding client: ``fwd_bwd_tok_s_swarm_beside_decoding``);
  ``fwd_bwd_tok_s_local``: the same loop on the local transformers model (one thread), and
  ``fwd_bwd_ratio`` = swarm / local.
- ``infer_step_ms_p50_alone``: an inference client's one-token decode step through both servers
  (session steps, server-to-server push) with nothing else running; ``infer_step_ms_p50_training``:
  the same while the training client loops forward/backward on the same servers (in a process of
  its own); ``infer_latency_ratio`` = training / alone. Rounds alternate alone and training.

The servers run inference steps before training work and cut a backward into one block at a
time, so a decode step waits at most for one block's worth of training (``shoal.server.scheduler``).
Prints one JSON object with those keys, the per-round figures and the servers' scheduler counters.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import time

import torch

from shoal.checkpoints import fetch_model
from shoal.ids import BlockRange
from shoal.launch import LocalSwarm

SPANS = (BlockRange(0, 15), BlockRange(15, 30))
PRE_SEQ_LEN = 8
INFER_PROMPT = "The history of the lighthouse on the northern cliff begins"


def review_batch(tokenizer, rng: random.Random, batch: int) -> dict[str, torch.Tensor]:
    """``examples/prompt_tuning.py``'s task: a left-padded batch with the loss on the label token."""
    from examples.prompt_tuning import LABELS, THINGS, batch_tensors, review

    examples = [review(rng, THINGS) for _ in range(batch)]
    return batch_tensors(tokenizer, [t for t, _ in examples], [LABELS[good] for _, good in examples])


def local_loop(model_dir: str, steps: int, batch: int) -> dict:
    """The training loop on the local transformers model: the prompt prepended as embeddings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).requires_grad_(False)
    embed = model.get_input_embeddings()
    prompt = torch.nn.Parameter(torch.randn(PRE_SEQ_LEN, model.config.hidden_size) * 0.02)
    optimizer = torch.optim.Adam([prompt], lr=3e-2)
    rng, times, tokens = random.Random(0), [], 0
    for step in range(steps + 1):
        inputs = review_batch(tokenizer, rng, batch)
        started = time.perf_counter()
        rows = inputs["input_ids"].shape[0]
        embeds = torch.cat([prompt.expand(rows, -1, -1), embed(inputs["input_ids"])], dim=1)
        mask = torch.cat([torch.ones(rows, PRE_SEQ_LEN, dtype=torch.long), inputs["attention_mask"]], dim=1)
        labels = torch.cat([torch.full((rows, PRE_SEQ_LEN), -100), inputs["labels"]], dim=1)
        loss = model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step:  # the first step warms up
            times.append(time.perf_counter() - started)
            tokens += embeds.shape[0] * embeds.shape[1]
    return {"tok_s": tokens / sum(times), "step_s_p50": statistics.median(times)}


def training_worker(model_dir: str, tickets: list[str], batch: int, started, stop, results) -> None:
    """A prompt-tuning client looping forward/backward until ``stop`` is set (its own process: its
    Python and its head's compute must not share the inference client's interpreter)."""
    from shoal.client import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_dir, tickets, tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN
    )
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    rng, times, tokens = random.Random(0), [], 0
    try:
        while not stop.is_set():
            inputs = review_batch(model.tokenizer, rng, batch)
            t0 = time.perf_counter()
            loss = model(**inputs).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - t0)
            if len(times) == 2:
                started.set()  # warmed up: the inference client starts measuring
            if len(times) > 2:
                tokens += inputs["input_ids"].shape[0] * (inputs["input_ids"].shape[1] + PRE_SEQ_LEN)
        counted = times[2:]
        results.put({"steps": len(counted), "tok_s": tokens / sum(counted) if counted else 0.0,
                     "step_s_p50": statistics.median(counted) if counted else 0.0})  # fmt: skip
    finally:
        model.close()


def decode_steps(model, n: int) -> list[float]:
    """Milliseconds of ``n`` one-token decode steps of one session (after its prompt's prefill)."""
    ids = model.tokenizer(INFER_PROMPT, return_tensors="pt").input_ids
    times = []
    with model.inference_session(max_length=ids.shape[1] + n + 1) as session, torch.no_grad():
        out = model(input_ids=ids, cache=session)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(n):
            t0 = time.perf_counter()
            out = model(input_ids=token, cache=session)
            times.append((time.perf_counter() - t0) * 1000)
            token = out.logits[:, -1:].argmax(-1)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4, help="reviews per training step")
    parser.add_argument("--steps", type=int, default=8, help="steps of the local training loop")
    parser.add_argument("--decode-steps", type=int, default=48, help="decode steps per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alone/training rounds (alternating)")
    parser.add_argument("--alone-seconds", type=float, default=15.0, help="how long the training client runs alone")
    args = parser.parse_args(argv)

    from shoal.client import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)
    model_dir = str(fetch_model("smollm2", progress=False))
    env = {"OMP_NUM_THREADS": "1"}
    context = mp.get_context("spawn")
    rounds = []
    with LocalSwarm(model_dir, SPANS, ["--num-threads", "1"], env=env) as swarm:
        tickets = [str(s.ticket) for s in swarm.servers]
        infer = AutoDistributedModelForCausalLM.from_pretrained(model_dir, tickets)
        decode_steps(infer, 8)  # warm up
        swarm_training = []
        for _ in range(args.rounds):
            alone = decode_steps(infer, args.decode_steps)
            started, stop, results = context.Event(), context.Event(), context.Queue()
            worker = context.Process(
                target=training_worker, args=(model_dir, tickets, args.batch, started, stop, results)
            )
            worker.start()
            if not started.wait(300):
                worker.kill()
                raise RuntimeError("the training client did not start")
            during = decode_steps(infer, args.decode_steps)
            stop.set()
            trained = results.get(timeout=300)
            worker.join(60)
            swarm_training.append(trained)
            rounds.append({
                "infer_step_ms_p50_alone": statistics.median(alone),
                "infer_step_ms_p50_training": statistics.median(during),
                "infer_step_ms_p99_training": sorted(during)[int(0.99 * (len(during) - 1))],
                "training_client": trained,
            })  # fmt: skip
        # the training client alone, for its throughput: the rounds above share the CPUs with decoding
        started, stop, results = context.Event(), context.Event(), context.Queue()
        worker = context.Process(target=training_worker, args=(model_dir, tickets, args.batch, started, stop, results))
        worker.start()
        if not started.wait(300):
            worker.kill()
            raise RuntimeError("the training client did not start")
        time.sleep(args.alone_seconds)
        stop.set()
        training_alone = results.get(timeout=300)
        worker.join(60)
        counters = [info.counters for info in infer.blocks.server_infos()]
        infer.close()

    local = context.Pool(1).apply(local_loop, (model_dir, args.steps, args.batch))
    alone = statistics.median(r["infer_step_ms_p50_alone"] for r in rounds)
    during = statistics.median(r["infer_step_ms_p50_training"] for r in rounds)
    swarm_tok_s = training_alone["tok_s"]
    result = {
        "model": "smollm2",
        "spans": [str(s) for s in SPANS],
        "batch": args.batch,
        "pre_seq_len": PRE_SEQ_LEN,
        "fwd_bwd_tok_s_swarm": swarm_tok_s,
        "fwd_bwd_tok_s_local": local["tok_s"],
        "fwd_bwd_ratio": swarm_tok_s / local["tok_s"],
        "infer_step_ms_p50_alone": alone,
        "infer_step_ms_p50_training": during,
        "infer_latency_ratio": during / alone,
        "target_met": during / alone <= 1.5,
        "rounds": rounds,
        "training_alone": training_alone,
        "fwd_bwd_tok_s_swarm_beside_decoding": statistics.median(t["tok_s"] for t in swarm_training),
        "local_loop": local,
        "server_counters": [
            {k: getattr(c, k) for k in c.__struct_fields__ if "train" in k or "backward" in k or "preempt" in k}
            for c in counters
        ],
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
