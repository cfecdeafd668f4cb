"""Compressed activations through real servers in this process (:class:`shoal.launch.InProcessSwarm`):
with each codec, greedy tokens equal the raw swarm's and logits stay within the codec's tolerance;
every hop carries the codec its server announced (a push only between servers using the same one);
a replacement server is replayed exactly what the failed one computed on; values a codec cannot
carry are refused at the side that would send them. And the wire criterion of issue 18, on the
270M llama's hidden size, counted by the transport's byte counters (:attr:`BaseNode.received`).

The tiny llama of :mod:`testkit.tiny` (4 blocks, hidden 64) with a small init (0.05 instead of 0.3):
the large init that keeps greedy choices far from fp32 noise also amplifies every rounding of a
hidden state through the blocks (q8 moved its outputs by 15%, its greedy tokens after 2).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import torch
from torch import Tensor

from shoal.errors import BadRequest, UsageError, WireError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.server.handler import BlockServer
from shoal.transport import BaseNode, MessageStream
from shoal.wire import CAPABILITIES, Codec, Message
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.inprocess import blocks_output, no_server_errors  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]

A, B = BlockRange(0, 2), BlockRange(2, 4)
LOSSY = [Codec.BF16, Codec.FP16, Codec.Q8]
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 3]])
NEW_TOKENS = 16
#: Largest logit difference from the raw swarm, relative to the largest |logit|, per codec (measured
#: on tiny llamas of init 0.02-0.05, 5 seeds: bf16 <= 4e-3, fp16 <= 5e-4, q8 <= 1.2e-2).
LOGIT_TOLERANCE = {Codec.BF16: 1e-2, Codec.FP16: 2e-3, Codec.Q8: 3e-2}
#: The same for the blocks' output (hidden states; measured: bf16 <= 6e-3, fp16 <= 7e-4, q8 <= 1.1e-2).
HIDDEN_TOLERANCE = {Codec.RAW: 1e-4, Codec.BF16: 1.5e-2, Codec.FP16: 2e-3, Codec.Q8: 3e-2}
#: Greedy steps that the raw run's top-2 gaps guarantee (see test_greedy_tokens...), on this model.
PROVABLE_STEPS = {Codec.BF16: NEW_TOKENS, Codec.FP16: NEW_TOKENS, Codec.Q8: 6}


@pytest.fixture(scope="module")
def reference():
    return tiny_model("llama", seed=7, initializer_range=0.05)


@pytest.fixture(scope="module")
def model_dir(reference, tmp_path_factory):
    return save_checkpoint(reference, tmp_path_factory.mktemp("tiny-compression"))


class _Tap:
    """A stream the server reads through, keeping every message it receives."""

    def __init__(self, inner: MessageStream, received: list[Message]):
        self._inner, self._received = inner, received

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def recv(self, timeout: float | None = None) -> Message:
        message = await self._inner.recv(timeout)
        self._received.append(message)
        return message


@dataclass
class Recording:
    """Turns a loaded server into one that announces ``capabilities`` (default: all) and keeps
    every message it receives (steps from the client, pushes from the previous server)."""

    capabilities: frozenset[str] = CAPABILITIES
    received: list[Message] = field(default_factory=list)

    def __call__(self, server: BlockServer) -> BlockServer:
        server.info = msgspec.structs.replace(server.info, capabilities=self.capabilities)
        handle = server.handle

        async def recording_handle(stream: MessageStream, peer_id: str) -> None:
            await handle(_Tap(stream, self.received), peer_id)

        server.handle = recording_handle
        return server

    def steps(self) -> list[Message]:
        """Steps and pushes, in the order they arrived."""
        return [m for m in self.received if m.kind in ("step", "push")]


@pytest.fixture
def swarms(model_dir) -> Iterator:
    made: list[InProcessSwarm] = []

    def make(*spans: tuple[BlockRange, Recording]) -> InProcessSwarm:
        swarm = InProcessSwarm(model_dir, [])
        made.append(swarm)
        for span, recording in spans:
            swarm.add(span, recording)
        return swarm

    yield make
    for swarm in made:
        swarm.close()


@pytest.fixture(scope="module")
def two_servers(model_dir) -> Iterator[InProcessSwarm]:
    with InProcessSwarm(model_dir, [A, B]) as swarm:
        yield swarm


def generate(model, prompt: Tensor = PROMPT, **kwargs: Any) -> Tensor:
    return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


# ---- what the codecs do to the model's output ---------------------------------------------------


def relative_error(got: Tensor, expected: Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("codec", LOSSY, ids=str)
def test_greedy_tokens_with_each_codec_equal_the_raw_swarm(two_servers, reference, codec):
    """Where a greedy choice of the raw run leads by more than twice what the codec moves that
    step's logits (measured by a forward over the raw run's tokens), the codec's run must choose the
    same; so its tokens equal the raw run's at least up to the first step where that fails
    (``provable``). On this model that is all 16 tokens for bf16 and fp16, 6 for q8 (which matched
    all 16 when measured, as long gaps allow, but need not)."""
    raw = two_servers.connect(refresh_period=0)
    run = raw.generate(
        PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    expected, logits = run.sequences, torch.stack(run.logits)[:, 0]  # [steps, vocab]
    assert torch.equal(expected, reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False))
    top2 = logits.topk(2, dim=-1).values
    compressed = two_servers.connect(compression=codec.value, refresh_period=0)
    moved = (compressed(expected[:, :-1]).logits[0, PROMPT.shape[1] - 1 :] - logits).abs().amax(dim=-1)
    provable = int((top2[:, 0] - top2[:, 1] > 2 * moved + 1e-4).long().cumprod(0).sum())
    assert provable >= PROVABLE_STEPS[codec]
    end = PROMPT.shape[1] + provable
    assert torch.equal(generate(compressed)[:, :end], expected[:, :end])


@pytest.mark.parametrize("codec", LOSSY, ids=str)
def test_logits_stay_within_the_codec_tolerance(two_servers, codec):
    """A stateless forward (no session): the forward path compresses too."""
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    raw = two_servers.connect(refresh_period=0)(ids).logits
    got = two_servers.connect(compression=codec, refresh_period=0)(ids).logits
    assert 0 < relative_error(got, raw) <= LOGIT_TOLERANCE[codec], relative_error(got, raw)


def test_an_unknown_compression_is_refused_before_anything_loads():
    with pytest.raises(UsageError, match=r"compression must be None or one of 'raw', 'bf16', 'fp16', 'q8', not 'q4'"):
        from shoal.client import AutoDistributedModelForCausalLM

        AutoDistributedModelForCausalLM.from_pretrained("nowhere", initial_peers=[], compression="q4")


# ---- who sends which codec ----------------------------------------------------------------------


def session_steps(swarm: InProcessSwarm, codec: Codec, x: Tensor, prefill: int = 4):
    model = swarm.connect(compression=codec, refresh_period=0, routing_seed=0)
    session = model.blocks.open_session(batch_size=1, max_length=32)
    outputs = [session.step(x[:, :prefill], torch.arange(prefill).view(1, -1), None)]
    for t in range(prefill, x.shape[1]):
        outputs.append(session.step(x[:, t : t + 1], torch.tensor([[t]]), None))
    session.close()
    return torch.cat(outputs, dim=1)


def hidden(tokens: int, seed: int = 3) -> Tensor:
    return torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(seed))


def codecs_received(recording: Recording) -> list[tuple[str, Codec]]:
    return [(m.kind, m.codec_of(0)) for m in recording.steps()]


def test_every_hop_is_pushed_in_the_one_codec_all_announced(swarms, reference):
    a, b, c = Recording(), Recording(), Recording()
    swarm = swarms((BlockRange(0, 1), a), (BlockRange(1, 2), b), (BlockRange(2, 4), c))
    x = hidden(7)
    got = session_steps(swarm, Codec.Q8, x)
    assert codecs_received(a) == [("step", Codec.Q8)] * 4
    assert codecs_received(b) == codecs_received(c) == [("push", Codec.Q8)] * 4
    assert relative_error(got, blocks_output(reference, x)) <= HIDDEN_TOLERANCE[Codec.Q8]


def test_a_server_without_the_codec_gets_raw_and_no_push_crosses_the_change(swarms):
    """b announced push but not q8: a (q8) may not push to b (raw), nor b to c (q8); the client
    sends b raw float32 and drives every hop itself."""
    a, b, c = Recording(), Recording(CAPABILITIES - {Codec.Q8.capability}), Recording()
    swarm = swarms((BlockRange(0, 1), a), (BlockRange(1, 2), b), (BlockRange(2, 4), c))
    session_steps(swarm, Codec.Q8, hidden(7))
    assert codecs_received(a) == codecs_received(c) == [("step", Codec.Q8)] * 4
    assert codecs_received(b) == [("step", Codec.RAW)] * 4
    assert all(step.meta.push == () for r in (a, b, c) for step in r.steps())
    assert all(s.server.counters.pushes_sent == 0 for s in swarm.servers)


def test_a_server_answers_in_the_codec_it_was_sent(swarms):
    a, b = Recording(), Recording()
    swarm = swarms((A, a), (B, b))
    model = swarm.connect(compression=Codec.BF16, refresh_period=0, push=False)
    session = model.blocks.open_session(batch_size=1, max_length=8)
    x = hidden(3)
    out = session.step(x, torch.arange(3).view(1, -1), None)
    session.close()
    # the client drove hop 2 itself with hop 1's reply: it came in bf16, so it needs no rounding again
    (sent_to_b,) = b.steps()
    assert sent_to_b.codec_of(0) is Codec.BF16
    assert torch.equal(sent_to_b.tensors[0], sent_to_b.tensors[0].bfloat16().float())
    assert torch.equal(out, out.bfloat16().float())


# ---- failover ------------------------------------------------------------------------------------


def on_route(swarm: InProcessSwarm, model, blocks: BlockRange) -> LocalServer:
    peer = next(span.peer_id for span in model.blocks.chain if span.blocks == blocks)
    return next(s for s in swarm.servers if s.node.id == peer)


@pytest.mark.parametrize("victim", ["A", "B"])
@pytest.mark.parametrize("codec", [Codec.Q8, Codec.BF16], ids=str)
def test_a_replacement_is_replayed_exactly_what_the_failed_server_computed_on(swarms, reference, codec, victim):
    """Killed before position 8: the spare gets one raw step over positions 0..7 whose hidden states
    are, bit for bit, those the dead server decoded from the client's steps or the pushes."""
    span = A if victim == "A" else B
    recordings = {name: Recording() for name in ("A0", "A1", "B0", "B1")}
    swarm = swarms(*((A if name[0] == "A" else B, r) for name, r in recordings.items()))
    # verify="off": the spare's steps below are the replay's alone; as an auditor it would get audit steps too
    model = swarm.connect(compression=codec, refresh_period=0, routing_seed=0, verify="off")
    session = model.blocks.open_session(batch_size=1, max_length=32)
    x = hidden(12)
    outputs = [session.step(x[:, :5], torch.arange(5).view(1, -1), None)]
    dead = on_route(swarm, model, span)
    for t in range(5, 12):
        if t == 8:
            swarm.kill(dead)
        outputs.append(session.step(x[:, t : t + 1], torch.tensor([[t]]), None))
    spare = on_route(swarm, model, span)
    assert spare is not dead and len(session.recoveries) == 1
    by_server = {local.node.id: r for local, r in zip(swarm.servers, recordings.values(), strict=True)}
    computed_on = torch.cat([m.tensors[0] for m in by_server[dead.node.id].steps()], dim=1)
    replay, *after = by_server[spare.node.id].steps()
    assert (replay.kind, replay.meta.position, replay.codecs) == ("step", 0, ())  # raw
    assert replay.tensors[0].shape[1] == 8 and torch.equal(replay.tensors[0], computed_on)
    assert [m.codec_of(0) for m in after] == [codec] * 4
    assert relative_error(torch.cat(outputs, dim=1), blocks_output(reference, x)) <= HIDDEN_TOLERANCE[codec]
    session.close()


# ---- what a codec cannot carry --------------------------------------------------------------------


def test_the_client_refuses_to_send_nan_in_q8_and_the_session_goes_on(two_servers):
    model = two_servers.connect(compression="q8", refresh_period=0)
    session = model.blocks.open_session(batch_size=1, max_length=8)
    x = hidden(2)
    x[0, 1, 5] = float("nan")
    with pytest.raises(WireError, match="q8 cannot carry NaN or infinity"):
        session.step(x, torch.arange(2).view(1, -1), None)
    assert session.position == 0
    session.step(hidden(2), torch.arange(2).view(1, -1), None)
    assert session.position == 2
    session.close()


class _NanOutput:
    """A backend whose outputs are NaN (what a broken model would make)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def run(self, *args: Any, **kwargs: Any) -> Tensor:
        return (await self._inner.run(*args, **kwargs)) * float("nan")


def test_a_server_refuses_to_answer_nan_in_q8(swarms):
    def nan_output(server: BlockServer) -> BlockServer:
        server.backend = _NanOutput(server.backend)
        return server

    swarm = swarms((A, nan_output), (B, Recording()))
    model = swarm.connect(compression="q8", refresh_period=0)
    session = model.blocks.open_session(batch_size=1, max_length=8)
    with pytest.raises(BadRequest, match="cannot travel in codec q8: bad_tensor: q8 cannot carry NaN"):
        session.step(hidden(2), torch.arange(2).view(1, -1), None)
    session.close()


# ---- bytes on the wire: the 270M llama ------------------------------------------------------------


def llama270m_wire_shape(tmp_path) -> InProcessSwarm:
    """The 270M llama of ``bench.models`` (hidden 1024, 16 heads, MLP 2816), 2 of its blocks on 2
    servers and a 256-token vocabulary: what crosses a hop depends on the hidden size alone."""
    from transformers import LlamaForCausalLM

    from bench.models import llama270m_config

    config = llama270m_config()
    config.num_hidden_layers, config.vocab_size = 2, 256
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return InProcessSwarm(save_checkpoint(model, tmp_path / "llama270m-2"), [BlockRange(0, 1), BlockRange(1, 2)])


def received(nodes: dict[str, BaseNode]) -> dict[str, tuple[int, int]]:
    return {name: (node.received.total, node.received.data) for name, node in nodes.items()}


def traffic(swarm: InProcessSwarm, codec: Codec, prefill: int = 128, decode_steps: int = 4) -> dict[str, Any]:
    """Frame bytes received by every node during one ``prefill``-token step, and tensor bytes per
    hop of each decode step after it (one message per hop per step)."""
    model = swarm.connect(compression=codec, refresh_period=0, routing_seed=0)
    nodes = {"client": model.blocks.node, "s0": swarm.servers[0].node, "s1": swarm.servers[1].node}
    session = model.blocks.open_session(batch_size=1, max_length=prefill + decode_steps)
    x = torch.randn(1, prefill + decode_steps, 1024, generator=torch.Generator().manual_seed(1))
    pushes, before = swarm.servers[0].server.counters.pushes_sent, received(nodes)
    session.step(x[:, :prefill], torch.arange(prefill).view(1, -1), None)
    after_prefill = received(nodes)
    for t in range(prefill, prefill + decode_steps):
        session.step(x[:, t : t + 1], torch.tensor([[t]]), None)
    after = received(nodes)
    session.close()
    assert swarm.servers[0].server.counters.pushes_sent - pushes == 1 + decode_steps  # s0 pushed every step
    per_step = {name: (after[name][1] - after_prefill[name][1]) / decode_steps for name in nodes}
    return {
        "prefill_total": sum(after_prefill[name][0] - before[name][0] for name in nodes),
        "step_to_s0": per_step["s0"],  # the client's step: hidden states and positions
        "push_to_s1": per_step["s1"],  # s0's push: its output and the positions
        "reply": per_step["client"] / 2,  # each server's reply: its output
    }


@pytest.mark.timeout(120)
def test_bytes_per_hop_drop_as_issue_18_asks_on_the_270m_llama(tmp_path):
    with llama270m_wire_shape(tmp_path) as swarm:
        measured = {codec: traffic(swarm, codec) for codec in (Codec.RAW, Codec.BF16, Codec.Q8)}
    raw = measured[Codec.RAW]
    assert raw["step_to_s0"] == raw["push_to_s1"] == 1024 * 4 + 8 and raw["reply"] == 1024 * 4
    floors = {Codec.BF16: (1.95, 1.9), Codec.Q8: (3.5, 3.3)}  # per decode hop, whole prefill step
    for codec, (per_hop, prefill) in floors.items():
        got = measured[codec]
        for hop in ("step_to_s0", "push_to_s1", "reply"):
            assert raw[hop] / got[hop] >= per_hop, (codec, hop, raw[hop] / got[hop])
        ratio = raw["prefill_total"] / got["prefill_total"]
        assert ratio >= prefill, (codec, ratio)
    assert measured[Codec.Q8]["reply"] == 1024 + 4 * 1024 // 64
