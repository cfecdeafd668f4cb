"""The requests of :mod:`bench.soak`, how each is sent (plain HTTP, SSE read line by line) and how
its outcome is judged against plain transformers on the same checkpoint."""

from __future__ import annotations

import http.client
import json
import random
import time
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

import torch

from shoal.client.generation.sampling import PositionSeededSampler

MODEL = "tinychat"
REQUEST_TIMEOUT = 120.0  # an answer not finished by then is lost
SYSTEM_PROMPTS = (
    "You are a terse assistant. Answer in one short sentence, no lists.",
    "You are a helpful assistant for a small bakery: opening hours, bread, cakes and orders.",
    "You translate English to French. Keep names as they are and answer with the translation only.",
)
WORDS = "the swarm keeps answering while servers come and go and some of them lie about blocks".split()  # noqa: SIM905


@dataclass(frozen=True)
class Request:
    index: int
    endpoint: str  # "chat" or "completions"
    body: dict
    stream: bool
    cancel_after: int | None  # content events read before the caller hangs up (None: reads all)


@dataclass(frozen=True)
class Outcome:
    request: Request | None  # None: a request that never came back at all
    status: str  # "ok", "error" (a clear API error), "lost"
    text: str
    seconds: float
    detail: str = ""
    completion_tokens: int | None = None


@dataclass(frozen=True)
class Verdict:
    verdict: str  # "completed", "altered", "failed_clear", "lost"
    ms_per_token: float | None
    detail: str = ""


def make_request(seed: int, index: int, tokenizer) -> Request:
    """Request ``index`` of the soak seeded ``seed``: the same every run."""
    rng = random.Random(seed * 1_000_003 + index)
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    body: dict = {"model": MODEL, "max_tokens": rng.randint(6, 24)}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body |= {"temperature": 0.8, "seed": rng.randrange(1 << 31)}
        if rng.random() < 0.5:
            body["top_p"] = 0.9
    if rng.random() < 0.5:
        endpoint = "chat"
        messages = [{"role": "user", "content": words}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        body["messages"] = messages
    else:
        endpoint = "completions"
        body["prompt"] = words
    stream = rng.random() < 0.8
    cancel_after = rng.randint(1, 2) if stream and rng.random() < 0.1 else None
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return Request(index, endpoint, body, stream, cancel_after)


def send(url: str, request: Request) -> Outcome:
    """Send ``request``; never raises (a transport failure is an outcome: lost)."""
    started = time.monotonic()
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT)
    path = "/v1/chat/completions" if request.endpoint == "chat" else "/v1/completions"
    try:
        connection.request("POST", path, json.dumps(request.body), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        if reply.status != 200:
            body = json.loads(reply.read() or b"{}")
            ok = isinstance(body.get("error"), dict) and "message" in body["error"]
            detail = f"HTTP {reply.status}: {json.dumps(body)[:300]}"
            return Outcome(request, "error" if ok else "lost", "", time.monotonic() - started, detail)
        if not request.stream:
            body = json.loads(reply.read())
            choice = body["choices"][0]
            text = choice["message"]["content"] if request.endpoint == "chat" else choice["text"]
            tokens = body["usage"]["completion_tokens"]
            return Outcome(request, "ok", text, time.monotonic() - started, choice["finish_reason"], tokens)
        return _read_stream(request, reply, started)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        return Outcome(request, "lost", "", time.monotonic() - started, f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()


def _read_stream(request: Request, reply: http.client.HTTPResponse, started: float) -> Outcome:
    text, events, finish, tokens = [], 0, None, None
    deadline = started + REQUEST_TIMEOUT
    for raw in reply:
        if time.monotonic() > deadline:
            return Outcome(request, "lost", "".join(text), time.monotonic() - started, "past the deadline")
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            detail = finish or "no finish_reason"
            status = "ok" if finish is not None else "lost"
            return Outcome(request, status, "".join(text), time.monotonic() - started, detail, tokens)
        event = json.loads(data)
        if "error" in event:
            return Outcome(request, "error", "".join(text), time.monotonic() - started, json.dumps(event)[:300])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            delta = choice["delta"].get("content") if request.endpoint == "chat" else choice.get("text")
            if delta:
                text.append(delta)
                events += 1
            finish = choice.get("finish_reason") or finish
        if request.cancel_after is not None and events >= request.cancel_after:
            return Outcome(request, "ok", "".join(text), time.monotonic() - started, "cancelled by the caller")
    return Outcome(request, "lost", "".join(text), time.monotonic() - started, "stream ended without [DONE]")


def prompt_ids(request: Request, tokenizer) -> list[int]:
    """The prompt's token ids as the gateway builds them."""
    if request.endpoint == "chat":
        encoded = tokenizer.apply_chat_template(request.body["messages"], add_generation_prompt=True, return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer(request.body["prompt"])["input_ids"])


def reference(model, tokenizer, request: Request) -> tuple[str, int]:
    """What transformers answers: greedy, or the gateway's position-seeded sampler; (text, tokens)."""
    body = request.body
    key = json.dumps({k: v for k, v in body.items() if k not in ("stream", "stream_options")}, sort_keys=True)
    return _reference(model, tokenizer, key, request.endpoint)


@lru_cache(maxsize=4096)
def _reference(model, tokenizer, key: str, endpoint: str) -> tuple[str, int]:
    body = json.loads(key)
    ids = prompt_ids(Request(0, endpoint, body, False, None), tokenizer)
    processors = []
    if body.get("temperature", 1.0) > 0:
        processors.append(PositionSeededSampler(body["temperature"], body.get("top_p") or 1.0, body["seed"]))
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=body["max_tokens"],
            logits_processor=processors, top_k=None, top_p=None, temperature=None,
        )  # fmt: skip
    new = out[0, len(ids) :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def check(outcome: Outcome, model, tokenizer) -> Verdict:
    """Judge one outcome against the reference (see :mod:`bench.soak`)."""
    if outcome.status == "lost" or outcome.request is None:
        return Verdict("lost", None, f"request {getattr(outcome.request, 'index', '?')}: {outcome.detail}")
    if outcome.status == "error":
        return Verdict("failed_clear", None, outcome.detail)
    request = outcome.request
    expected, tokens = reference(model, tokenizer, request)
    if request.cancel_after is not None and outcome.detail == "cancelled by the caller":
        same = expected.startswith(outcome.text)
        detail = f"request {request.index} (cancelled): {outcome.text!r} vs {expected!r}"
        return Verdict("completed" if same else "altered", None, detail)
    if outcome.text != expected or (outcome.completion_tokens is not None and outcome.completion_tokens != tokens):
        told = outcome.completion_tokens
        detail = f"request {request.index} ({told} tokens): {outcome.text!r} vs {expected!r} ({tokens})"
        return Verdict("altered", None, detail)
    return Verdict("completed", outcome.seconds * 1e3 / max(1, tokens))
