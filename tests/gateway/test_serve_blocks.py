"""The gateway as a peer: ``shoal api MODEL --serve-blocks 0:2`` serves the first blocks in its own
process (as ``shoal serve`` would), joined to a swarm of ``shoal serve`` processes that host only the
rest. Its greedy answers equal plain transformers'; the span is announced like any server, so a second
gateway (another peer, without a span) routes through it, and both answer at the same time.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from shoal.launch import LocalSwarm
from tests.gateway.support import ENV, gateway, reference_answer
from tests.gateway.support import SPANS as CHAT_MODEL_SPANS

pytestmark = pytest.mark.timeout(240)

NUM_BLOCKS = CHAT_MODEL_SPANS[-1][1]
SERVED = "0:2"  # the gateway's own span; the swarm's servers host the rest
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
OTHER = [{"role": "user", "content": "Name a colour."}]
NEW = 12


def ask(url: str, model: str, messages: list[dict]) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=90)
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=NEW)
    return reply.choices[0].message.content


def test_a_gateway_serving_blocks_answers_as_transformers_and_serves_another_peer(chat_model):
    model_dir, reference, tokenizer = chat_model
    spans = [(2, 4), (4, NUM_BLOCKS)]
    with LocalSwarm(model_dir, spans, ["--num-threads", "1"], swarm=True, env=ENV, ready_timeout=120) as swarm:
        ticket = swarm.tickets[0]
        with gateway(model_dir, ticket, "--serve-blocks", SERVED) as peer:
            expected, _ = reference_answer(reference, tokenizer, MESSAGES, NEW)
            assert ask(peer.url, model_dir.name, MESSAGES) == expected
            # a plain gateway of the same swarm: only the first gateway serves blocks 0:2
            with gateway(model_dir, ticket, "--route-wait", "30") as plain:
                other, _ = reference_answer(reference, tokenizer, OTHER, NEW)
                with ThreadPoolExecutor(2) as pool:  # the span serves both gateways' sessions at once
                    mine = pool.submit(ask, peer.url, model_dir.name, OTHER)
                    theirs = pool.submit(ask, plain.url, model_dir.name, MESSAGES)
                    assert mine.result(120) == other
                    assert theirs.result(120) == expected
