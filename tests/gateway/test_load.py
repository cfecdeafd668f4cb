"""64 concurrent streaming chat requests to ``shoal api --max-concurrency 64`` over a 2-server swarm
whose KV page budget admits :data:`FITS` of them at once (issue 17's load test).

Every request's session has the same length (:data:`SESSION_POSITIONS`: prompt + ``max_tokens``,
a whole number of pages), so each commits exactly the same pages at ``open`` and the budget
(:data:`FITS` sessions' worth per server) decides how many run at once. A request is either a
complete, well-formed SSE stream of exactly the greedy answer plain transformers gives for its own
prompt (every prompt differs, so a mix-up between requests shows), or an HTTP 503 whose error says
the swarm is busy, sent before any stream starts. Meanwhile a sampler reads every server's ``info``:
pages in use never exceed the pages there are. Afterwards the swarm serves a normal request.

The gateway is the real ``shoal api`` process; the servers need ``--max-sessions-per-peer 64`` (the
gateway is one peer to them).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from shoal.client.remote.recovery import ChainRecovery
from shoal.errors import BusyError, ShoalError
from shoal.routing import NoRouteError
from shoal.transport import Node
from shoal.wire.schema import OpenRequest
from tests.gateway.conftest import MODEL_ID
from tests.gateway.support import LOOPBACK, gateway, reference_answer
from tests.helpers.aio import run
from tests.helpers.registry import process_swarm
from tests.helpers.servers import info

pytestmark = pytest.mark.timeout(150)

REQUESTS = 64
PAGE_SIZE = 16
SESSION_POSITIONS = 3 * PAGE_SIZE  # every request: prompt + max_tokens = exactly 3 pages
FITS = 52  # sessions of SESSION_POSITIONS the page budget admits at once
CACHE_TOKENS = FITS * SESSION_POSITIONS  # per hosted block (what ``--cache-tokens`` means)
SPANS = [(0, 3), (3, 6)]
HTTP_TIMEOUT = 60.0
SAMPLE_PERIOD = 0.05


@dataclass
class Outcome:
    """What one request got: its HTTP status and either the stream's events or the error body."""

    status: int
    events: list[str] = field(default_factory=list)  # the ``data:`` payloads, in order
    error: dict | None = None


def chats(count: int) -> list[list[dict]]:
    """``count`` different one-message conversations (each answer is checked against its own prompt)."""
    return [[{"role": "user", "content": f"Number {i * 7 + 3}?"}] for i in range(count)]


def stream_chat(url: str, messages: list[dict], max_tokens: int, go: threading.Barrier) -> Outcome:
    """One streaming chat request (sent when every request is ready, so they really overlap)."""
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    go.wait(HTTP_TIMEOUT)
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as reply:
            assert reply.headers.get_content_type() == "text/event-stream", reply.headers
            lines = [line.decode() for line in reply]
    except urllib.error.HTTPError as exc:
        return Outcome(exc.code, error=json.loads(exc.read().decode()))
    return Outcome(200, sse_payloads(lines))


def sse_payloads(lines: list[str]) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking its framing: every event is one ``data:`` line
    followed by a blank line."""
    text = "".join(lines)
    assert text.endswith("\n\n"), text[-80:]
    payloads = []
    for event in text[:-2].split("\n\n"):
        assert event.startswith("data: ") and "\n" not in event, event
        payloads.append(event[len("data: ") :])
    return payloads


def check_stream(outcome: Outcome, expected_text: str) -> None:
    """A complete chat stream: role first, content deltas joining to ``expected_text``, one finish
    reason, ``[DONE]`` last; every chunk of one id."""
    assert outcome.events[-1] == "[DONE]", outcome.events[-3:]
    chunks = [json.loads(e) for e in outcome.events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL_ID for c in chunks), chunks[:2]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[:-1] == [None] * (len(chunks) - 1) and finishes[-1] in ("length", "stop"), finishes
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == expected_text, (text, expected_text)


def check_busy(outcome: Outcome) -> None:
    """A 503 in OpenAI's error shape that says the swarm is busy (no stream was started)."""
    assert outcome.status == 503 and not outcome.events, outcome
    error = outcome.error["error"]
    assert error["code"] == "swarm_busy" and error["type"] == "server_error", error
    assert "busy" in error["message"] or "no room" in error["message"], error


class PageSampler:
    """Reads every server's ``info`` every :data:`SAMPLE_PERIOD` in a thread of its own (with its own
    node) until stopped; keeps ``(kv_pages_in_use, kv_pages_total)`` per sample and server."""

    def __init__(self, tickets):
        self.tickets = list(tickets)
        self.samples: list[tuple[int, int]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="page-sampler", daemon=True)

    def __enter__(self) -> PageSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)

    def _run(self) -> None:
        try:
            asyncio.run(self._sample())
        except BaseException as exc:  # reported by the test
            self.error = exc

    async def _sample(self) -> None:
        node = await Node.start(LOOPBACK)
        try:
            while not self._stop.is_set():
                for ticket in self.tickets:
                    counters = (await asyncio.wait_for(info(node, ticket), 10)).counters
                    self.samples.append((counters.kv_pages_in_use, counters.kv_pages_total))
                await asyncio.sleep(SAMPLE_PERIOD)
        finally:
            await node.close()


@pytest.fixture(scope="module")
def load_swarm(chat_model):
    """Two servers whose page budget holds :data:`FITS` sessions of :data:`SESSION_POSITIONS`."""
    flags = ("--throughput", "100", "--cache-tokens", str(CACHE_TOKENS), "--page-size", str(PAGE_SIZE),
             "--max-sessions-per-peer", str(REQUESTS))  # fmt: skip
    swarm = process_swarm(chat_model[0], *flags)
    try:
        swarm.start(SPANS)
        swarm.wait_converged(60.0)
        yield swarm
    finally:
        swarm.stop()


@pytest.mark.slow
def test_64_streams_at_a_budget_of_52(chat_model, load_swarm):
    model_dir, reference, tokenizer = chat_model
    conversations = chats(REQUESTS)
    budgets, expected = [], []
    for messages in conversations:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        budgets.append(SESSION_POSITIONS - len(prompt))
        assert budgets[-1] >= 8, f"prompt of {len(prompt)} tokens leaves too few new ones"
        expected.append(reference_answer(reference, tokenizer, messages, budgets[-1])[0])
    assert len(set(expected)) > REQUESTS // 2, "the answers should tell the requests apart"
    tickets = [server.ticket for server in load_swarm.servers]

    with gateway(model_dir, tickets[0], "--max-concurrency", str(REQUESTS)) as api:
        go = threading.Barrier(REQUESTS)
        started = time.monotonic()
        with PageSampler(tickets) as sampler, ThreadPoolExecutor(REQUESTS) as pool:
            futures = [pool.submit(stream_chat, api.url, m, n, go) for m, n in zip(conversations, budgets, strict=True)]
            outcomes = [future.result(HTTP_TIMEOUT + 30) for future in futures]
        burst_s = time.monotonic() - started
        assert sampler.error is None, f"info sampling failed: {sampler.error!r}"

        statuses = [o.status for o in outcomes]
        assert set(statuses) <= {200, 503}, statuses
        completed = [i for i, o in enumerate(outcomes) if o.status == 200]
        for i in completed:
            check_stream(outcomes[i], expected[i])
        for outcome in outcomes:
            if outcome.status != 200:
                check_busy(outcome)
        assert len(completed) >= 48, f"{len(completed)} of {REQUESTS} completed in {burst_s:.1f} s: {statuses}"
        assert len(completed) < REQUESTS, f"the page budget turned nobody away (burst of {burst_s:.1f} s)"

        assert len(sampler.samples) >= 2 * len(tickets), sampler.samples
        totals = {total for _, total in sampler.samples}
        assert totals == {CACHE_TOKENS // PAGE_SIZE}, totals
        assert max(used for used, _ in sampler.samples) > 0, "the sampler never saw a page in use"
        over = [(used, total) for used, total in sampler.samples if used > total]
        assert not over, over

        # the swarm serves a normal request afterwards (the gateway did not give up on its servers)
        after = stream_chat(api.url, conversations[0], budgets[0], threading.Barrier(1))
        assert after.status == 200, after
        check_stream(after, expected[0])


class OneServerEach:
    """A planner and route feedback over one server per span (``peers``): the route is every one
    not excluded, or :class:`NoRouteError`; bans are recorded."""

    def __init__(self, *peers: str):
        self.peers, self.banned = peers, []

    def route_inference(self, start, *, cache_tokens, push, exclude=(), needs=()):
        if any(peer in exclude for peer in self.peers):
            raise NoRouteError("no usable server hosts blocks 0-5 (of 0-5)", [0])
        return [type("Span", (), {"peer_id": peer})() for peer in self.peers]

    def missing_blocks(self, start, exclude=(), needs=()):
        return [0]

    def failed(self, peer, ban_seconds=None):
        self.banned.append(peer)


class Answers(ChainRecovery):
    """Opens that fail as ``errors`` says (peer id -> exception)."""

    def __init__(self, planner: OneServerEach, errors: dict[str, ShoalError]):
        super().__init__(None, planner, planner, OpenRequest(max_length=48), push=False)
        self.errors = errors

    async def open_hop(self, span, timeout=None):
        raise self.errors[span.peer_id]


def test_a_full_server_is_busy_not_banned():
    """What the gateway's 503 "busy" rests on: an open that a full server refuses raises that
    :class:`BusyError` (not "no route"), and routing does not ban the server (it serves the next
    session that fits); a broken server is banned and the open says no route, as before."""
    full = OneServerEach("a", "b")
    with pytest.raises(BusyError, match="no room"):
        run(Answers(full, {"a": BusyError("no room"), "b": BusyError("no room")}).open_chain(), 5)
    assert full.banned == []
    mixed = OneServerEach("a", "b")
    with pytest.raises(NoRouteError):
        run(Answers(mixed, {"a": BusyError("no room"), "b": ShoalError("stream reset")}).open_chain(), 5)
    assert mixed.banned == ["b"]
