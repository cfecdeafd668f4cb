"""``shoal api`` over the 3-server swarm: a chat that repeats an earlier conversation's prefix (the next turn
resends the whole conversation) is answered from the servers' prefix caches (shoal.server.prefix) and gets
the same answer as plain transformers."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import API_KEY, MODEL_ID
from tests.gateway.support import reference_answer

pytestmark = pytest.mark.timeout(180)

SYSTEM = {"role": "system", "content": "You are a terse assistant. You answer every question in one short word."}
NEW = 8


def hit_tokens(swarm) -> list[float]:
    return [server.metrics().get("shoal_prefix_hit_tokens_total", 0.0) for server in swarm.servers]


def test_the_next_turn_of_a_chat_reuses_the_servers_pages(api, swarm, chat_model) -> None:
    _, reference, tokenizer = chat_model
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    first = [SYSTEM, {"role": "user", "content": "Name a large animal that lives in the sea."}]
    answer = client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=NEW, temperature=0)
    assert answer.choices[0].message.content == reference_answer(reference, tokenizer, first, NEW)[0]
    before = hit_tokens(swarm)
    second = [*first, {"role": "assistant", "content": answer.choices[0].message.content},
              {"role": "user", "content": "And a small one?"}]  # fmt: skip
    again = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=NEW, temperature=0)
    assert again.choices[0].message.content == reference_answer(reference, tokenizer, second, NEW)[0]
    gained = [now - was for now, was in zip(hit_tokens(swarm), before, strict=True)]
    assert all(g >= 16 and g % 16 == 0 for g in gained), gained  # whole pages, on every server of the chain
