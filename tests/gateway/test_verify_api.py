"""``shoal api`` / ``shoal chat`` with ``--verify``: the flags, and answers over a swarm with a liar.

The flags are parsed as ``shoal`` parses them (``off``, ``audit``, ``redundant``; a bad value is one
line on standard error). The answers come from the gateway's app and engine in this process, over an
in-process swarm of a tiny random llama (4 blocks, char tokenizer): ``[0:2]`` x2 and ``[2:4]`` as a
liar plus 2 honest replicas (one audits, one settles), the client's chain steered through the liar
(:mod:`tests.helpers.byzantine`). The liar adds noise as large as its output from position
:data:`LIE_FROM` on, so the first tokens of each answer are honest and the lie is caught mid-answer,
after it changed tokens (the liar's own record proves it lied). The honest answer is local
transformers on the same weights, its greedy choices at least :data:`MIN_GAP` apart. A stream cannot
take text back, so "the streamed text joined equals the honest text" means no delta ever showed a
token the repair replaced; :func:`test_without_holding_back_a_stream_shows_the_lie` shows that this
liar does make a stream that does not hold back show wrong tokens.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from shoal.cli.chat import ChatOptions, converse
from shoal.cli.gateway import VERIFY_CHOICES, _client_settings
from shoal.cli.main import build_parser
from shoal.client.config import ClientConfig
from shoal.client.verification.audit import VERIFY_MODES
from shoal.errors import UsageError
from shoal.gateway.app import build_app
from shoal.gateway.engine import Engine
from shoal.gateway.swarm import Watchers
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.transport import Ticket
from testkit.faults import Noise, When
from testkit.faulty import make_faulty
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.cli.test_errors import USAGE, assert_one_line_error, shoal
from tests.helpers.byzantine import connect_over, lies, peer_of, steer_through
from tests.helpers.parity import greedy_with_gap

pytestmark = pytest.mark.timeout(90)

K = 8  # --audit-every of these clients: a lie is caught up to 8 positions late, so its tokens differ
NEW_TOKENS = 24
PROMPT_LENGTH = 12
PROMPT_SEED = 100
MODEL_SEED = 0  # test_verify's llama: greedy runs from its prompts keep wide top-2 gaps
LIE_FROM = 18  # the liar's first corrupted position: 6 tokens into the answer
MIN_GAP = 1e-3
LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
MODEL_ID = "tiny-verify"
TICKET = str(Ticket("0f" * 32, ("127.0.0.1:9",), None, "swarm-1"))
#: A chat template the char tokenizer can carry (it has none of its own).
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# ---- the flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["api", "chat"])
@pytest.mark.parametrize("mode", ["off", "audit", "redundant"])
def test_verify_flag_takes_each_mode(command, mode):
    args = build_parser().parse_args([command, "m", "--join", TICKET, "--verify", mode, "--audit-every", "4"])
    assert (args.verify, args.audit_every) == (mode, 4)


@pytest.mark.parametrize("command", ["api", "chat"])
def test_verify_and_audit_every_are_the_clients_defaults_unless_given(command):
    """The flags leave both unset, so ClientConfig's defaults (audit mode, its K) are the only ones."""
    args = build_parser().parse_args([command, "m", "--join", TICKET])
    assert (args.verify, args.audit_every) == (None, None)
    client = _client_settings(args)["client"]
    assert (client.verify, client.audit_every) == (ClientConfig().verify, None) == ("audit", None)


def test_the_verify_choices_are_the_modes_the_client_runs():
    assert VERIFY_CHOICES == VERIFY_MODES


@pytest.mark.parametrize(
    "flags, fragment",
    [(["--verify", "always"], "invalid choice: 'always'"), (["--audit-every", "0"], "invalid positive integer")],
)
def test_bad_verify_flags_are_usage_errors(flags, fragment):
    with pytest.raises(UsageError, match=fragment) as raised:
        build_parser().parse_args(["api", "m", "--join", TICKET, *flags])
    assert "\n" not in str(raised.value)


def test_a_bad_verify_mode_is_one_line_on_stderr():
    outcome = shoal("api", "m", "--join", TICKET, "--verify", "maybe", timeout=30)
    assert_one_line_error(outcome, USAGE, "--verify", "invalid choice: 'maybe'", "redundant")


def test_api_passes_the_mode_to_the_gateway(monkeypatch):
    """``shoal api --verify audit --audit-every 4`` builds the gateway's options with them."""
    import shoal.gateway.serve as serve

    seen = []
    monkeypatch.setattr(serve, "serve_gateway", lambda options: seen.append(options) or 0)
    args = build_parser().parse_args(["api", "m", "--join", TICKET, "--verify", "audit", "--audit-every", "4"])
    assert args.func(args) == 0
    assert (seen[0].client.verify, seen[0].client.audit_every) == ("audit", 4)


@pytest.mark.parametrize("command, module, entry", [("api", "shoal.gateway.serve", "serve_gateway"),
                                                     ("chat", "shoal.cli.chat", "run_chat")])  # fmt: skip
def test_require_verified_reaches_the_client_config(monkeypatch, command, module, entry):
    """``--require-verified`` (shared by ``shoal api`` and ``shoal chat``): fail closed on unchecked blocks."""
    import importlib

    seen = []
    monkeypatch.setattr(importlib.import_module(module), entry, lambda options: seen.append(options) or 0)
    args = build_parser().parse_args([command, "m", "--join", TICKET, "--verify", "audit", "--require-verified"])
    assert args.func(args) == 0
    assert seen[0].client.require_verified is True
    args = build_parser().parse_args([command, "m", "--join", TICKET, "--verify", "audit"])
    assert args.require_verified is False


def test_chat_passes_the_mode_to_the_chat(monkeypatch):
    import shoal.cli.chat as chat

    seen = []
    monkeypatch.setattr(chat, "run_chat", lambda options: seen.append(options) or 0)
    args = build_parser().parse_args(["chat", "m", "--join", TICKET, "--verify", "redundant"])
    assert args.func(args) == 0
    assert (seen[0].client.verify, seen[0].client.audit_every) == ("redundant", None)


# ---- answers over a swarm with a liar -------------------------------------------------------------


@dataclass
class World:
    swarm: InProcessSwarm
    reference: object
    low: list[LocalServer]
    high: list[LocalServer]

    def liar(self, lie_from: int = LIE_FROM) -> LocalServer:
        """A fresh liar of [2:4]: noise of its outputs' norm from ``lie_from`` on."""
        fault = Noise(1.0, seed=5, when=When(from_position=lie_from))
        return self.swarm.add(HIGH, lambda server: make_faulty(server, [fault]))

    def honest(self, prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])  # every position attended, as the gateway does (id 0 is the pad token)
        tokens, gap = greedy_with_gap(
            self.reference, ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS
        )
        assert gap > MIN_GAP, f"the honest run has a near-tie (top-2 gap {gap:.2e}): choose another prompt"
        return tokens[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    model_dir: Path = tiny_checkpoint(
        tmp_path_factory.mktemp("verify-api"), "llama", MODEL_SEED, tokenizer=char_tokenizer()
    )
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with InProcessSwarm(model_dir, []) as swarm:
        yield World(swarm, reference, [swarm.add(LOW), swarm.add(LOW)], [swarm.add(HIGH), swarm.add(HIGH)])


def through(world: World, liar: LocalServer):
    """An audit-mode client (K = :data:`K`) over the liar and the honest servers, steered through the liar."""
    return connect_over(world.swarm, [liar, *world.high, *world.low], verify="audit", audit_every=K)


def steer(world: World, model, liar: LocalServer) -> None:
    route = steer_through(model, [world.low[0], liar])
    assert route == [peer_of(world.low[0]), peer_of(liar)], "the chain does not go through the liar"


def prompt_ids() -> list[int]:
    return torch.randint(3, 256, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(PROMPT_SEED)).tolist()


def sse(lines: Iterator[str]) -> list[dict]:
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-1:]
    return [json.loads(event) for event in events[:-1]]


def scrape(client: TestClient) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_gateway_streams_only_the_honest_text_and_metrics_show_the_ban(world):
    liar = world.liar()
    prompt = prompt_ids()
    honest = world.honest(prompt)
    honest_text = char_tokenizer().decode(honest, skip_special_tokens=True)
    with through(world, liar) as model:
        steer(world, model, liar)
        app = build_app(Engine(model, MODEL_ID), Watchers(world.swarm.transport, None))
        with TestClient(app, base_url="http://localhost") as client:
            body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                chunks = sse(reply.iter_lines())
            told = lies(liar.server.record.entries())
            assert told is not None and told.first == LIE_FROM, liar.server.record.entries()
            deltas = [c["choices"][0]["text"] for c in chunks]
            assert "".join(deltas) == honest_text  # a stream cannot retract: no delta held a replaced token
            assert sum(bool(d) for d in deltas) >= 2, f"the text came in one piece: {deltas}"
            last = chunks[-1]
            assert last["choices"][0]["finish_reason"] == "length"
            state = last["shoal"]["verification"]
            assert (state["mode"], state["audit_every"], state["unverified_blocks"]) == ("audit", K, 0), state
            assert state["bans"] == 1 and state["rollbacks"] >= 1 and state["disagreements"] >= 1, state
            assert state["settled"] >= 1 and state["unsettled"] == 0 and state["audits"] >= 2, state
            assert model.verification.banned == (peer_of(liar),)

            metrics = scrape(client)
            assert metrics[f'shoal_verify_info{{audit_every="{K}",mode="audit"}}'] == 1.0
            assert metrics["shoal_verify_bans_total"] == 1.0
            assert metrics["shoal_verify_disagreements_total"] == state["disagreements"] >= 1
            assert metrics["shoal_verify_rollbacks_total"] == state["rollbacks"]
            assert metrics["shoal_verify_audits_total"] == state["audits"]
            assert metrics["shoal_verify_audited_positions_total"] == state["audited_positions"] > 0
            assert metrics["shoal_verify_settled_total"] == state["settled"]
            assert metrics["shoal_verify_unsettled_total"] == 0.0
            assert metrics["shoal_verify_unverified_blocks"] == 0.0
            assert [key for key in metrics if key.startswith("shoal_verify_banned")] == [
                f'shoal_verify_banned{{peer="{peer_of(liar)}"}}'
            ]
            for name in ("sent", "confirmed", "rejected"):
                assert f"shoal_verify_evidence_{name}_total" in metrics

            # the liar banned, a plain (non-streamed) answer over the honest servers: the final text,
            # this answer's own counts (no new ban, nothing repaired), the chat shape carries them too
            served = len(liar.server.record)
            again = client.post("/v1/completions", json={**body, "stream": False})
            assert again.status_code == 200, again.text
            payload = again.json()
            assert payload["choices"][0]["text"] == honest_text
            state = payload["shoal"]["verification"]
            assert (state["bans"], state["rollbacks"], state["disagreements"]) == (0, 0, 0), state
            assert state["audits"] >= 2 and state["unverified_blocks"] == 0, state
            assert len(liar.server.record) == served, "the banned liar served again"


def test_without_verification_a_response_has_no_shoal_key(world):
    """verify off: the body is OpenAI's alone, and /metrics says mode off with zero counts."""
    prompt = prompt_ids()
    with connect_over(world.swarm, [*world.low, *world.high], verify="off") as model:  # audits are the default
        app = build_app(Engine(model, MODEL_ID), Watchers(world.swarm.transport, None))
        client = TestClient(app, base_url="http://localhost")
        with client:
            body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            payload = client.post("/v1/completions", json=body).json()
            assert "shoal" not in payload and payload["choices"][0]["text"]
            metrics = scrape(client)
    assert metrics['shoal_verify_info{audit_every="",mode="off"}'] == 1.0
    assert metrics["shoal_verify_audits_total"] == metrics["shoal_verify_bans_total"] == 0.0


def test_without_holding_back_a_stream_shows_the_lie(world):
    """The premise of the test above: a plain streamer (no ``hold_back``) on the same kind of liar
    is given tokens of the first attempt that the repaired answer does not have. It hears the first
    attempt, then the repaired one's tokens from the resume point (:data:`LIE_FROM` + 1 ids) on."""
    liar = world.liar()
    prompt = prompt_ids()
    honest = world.honest(prompt)

    class Seen:
        def __init__(self):
            self.tokens: list[int] = []

        def put(self, value):
            self.tokens += value.reshape(-1).tolist()

        def end(self):
            pass

    seen = Seen()
    with through(world, liar) as model:
        steer(world, model, liar)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, streamer=seen)
    assert out[0, PROMPT_LENGTH:].tolist() == honest
    regenerated = PROMPT_LENGTH + NEW_TOKENS - (LIE_FROM + 1)
    first_attempt = seen.tokens[PROMPT_LENGTH : len(seen.tokens) - regenerated]
    assert seen.tokens[len(seen.tokens) - regenerated :] == honest[LIE_FROM + 1 - PROMPT_LENGTH :]
    assert len(first_attempt) > LIE_FROM + 1 - PROMPT_LENGTH, "the lie was caught before it chose a token"
    assert first_attempt != honest[: len(first_attempt)], "the lie changed no token: the gateway test proves nothing"


def test_chat_with_verify_prints_only_the_honest_answer(world, capsys):
    """``shoal chat --verify audit``'s conversation (:func:`converse`) over a liar that lies from the
    answer's 7th token on: standard output is exactly the honest answer."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    messages = [{"role": "user", "content": "Hello,who?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    honest = world.honest(prompt)
    liar = world.liar(lie_from=len(prompt) + 6)
    with through(world, liar) as model:
        model.tokenizer.chat_template = TEMPLATE
        engine = Engine(model, MODEL_ID)
        assert engine.chat_prompt(messages) == prompt
        honest_text = model.tokenizer.decode(honest, skip_special_tokens=True)
        steer(world, model, liar)
        out = io.StringIO()
        options = ChatOptions(model=MODEL_ID, join=(), max_new_tokens=NEW_TOKENS, max_length=128)
        assert converse(engine, options, io.StringIO("Hello,who?\n"), out) == 0
        assert out.getvalue() == f"assistant: {honest_text}\n"
        told = lies(liar.server.record.entries())
        assert told is not None and told.first == len(prompt) + 6, liar.server.record.entries()
        assert model.verification.banned == (peer_of(liar),) and model.verification.rollbacks >= 1
    err = capsys.readouterr().err
    assert "(verify: 1 lying server(s) banned; " in err and "repair(s): the answer was regenerated" in err, err
