"""``shoal api`` over a live 3-server swarm, through the official ``openai`` client (and raw HTTP
where the client cannot send what we test, e.g. broken JSON or no API key).

Answers are greedy and compared with plain transformers on the same weights and chat template;
server-side effects (sessions, tokens) are read from the servers' Prometheus metrics.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from shoal import __version__
from shoal.transport import META
from shoal.transport.identity import generate_key
from shoal.wire import FRAME_HEAD
from tests.gateway.conftest import API_KEY, MODEL_ID
from tests.gateway.support import CACHE_TOKENS, reference_answer, reference_continuation, total, wait_for
from tests.helpers.aio import run

pytestmark = pytest.mark.timeout(180)

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]
NEW = 16


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def raw(api, path: str, body: bytes | None = None, key: str | None = API_KEY, method: str | None = None):
    """(status, parsed JSON or text) of one HTTP request to the gateway."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{api.url}{path}", data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def assert_error(payload, code: str | None = None, param: str | None = None, kind: str = "invalid_request_error"):
    """OpenAI's error shape: exactly message, type, param and code."""
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == kind, error
    assert error["code"] == code, error
    assert error["param"] == param, error


@pytest.mark.slow
def test_models(client, api):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).owned_by == "shoal"
    status, payload = raw(api, "/v1/models/nope")
    assert status == 404
    assert_error(payload, "model_not_found", "model")


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_greedy_chat_equals_transformers(client, chat_model, chat):
    _, reference, tokenizer = chat_model
    expected, ids = reference_answer(reference, tokenizer, CHATS[chat], NEW)
    reply = client.chat.completions.create(model=MODEL_ID, messages=CHATS[chat], temperature=0, max_tokens=NEW)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("stop" if ids[-1] == tokenizer.eos_token_id else "length")
    prompt = tokenizer.apply_chat_template(CHATS[chat], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(ids)
    assert reply.usage.total_tokens == len(prompt) + len(ids)
    assert reply.model == MODEL_ID and reply.object == "chat.completion"


def test_stream_joins_to_the_non_streamed_text(client, chat_model, api):
    messages = CHATS[0]
    whole = client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=NEW)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID,
            messages=messages,
            temperature=0,
            max_tokens=NEW,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert len([c for c in with_choices if c.choices[0].delta.content]) > 3, "tokens arrive one by one"
    assert [c.choices[0].finish_reason for c in with_choices][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    # the wire format: server-sent events ending with [DONE]
    body = json.dumps({"model": MODEL_ID, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True})
    status, text = raw(api, "/v1/chat/completions", body.encode())
    events = [line for line in text.split("\n\n") if line]
    assert status == 200 and all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_completions_equal_transformers(client, chat_model):
    _, reference, tokenizer = chat_model
    prompt = "The quick brown fox"
    expected, ids = reference_continuation(reference, tokenizer, tokenizer(prompt)["input_ids"], NEW)
    reply = client.completions.create(model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=NEW)
    assert reply.choices[0].text == expected
    assert reply.usage.completion_tokens == len(ids)
    streamed = client.completions.create(model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=NEW, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_stop_string_ends_the_answer_before_it(client, chat_model):
    _, reference, tokenizer = chat_model
    expected, ids = reference_answer(reference, tokenizer, CHATS[0], NEW)
    piece = tokenizer.decode(ids[5:7], skip_special_tokens=True)  # a stop string from the middle of the answer
    assert piece.strip() and piece in expected
    cut = expected[: expected.index(piece)]
    kwargs = dict(model=MODEL_ID, messages=CHATS[0], temperature=0, max_tokens=NEW, stop=[piece, "never-there"])
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].message.content == cut
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < NEW
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_varies_with_the_seed(client):
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=CHATS[0], temperature=1.3, top_p=0.95, seed=seed, max_tokens=12
        )
        return reply.choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1


def test_bad_json_and_bad_fields_are_400(api):
    status, payload = raw(api, "/v1/chat/completions", b'{"model": "tinychat", "messages": [')
    assert status == 400
    assert_error(payload)
    status, payload = raw(api, "/v1/chat/completions", b"[1, 2]")
    assert status == 400
    assert_error(payload)
    status, payload = raw(api, "/v1/chat/completions", json.dumps({"model": MODEL_ID}).encode())
    assert status == 400
    assert_error(payload, param="messages")
    body = {"model": MODEL_ID, "messages": CHATS[0], "temperature": 7}
    status, payload = raw(api, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400
    assert_error(payload, param="temperature")


def test_unknown_model_is_404(client, api):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CHATS[0], max_tokens=4)
    assert caught.value.status_code == 404
    status, payload = raw(api, "/v1/completions", json.dumps({"model": "gpt-4o", "prompt": "hi"}).encode())
    assert status == 404
    assert_error(payload, "model_not_found", "model")


def test_context_too_long_is_400(client, api):
    long_chat = [{"role": "user", "content": "hello " * 2100}]  # > 2048 positions
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=long_chat, max_tokens=4)
    assert caught.value.code == "context_length_exceeded"
    for body, param in (
        ({"model": MODEL_ID, "messages": long_chat}, "messages"),
        ({"model": MODEL_ID, "messages": CHATS[0], "max_tokens": 2040, "stream": True}, "messages"),
        ({"model": MODEL_ID, "prompt": "hi " * 2100}, "prompt"),
    ):
        endpoint = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        status, payload = raw(api, endpoint, json.dumps(body).encode())
        assert status == 400
        assert_error(payload, "context_length_exceeded", param)


def test_missing_or_wrong_api_key_is_401(api):
    body = json.dumps({"model": MODEL_ID, "messages": CHATS[0], "max_tokens": 2}).encode()
    status, payload = raw(api, "/v1/chat/completions", body, key=None)
    assert status == 401
    assert_error(payload, "missing_api_key")
    status, payload = raw(api, "/v1/models", key="wrong")
    assert status == 401
    assert_error(payload, "invalid_api_key")
    wrong = openai.OpenAI(base_url=f"{api.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model=MODEL_ID, messages=CHATS[0], max_tokens=2)
    assert caught.value.status_code == 401


def test_request_the_swarm_cannot_serve_is_503(client, api, swarm):
    """More positions than the servers' cache budget: the context allows it, the swarm does not."""
    too_many = CACHE_TOKENS + 200
    for stream in (False, True):
        body = {"model": MODEL_ID, "messages": CHATS[0], "max_tokens": too_many, "stream": stream}
        status, payload = raw(api, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 503, payload
        assert_error(payload, payload["error"]["code"], kind="server_error")
        assert payload["error"]["code"] in ("swarm_busy", "swarm_unavailable")  # routing may say "no usable server"
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=CHATS[0], max_tokens=too_many)
    assert caught.value.status_code == 503
    wait_for(lambda: total(swarm, "shoal_sessions_active") == 0, 20, what="no session left open")


def test_eight_concurrent_streams_all_complete(client, chat_model, swarm):
    _, reference, tokenizer = chat_model
    questions = [[{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}] for i in range(8)]
    expected = [reference_answer(reference, tokenizer, q, 24)[0] for q in questions]
    opened = total(swarm, "shoal_sessions_opened_total")
    answers: list[str | BaseException | None] = [None] * 8
    start = threading.Barrier(8)

    def ask(i: int) -> None:
        try:
            start.wait(30)
            stream = client.chat.completions.create(
                model=MODEL_ID, messages=questions[i], temperature=0, max_tokens=24, stream=True
            )
            answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except BaseException as exc:
            answers[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert answers == expected
    # each request had its own session on every server
    assert total(swarm, "shoal_sessions_opened_total") - opened == 8 * len(swarm.servers)
    wait_for(lambda: total(swarm, "shoal_sessions_active") == 0, 20, what="every session closed")


def test_a_cancelled_stream_frees_its_server_sessions(client, swarm):
    before = [s.metrics() for s in swarm.servers]
    limit = 600
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=CHATS[0], temperature=0, max_tokens=limit, stream=True
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    assert all(s.metrics()["shoal_sessions_active"] == 1 for s in swarm.servers), "the session is open meanwhile"
    stream.close()  # the client goes away mid-stream

    def freed() -> bool:
        now = [s.metrics() for s in swarm.servers]
        return all(m["shoal_sessions_active"] == 0 for m in now) and all(
            m['shoal_sessions_ended_total{reason="closed"}'] == b['shoal_sessions_ended_total{reason="closed"}'] + 1
            for m, b in zip(now, before, strict=True)
        )

    wait_for(freed, 20, what="the cancelled stream's sessions closed by the gateway")
    served = [
        s.metrics()['shoal_tokens_served_total{kind="session"}'] - b['shoal_tokens_served_total{kind="session"}']
        for s, b in zip(swarm.servers, before, strict=True)
    ]
    assert all(0 < n < limit for n in served), f"generation stopped early: {served} positions per server"
    time.sleep(1.0)
    again = [s.metrics()['shoal_tokens_served_total{kind="session"}'] for s in swarm.servers]
    assert [a - b['shoal_tokens_served_total{kind="session"}'] for a, b in zip(again, before, strict=True)] == served


def test_a_client_gone_before_a_non_streamed_answer_cancels_it(api, swarm):
    """Without streaming, the gateway notices the closed connection (it checks every 0.25 s)."""
    before = total(swarm, 'shoal_tokens_served_total{kind="session"}')
    limit = CACHE_TOKENS - 100  # as long as the servers' cache allows
    body = json.dumps({"model": MODEL_ID, "messages": CHATS[0], "max_tokens": limit, "temperature": 0}).encode()
    host, port = api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body)
        wait_for(lambda: total(swarm, "shoal_sessions_active") == len(swarm.servers), 20, 0.05, "generation started")
    wait_for(lambda: total(swarm, "shoal_sessions_active") == 0, 20, 0.05, "the sessions freed")
    served = (total(swarm, 'shoal_tokens_served_total{kind="session"}') - before) / len(swarm.servers)
    print(f"positions served per server before the cancel took effect: {served:.0f} of {limit}")
    assert 0 < served < limit / 2, "generation stopped well before max_tokens"


def test_dashboard_and_its_json(api, swarm):
    status, page = raw(api, "/dashboard", key=None)
    assert status == 200 and "<title>shoal swarm</title>" in page and "api/swarm" in page
    status, data = raw(api, "/api/swarm", key=None)
    assert status == 200 and data["swarm"] == swarm.ticket.swarm_id and data["error"] is None
    (model,) = data["models"]
    assert model["name"] == MODEL_ID and model["coverage"] == [1] * 6
    servers = {s["peer"]: s for s in model["servers"]}
    assert set(servers) == {s.peer for s in swarm.servers}
    for server in swarm.servers:
        shown = servers[server.peer]
        assert (shown["start"], shown["end"], shown["state"]) == (*server.span, "online")
        assert shown["cache_tokens_free"] > 0 and shown["throughput"] == 100
    # another ticket has the gateway dial that peer: only for a caller with the API key
    status, payload = raw(api, f"/api/swarm?ticket={swarm.servers[2].process.ticket}", key=None)
    assert status == 401
    assert_error(payload, "missing_api_key")
    status, other = raw(api, f"/api/swarm?ticket={swarm.servers[2].process.ticket}")
    assert status == 200 and other["swarm"] == swarm.ticket.swarm_id
    status, payload = raw(api, "/api/swarm?ticket=garbage")
    assert status == 400
    assert_error(payload, param="ticket")


def test_server_metrics_count_rejected_frames_and_records(swarm):
    """Rejected wire frames and swarm records, as Prometheus counters."""
    from tests.helpers.registry import TestPeer, peer_id, server_record, sign_with

    server = swarm.servers[0]
    before = server.metrics()

    async def attack() -> None:
        async with TestPeer(swarm.ticket.swarm_id) as peer:
            stream = await peer.node.open_stream(server.process.ticket, META)
            await stream.send_raw(struct.pack(">IB", 0, FRAME_HEAD))  # a frame of length 0: bad_frame
            await stream.finish()
            key = generate_key()
            now = time.time()
            alien = server_record("another-swarm", peer_id(key), MODEL_ID, (0, 1), [bytes(32)], now, 30.0)
            await peer.op(server.process.ticket, "push", [sign_with(alien, key)])

    run(attack(), 30)

    def counted() -> dict | None:
        now = server.metrics()
        frames = 'shoal_rejected_frames_total{reason="bad_frame"}'
        records = 'shoal_rejected_records_total{reason="wrong_swarm"}'
        grew = now.get(frames, 0) > before.get(frames, 0) and now.get(records, 0) > before.get(records, 0)
        return now if grew else None

    now = wait_for(counted, 10, what="rejected frame and record counted")
    assert now["shoal_cache_capacity_tokens"] == CACHE_TOKENS
    assert now["shoal_kv_pages"] == CACHE_TOKENS // 16 and 0 <= now["shoal_kv_pages_in_use"] <= now["shoal_kv_pages"]
    batches, steps = now["shoal_batches_total"], now["shoal_steps_total"]
    assert batches <= now["shoal_batched_steps_total"] and (batches > 0) == (steps > 0)
    assert now["shoal_step_latency_seconds_count"] == now["shoal_steps_total"] > 0
    assert 0 < now["shoal_step_latency_seconds_sum"] < now["shoal_steps_total"]  # well under 1 s per step
    info = f'shoal_server_info{{dtype="float32",end="2",model="{MODEL_ID}",start="0",version="{__version__}"}}'
    assert now[info] == 1
