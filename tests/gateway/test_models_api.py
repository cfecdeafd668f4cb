"""Several models behind one ``shoal api``: two tiny llamas of different shapes, each in its own
pinned swarm, and one gateway started with no model and both swarms' tickets (``--models-dir``
says where their client parts are). The official ``openai`` client gets plain transformers'
greedy answers from both, ``/v1/models`` lists both with their coverage; when the server of beta's
last blocks stops, beta answers 503 (``model_unavailable``) while alpha keeps answering, and a new
server for those blocks brings beta back."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from testkit.tiny import save_checkpoint, tiny_model
from tests.gateway.support import UrlProcess, build_chat_model, gateway_args, reference_answer, scrape, wait_for
from tests.helpers.registry import process_swarm

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NEW = 12
BETA_SPANS = [(0, 2), (2, 4)]


def build_beta(out_dir: Path, tokenizer_dir: Path):
    """A second tiny llama, narrower and shallower than the chat model (4 blocks of hidden 32)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model = tiny_model("llama", seed=23, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4,
                       max_position_embeddings=2048, **special)  # fmt: skip
    for key, value in special.items():
        setattr(model.generation_config, key, value)
    save_checkpoint(model, out_dir, tokenizer=tokenizer)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer_dir):
    """The models' folder and {name: (reference model, tokenizer)}."""
    root = tmp_path_factory.mktemp("several")
    alpha = build_chat_model(root / "alpha", smollm2_tokenizer_dir)
    beta = build_beta(root / "beta", smollm2_tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(root / "alpha"))
    return root, {"alpha": (alpha, tokenizer), "beta": (beta, tokenizer)}


@pytest.fixture(scope="module")
def swarms(models):
    root = models[0]
    alpha, beta = process_swarm(root / "alpha"), process_swarm(root / "beta")
    try:
        alpha.start([(0, 6)])
        beta.start(BETA_SPANS)
        beta.wait_converged(60.0)
        yield alpha, beta
    finally:
        alpha.stop()
        beta.stop()


def expected(models, name: str) -> str:
    reference, tokenizer = models[1][name]
    return reference_answer(reference, tokenizer, MESSAGES, NEW)[0]


def expected_tokens(models, name: str) -> int:
    reference, tokenizer = models[1][name]
    return len(reference_answer(reference, tokenizer, MESSAGES, NEW)[1])


def ask(client: openai.OpenAI, name: str) -> str:
    reply = client.chat.completions.create(model=name, messages=MESSAGES, temperature=0, max_tokens=NEW)
    assert reply.model == name
    return reply.choices[0].message.content


def listed(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
        return {m["id"]: m["shoal"]["coverage"] for m in json.loads(reply.read())["data"]}


def chat_status(url: str, name: str) -> tuple[int, dict]:
    body = json.dumps({"model": name, "messages": MESSAGES, "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_one_gateway_serves_both_models_and_one_that_loses_coverage_comes_back(models, swarms):
    root = models[0]
    alpha, beta = swarms
    args = gateway_args(root, alpha.tickets[0], "--join", str(beta.tickets[0]), "--models-dir", str(root))
    args.remove(str(root))  # no model named: every model the swarms list (the folder is --models-dir's)
    process = UrlProcess(args, "gateway", timeout=120.0)
    try:
        url = process.url
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        assert sorted(m.id for m in client.models.list().data) == ["alpha", "beta"]
        coverage = listed(url)
        assert (coverage["alpha"]["num_blocks"], coverage["beta"]["num_blocks"]) == (6, 4)
        assert coverage["alpha"]["covered"] and coverage["beta"]["covered"]
        assert ask(client, "alpha") == expected(models, "alpha")
        assert ask(client, "beta") == expected(models, "beta")
        assert expected(models, "alpha") != expected(models, "beta")  # two models, two answers
        metrics = scrape(f"{url}/metrics")
        for name in ("alpha", "beta"):
            assert metrics[f'shoal_model_completion_tokens_total{{model="{name}"}}'] == expected_tokens(models, name)
            assert metrics[f'shoal_model_loaded{{model="{name}"}}'] == 1.0
            assert metrics[f'shoal_model_requests_in_flight{{model="{name}"}}'] == 0.0
        assert metrics["shoal_completion_tokens_total"] == sum(expected_tokens(models, n) for n in ("alpha", "beta"))
        with urllib.request.urlopen(f"{url}/api/swarm", timeout=30) as reply:
            panel = json.loads(reply.read())["gateway_models"]
        assert [(m["id"], m["shoal"]["loaded"], m["shoal"]["coverage"]["covered"]) for m in panel] == [
            ("alpha", True, True), ("beta", True, True)]  # fmt: skip

        last = beta.running[-1]
        last.kill()  # SIGKILL: no offline record; the members find it unreachable within a probe or two
        wait_for(lambda: not listed(url)["beta"]["covered"], 60, what="beta uncovered")
        assert scrape(f"{url}/metrics")['shoal_model_covered{model="beta"}'] == 0.0
        status, payload = chat_status(url, "beta")
        assert status == 503, payload
        assert (payload["error"]["code"], payload["error"]["param"]) == ("model_unavailable", "model")
        assert "blocks 2-3" in payload["error"]["message"]
        with pytest.raises(openai.InternalServerError):
            ask(client, "beta")
        assert ask(client, "alpha") == expected(models, "alpha")  # the other model keeps answering

        beta.start([BETA_SPANS[-1]])
        wait_for(lambda: listed(url)["beta"]["covered"], 60, what="beta covered again")
        assert ask(client, "beta") == expected(models, "beta")
        assert listed(url)["beta"]["servers_online"] == 2
        status, payload = chat_status(url, "gamma")
        assert (status, payload["error"]["code"]) == (404, "model_not_found")
    finally:
        process.stop()
