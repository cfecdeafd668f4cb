"""``shoal demo``: a local swarm on loopback answering a chat prompt through the distributed model.

Fetches the default model if needed, starts one server process per span, streams the answer,
prints the route and tokens/s (and, with ``--draft`` or ``--prompt-lookup``, speculative decoding's
acceptance and mean window), and stops every process it started.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
from transformers import TextStreamer

from shoal.ids import BlockRange

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class DemoOptions:
    prompt: str
    servers: int = 3
    max_new_tokens: int = 160  # a short answer fits (`shoal demo` passes its --max-new-tokens)
    model: str = DEFAULT_MODEL
    draft: str | None = None  # speculative decoding with this local draft model
    prompt_lookup: int | None = None  # ... or with up to this many tokens a round looked up in the prompt


class _TimedStreamer(TextStreamer):
    """Prints tokens as they arrive and notes when each batch of them came (speculative decoding
    delivers several at once)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.arrivals: list[tuple[float, int]] = []  # (time, tokens)

    def put(self, value) -> None:
        if self.next_tokens_are_prompt:
            super().put(value)
            return
        self.arrivals.append((time.perf_counter(), int(value.numel())))
        super().put(value)


def was_cut(new_tokens: list[int], max_new_tokens: int, eos_token_id: int | list[int] | None) -> bool:
    """Whether generation stopped at the token limit rather than at an end-of-sequence token."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    return len(new_tokens) >= max_new_tokens and not (new_tokens and new_tokens[-1] in eos)


def summary(arrivals: list[tuple[float, int]], started: float) -> str:
    """``N tokens; first after X ms; decode Y tokens/s``: decode counts the tokens after the first
    arrival over the time from it to the last one."""
    tokens = sum(n for _, n in arrivals)
    ttft = arrivals[0][0] - started if arrivals else float("nan")
    span = arrivals[-1][0] - arrivals[0][0] if len(arrivals) > 1 else 0.0
    decode = (tokens - arrivals[0][1]) / span if span > 0 else float("nan")
    return f"{tokens} tokens; first after {ttft * 1e3:.0f} ms; decode {decode:.1f} tokens/s"


def spans_text(spans: list[BlockRange]) -> str:
    """``blocks [0:10), [10:20)``: half-open ranges, as the route line and ``shoal swarm status`` show them."""
    return "blocks " + ", ".join(f"[{span.start}:{span.end})" for span in spans)


def run_demo(options: DemoOptions) -> int:
    from shoal.checkpoints import fetch_model, load_config
    from shoal.cli.chat import speculation_line
    from shoal.client import AutoDistributedModelForCausalLM
    from shoal.errors import UsageError
    from shoal.gateway.serve import check_draft, load_speculation
    from shoal.heap import freeze_startup_heap
    from shoal.launch import LocalSwarm, even_spans
    from shoal.models import get_family

    if options.draft is not None:
        check_draft(options.draft)  # a wrong name: before any server starts
    model_dir = fetch_model(options.model)
    config = load_config(model_dir)
    num_blocks = get_family(config).num_blocks(config)
    if options.servers > num_blocks:
        raise UsageError(
            f"--servers {options.servers}: {options.model} has {num_blocks} blocks, so at most {num_blocks} "
            "servers (one block each)"
        )
    spans = even_spans(num_blocks, options.servers)
    threads = str(max(1, min(4, os.cpu_count() or 1)))
    print(f"starting {len(spans)} servers for {options.model} on loopback: {spans_text(spans)}", file=sys.stderr)
    with LocalSwarm(model_dir, spans, ["--num-threads", threads]) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(str(model_dir), initial_peers=swarm.tickets)
        try:
            speculation = load_speculation(options.draft, options.prompt_lookup, model.tokenizer)
            freeze_startup_heap()  # before the timed generation (see shoal.heap)
            print("route: " + " -> ".join(f"{s.peer_id[:8]}[{s.start}:{s.end})" for s in model.blocks.chain))
            tokenizer = model.tokenizer
            messages = [{"role": "user", "content": options.prompt}]
            inputs = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            print(f"user: {options.prompt}\nassistant: ", end="", flush=True)
            streamer = _TimedStreamer(tokenizer)
            started = time.perf_counter()
            extra = speculation.generate_kwargs(tokenizer) if speculation is not None else {}
            with torch.inference_mode():
                out = model.generate(
                    **inputs, max_new_tokens=options.max_new_tokens, do_sample=False, streamer=streamer, **extra
                )
            new_tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
            print(f"\n{summary(streamer.arrivals, started)}")
            if speculation is not None and model.last_speculation is not None:
                print(speculation_line(model.last_speculation.summary()))
            if was_cut(new_tokens, options.max_new_tokens, model.generation_config.eos_token_id):
                print(
                    f"(the answer was cut at the limit of {options.max_new_tokens} new tokens: "
                    "raise it with --max-new-tokens N)"
                )
        finally:
            model.close()
    return 0
