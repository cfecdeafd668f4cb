"""``shoal chat MODEL --join TICKET [--join TICKET ...]``: a terminal chat over a swarm (or standalone servers).

The whole conversation runs in ONE inference session: each turn renders the chat template over the
history and generates from it; the servers already hold every earlier token, so a turn sends only
what is new (the client rolls back to the common prefix where re-tokenising the last answer
differs). Tokens are printed as they arrive. Turns are read line by line from stdin, a terminal or a
pipe; ``/exit`` or end of input ends the chat. Standard output holds only the answers: status lines
(the greeting, speculative decoding's acceptance after each answer) go to standard error.

With audits (``--verify audit``, the default) an answer is printed only as far as every hop
is audited (up to ``--audit-every`` tokens behind, the rest after a last audit round when it
ends): a lie found mid-answer is repaired before its tokens are shown, and a status line on standard error says so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO

from shoal.client.config import ClientConfig
from shoal.transport import Ticket

__all__ = ["ChatOptions", "converse", "run_chat", "speculation_line", "verification_line"]

EXIT = ("/exit", "/quit")


@dataclass(frozen=True)
class ChatOptions:
    model: str
    join: tuple[Ticket, ...]  # tickets of swarm members and standalone servers, routed over together
    client: ClientConfig = field(default_factory=ClientConfig)  # connection, codec, verification
    system: str | None = None  # a system message opening the conversation
    max_new_tokens: int = 256  # per answer
    max_length: int | None = None  # session positions (the whole conversation); None: min(context, 2048)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    num_threads: int | None = None
    draft: str | None = None  # speculative decoding with this local draft model (a model name)
    prompt_lookup: int | None = None  # ... or with up to this many tokens a round looked up in the prompt


def run_chat(options: ChatOptions, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    import torch

    from shoal.checkpoints import model_name
    from shoal.client import AutoDistributedModelForCausalLM
    from shoal.gateway.engine import Engine
    from shoal.gateway.serve import check_draft, load_speculation
    from shoal.heap import freeze_startup_heap

    if options.draft is not None:
        check_draft(options.draft)  # a wrong name: before anything loads
    if options.num_threads:
        torch.set_num_threads(options.num_threads)
    model = AutoDistributedModelForCausalLM.from_client_config(options.model, options.join, options.client)
    try:
        speculation = load_speculation(options.draft, options.prompt_lookup, model.tokenizer)
        freeze_startup_heap()  # a long-lived process, after its heavy imports (see shoal.heap)
        return converse(Engine(model, model_name(options.model), speculation=speculation), options, stdin, stdout)
    finally:
        model.close()


def converse(engine, options: ChatOptions, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    """The chat itself, over ``engine`` (:class:`~shoal.gateway.engine.Engine`), in one session;
    ``options`` gives the conversation's settings (its model and swarm are ``engine``'s already)."""
    from shoal.gateway.engine import GatewayError, Sampling

    length = options.max_length or min(engine.context_length, 2048)
    interactive = stdin.isatty()
    messages = [{"role": "system", "content": options.system}] if options.system else []
    if interactive:
        print(f"chatting with {engine.model_id}; /exit or Ctrl-D ends", file=sys.stderr)
    with engine.model.inference_session(max_length=length):
        while True:
            if interactive:
                print("you: ", end="", file=sys.stderr, flush=True)
            line = stdin.readline()
            if not line or line.strip() in EXIT:
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            try:
                prompt = engine.chat_prompt(messages)
            except GatewayError as exc:
                print(f"shoal chat: {exc.message}", file=sys.stderr)
                return 1
            room = length - len(prompt)
            if room < 1:
                print(f"shoal chat: the conversation fills the session's {length} positions", file=sys.stderr)
                break
            sampling = Sampling(min(options.max_new_tokens, room), options.temperature, options.top_p, options.seed)
            print("assistant: ", end="", file=stdout, flush=True)
            done = engine.complete(prompt, sampling, on_text=lambda text: _write(stdout, text))
            print(file=stdout, flush=True)
            if done.speculation is not None:
                print(speculation_line(done.speculation), file=sys.stderr, flush=True)
            if done.verification is not None and (status := verification_line(done.verification)):
                print(status, file=sys.stderr, flush=True)
            messages.append({"role": "assistant", "content": done.text})
    return 0


def speculation_line(summary: dict) -> str:
    """One status line about an answer's speculative decoding (on stderr: stdout holds the chat)."""
    return (
        f"(speculation: {summary['accepted_tokens']}/{summary['drafted_tokens']} drafted tokens accepted "
        f"({summary['acceptance_rate']:.0%}), mean window {summary['mean_window']:.1f})"
    )


def verification_line(state: dict) -> str | None:
    """A status line about what verification found during an answer (None: nothing to report)."""
    found = []
    if state["bans"]:
        found.append(f"{state['bans']} lying server(s) banned")
    if state["rollbacks"]:
        found.append(f"{state['rollbacks']} repair(s): the answer was regenerated from the first wrong token")
    if state["unverified_blocks"]:
        found.append(f"{state['unverified_blocks']} block(s) unverified (no second server)")
    return f"(verify: {'; '.join(found)})" if found else None


def _write(out: TextIO, text: str) -> None:
    out.write(text)
    out.flush()
