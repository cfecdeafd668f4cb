"""``shoal demo``: a local swarm on loopback answering a chat prompt through the distributed model.

Fetches the default model if needed, starts one server process per span, streams the answer,
prints the route and tokens/s, and stops every process it started.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
from transformers import TextStreamer

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class DemoOptions:
    prompt: str
    servers: int = 3
    max_new_tokens: int = 160  # a short answer fits (`shoal demo` passes its --max-new-tokens)
    model: str = DEFAULT_MODEL


class _TimedStreamer(TextStreamer):
    """Prints tokens as they arrive and notes when the first and last ones came."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.times: list[float] = []

    def put(self, value) -> None:
        if self.next_tokens_are_prompt:
            super().put(value)
            return
        self.times.append(time.perf_counter())
        super().put(value)


def was_cut(new_tokens: list[int], max_new_tokens: int, eos_token_id: int | list[int] | None) -> bool:
    """Whether generation stopped at the token limit rather than at an end-of-sequence token."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    return len(new_tokens) >= max_new_tokens and not (new_tokens and new_tokens[-1] in eos)


def run_demo(options: DemoOptions) -> int:
    from shoal.checkpoints import fetch_model, load_config
    from shoal.client import AutoDistributedModelForCausalLM
    from shoal.heap import freeze_startup_heap
    from shoal.launch import LocalSwarm, even_spans
    from shoal.models import get_family

    model_dir = fetch_model(options.model)
    config = load_config(model_dir)
    spans = even_spans(get_family(config).num_blocks(config), options.servers)
    threads = str(max(1, min(4, os.cpu_count() or 1)))
    print(f"starting {len(spans)} servers for {options.model} on loopback: {spans}", file=sys.stderr)
    with LocalSwarm(model_dir, spans, ["--num-threads", threads]) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(str(model_dir), initial_peers=swarm.tickets)
        freeze_startup_heap()  # before the timed generation (see shoal.heap)
        try:
            print("route: " + " -> ".join(f"{s.peer_id[:8]}[{s.start}:{s.end})" for s in model.blocks.chain))
            tokenizer = model.tokenizer
            messages = [{"role": "user", "content": options.prompt}]
            inputs = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            print(f"user: {options.prompt}\nassistant: ", end="", flush=True)
            streamer = _TimedStreamer(tokenizer)
            started = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    **inputs, max_new_tokens=options.max_new_tokens, do_sample=False, streamer=streamer
                )
            times = streamer.times
            ttft = times[0] - started if times else float("nan")
            decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
            print(f"\n{len(times)} tokens; first after {ttft * 1e3:.0f} ms; decode {decode:.1f} tokens/s")
            new_tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
            if was_cut(new_tokens, options.max_new_tokens, model.generation_config.eos_token_id):
                print(
                    f"(the answer was cut at the limit of {options.max_new_tokens} new tokens: "
                    "raise it with --max-new-tokens N)"
                )
        finally:
            model.blocks.close()
    return 0
