"""Training through a swarm of real block servers equals local autograd (issue 20).

Each model (random tiny ``llama`` and ``qwen2`` from :mod:`testkit.tiny`) gets one
:class:`~shoal.launch.InProcessSwarm` on an in-memory network: ``[0:2] [2:4] [0:1] [1:2]`` (a client
given ``[0:2], [2:4]`` routes over 2 servers, one given ``[0:1], [1:2], [2:4]`` over 3), and
``[0:2] [2:4]`` once more with a LoRA adapter made with peft (``init_lora_weights=False``, so its
B matrices are not zero). The reference is the plain ``transformers`` model read from the same
checkpoint, with the prompts placed as :mod:`tests.helpers.prompts` places them, and peft's model
for the adapter.

* gradients of a loss w.r.t. the input embeddings, the ptune prompts and the deep_ptune prompts
  equal local autograd within ``max|diff| <= 1e-4 max|g_local| + 1e-7``, unpadded and left-padded;
* 20 Adam steps on ptune and on deep_ptune prompts give the local losses (each within 1e-4
  relative), and then 32 greedy tokens with the trained prompts equal local generation;
* a server killed between a forward and its backward: the backward is recomputed over a route cut
  differently (``[2:3] [3:4]`` instead of ``[2:4]``), and the gradient still equals local;
* the adapter changes the base model's greedy output, generation through the swarm with it equals
  peft's (32 greedy tokens), a pinned digest routes the same way, and an adapter no server has is
  an error naming it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from shoal.client import AutoDistributedModelForCausalLM
from shoal.client.training.prompts import PromptTuning
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LOOPBACK
from shoal.models.lora import adapter_digest
from shoal.routing import NoRouteError
from shoal.transport import Deadlines
from testkit.tiny import tiny_checkpoint
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.parity import left_padded
from tests.helpers.prompts import assert_grads_close, reference_generate, reference_logits

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_server_errors")]

SEEDS = {"llama": 0, "qwen2": 2}
CHAINS = {
    2: [BlockRange(0, 2), BlockRange(2, 4)],
    3: [BlockRange(0, 1), BlockRange(1, 2), BlockRange(2, 4)],
}
CASES = [pytest.param(name, hops, id=f"{name}-{hops}hops") for name in SEEDS for hops in CHAINS]
N_PROMPTS = 4
ADAPTER = "tiny-lora"
STEPS = 20
LR = 3e-2
#: a dead in-memory peer is found out when its dial times out: keep that short
QUICK_DIAL = dataclasses.replace(LOOPBACK, deadlines=Deadlines(connect=0.3))


@dataclass
class Case:
    name: str
    model_dir: Path
    adapter_dir: Path
    swarm: InProcessSwarm
    reference: Any
    clients: dict[Any, Any] = field(default_factory=dict)

    def client(self, hops: int, mode: str | None = None):
        """A client over the ``hops`` chain (one per chain and tuning mode, kept for the module)."""
        key = (hops, mode)
        if key not in self.clients:
            kwargs = {"tuning_mode": mode, "pre_seq_len": N_PROMPTS} if mode else {}
            model = self.swarm.connect(CHAINS[hops], **kwargs)
            assert [s.blocks for s in model.blocks.chain] == CHAINS[hops]
            self.clients[key] = model
        return self.clients[key]

    def backward_requests(self) -> int:
        return sum(s.server.counters.backward_requests for s in self.swarm.servers if s.alive)


def make_adapter(reference, out_dir: Path, seed: int) -> Path:
    """A peft LoRA adapter on every linear layer of the blocks, B matrices random (non-zero)."""
    torch.manual_seed(seed)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(reference), config)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def case(request, tmp_path_factory):
    """The swarm of one model, kept while that model's tests run (they are grouped by model)."""
    cases: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cases:
            for other in list(cases):  # one swarm alive at a time
                cases.pop(other).swarm.close()
            root = tmp_path_factory.mktemp(f"training-{name}")
            model_dir = tiny_checkpoint(root / "model", name, SEEDS[name])
            reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            adapter_dir = make_adapter(reference, root / "adapter", SEEDS[name] + 50)
            swarm = InProcessSwarm(model_dir, sorted({span for chain in CHAINS.values() for span in chain}))
            for span in CHAINS[2]:
                swarm.add(span, adapters=((ADAPTER, adapter_dir),))
            cases[name] = Case(name, model_dir, adapter_dir, swarm, reference)
        return cases[name]

    yield get
    for c in cases.values():
        c.swarm.close()


def data(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(input_ids, attention_mask, labels): two left-padded rows of 6 and 11 tokens, or two of 9."""
    rng = torch.Generator().manual_seed(7)
    if padded:
        ids, mask = left_padded([torch.randint(3, 256, (n,), generator=rng).tolist() for n in (6, 11)])
        return ids, mask, ids.masked_fill(mask == 0, -100)
    ids = torch.randint(3, 256, (2, 9), generator=rng)
    return ids, None, ids.clone()


def seeded_prompts(mode: str, reference, seed: int) -> PromptTuning:
    """Prompts as a client makes them, with non-zero deep prompts (zeros would make their check weak)."""
    torch.manual_seed(seed)
    config = reference.config
    prompts = PromptTuning(mode, N_PROMPTS, config.hidden_size, config.num_hidden_layers)
    if prompts.intermediate_prompt_embeddings is not None:
        with torch.no_grad():
            prompts.intermediate_prompt_embeddings.weight.normal_(0, 0.5)
    return prompts


def local_loss(reference, ids, mask, labels, prompts: PromptTuning | None, embeds=None) -> torch.Tensor:
    embeds = reference.get_input_embeddings()(ids).detach() if embeds is None else embeds
    logits = reference_logits(reference, embeds, mask, prompts)
    return ForCausalLMLoss(logits, labels, reference.config.vocab_size)


@pytest.mark.parametrize(("name", "hops"), CASES)
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_input_embedding_gradients_equal_local(case, name, hops, padded):
    c = case(name)
    model = c.client(hops)
    ids, mask, labels = data(padded)
    embeds = c.reference.get_input_embeddings()(ids).detach().requires_grad_(True)
    before = c.backward_requests()
    loss = model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    (got,) = torch.autograd.grad(loss, [embeds])
    assert c.backward_requests() - before == hops  # one backward per span of the route, on its servers
    want_loss = local_loss(c.reference, ids, mask, labels, None, embeds)
    (want,) = torch.autograd.grad(want_loss, [embeds])
    assert torch.allclose(loss, want_loss, rtol=1e-5)
    assert_grads_close(got, want, "d loss / d inputs_embeds")


@pytest.mark.parametrize(("name", "hops"), CASES)
@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
def test_prompt_gradients_equal_local(case, name, hops, mode):
    c = case(name)
    model = c.client(hops, mode)
    local = seeded_prompts(mode, c.reference, seed=11)
    model.ptune.load_state_dict(local.state_dict())
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == len(list(local.parameters()))  # the prompts are all that trains
    for padded in (False, True):
        ids, mask, labels = data(padded)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert out.logits.shape[:2] == ids.shape
        got = torch.autograd.grad(out.loss, params)
        want_loss = local_loss(c.reference, ids, mask, labels, local)
        want = torch.autograd.grad(want_loss, list(local.parameters()))
        assert torch.allclose(out.loss, want_loss, rtol=1e-5)
        for (pname, _), g, w in zip(local.named_parameters(), got, want, strict=True):
            assert_grads_close(g, w, f"d loss / d {pname} ({'left-padded' if padded else 'plain'})")


@pytest.mark.parametrize(("name", "hops"), CASES)
@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
def test_training_steps_and_generation_equal_local(case, name, hops, mode):
    c = case(name)
    model = c.client(hops, mode)
    local = PromptTuning(mode, N_PROMPTS, c.reference.config.hidden_size, c.reference.config.num_hidden_layers)
    torch.manual_seed(3)
    local.prompt_embeddings.reset_parameters()  # what a client starts from (deep prompts: zeros)
    model.ptune.load_state_dict(local.state_dict())
    ids, mask, labels = data(padded=True)
    remote_opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
    local_opt = torch.optim.Adam(local.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        remote_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        remote_opt.zero_grad()
        remote_loss.backward()
        remote_opt.step()
        want = local_loss(c.reference, ids, mask, labels, local)
        local_opt.zero_grad()
        want.backward()
        local_opt.step()
        losses.append((remote_loss.item(), want.item()))
    for step, (got, want) in enumerate(losses):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: loss {got} != local {want}"
    assert losses[-1][1] < 0.8 * losses[0][1]  # the prompts did learn something
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        got_tokens = model.generate(prompt, max_new_tokens=32, do_sample=False)[:, prompt.shape[1] :]
    assert torch.equal(got_tokens, reference_generate(c.reference, prompt, local, 32))


@pytest.mark.parametrize("name", list(SEEDS))
def test_backward_recomputed_elsewhere_when_its_server_died(case, name):
    """The forward runs over ``[0:2] [2:4]``; the ``[2:4]`` server dies before the backward, which
    then recomputes blocks 2-3 from the recorded input over ``[2:3] [3:4]`` (cut differently)."""
    c = case(name)
    swarm = c.swarm
    victim = swarm.add(BlockRange(2, 4))
    cut = [swarm.add(BlockRange(2, 3)), swarm.add(BlockRange(3, 4))]
    first = swarm.server(BlockRange(0, 2))
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(c.model_dir), [s.ticket for s in (first, victim, *cut)], transport=QUICK_DIAL,
        start_node=swarm.start_node, tuning_mode="deep_ptune", pre_seq_len=N_PROMPTS,
    )  # fmt: skip
    swarm.clients.append(model)
    local = seeded_prompts("deep_ptune", c.reference, seed=13)
    model.ptune.load_state_dict(local.state_dict())
    directory = model.blocks.directory
    for s in cut:  # the forward must go over the victim: keep the others out of its route
        directory.failed(s.node.ticket().peer_id)
    ids, mask, labels = data(padded=True)
    embeds = c.reference.get_input_embeddings()(ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    assert victim.server.counters.forward_requests == 1 and all(s.server.counters.forward_requests == 0 for s in cut)
    for s in cut:
        directory.succeeded(s.node.ticket().peer_id)
    swarm.kill(victim)
    params = [embeds, *model.ptune.parameters()]
    got = torch.autograd.grad(loss, params)
    assert [s.server.counters.forward_requests for s in cut] == [1, 1]  # the recompute
    assert [s.server.counters.backward_requests for s in cut] == [1, 1]
    assert victim.server.counters.backward_requests == 0
    want_loss = local_loss(c.reference, ids, mask, labels, local, embeds)
    want = torch.autograd.grad(want_loss, [embeds, *local.parameters()])
    assert torch.allclose(loss, want_loss, rtol=1e-5)
    for what, g, w in zip(["inputs_embeds", "prompt_embeddings", "intermediate_prompt_embeddings"], got, want,
                          strict=True):  # fmt: skip
        assert_grads_close(g, w, f"d loss / d {what} after the recompute")
    for s in cut:
        swarm.kill(s)


@pytest.mark.parametrize("name", list(SEEDS))
def test_a_session_replaced_mid_generation_keeps_its_deep_prompts(case, name):
    """A session opened with deep prompts loses its ``[2:4]`` server after 8 tokens: the replacement
    gets the prompts at its open and the history replayed, and the 32 tokens equal local."""
    c = case(name)
    swarm = c.swarm
    victim, replica = swarm.add(BlockRange(2, 4)), swarm.add(BlockRange(2, 4))
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(c.model_dir), [s.ticket for s in (swarm.server(BlockRange(0, 2)), victim, replica)],
        transport=QUICK_DIAL, start_node=swarm.start_node, tuning_mode="deep_ptune", pre_seq_len=N_PROMPTS,
        verify="off",  # the replica's one session must be the replacement's, not also an auditor's
    )  # fmt: skip
    swarm.clients.append(model)
    local = seeded_prompts("deep_ptune", c.reference, seed=17)
    model.ptune.load_state_dict(local.state_dict())
    directory = model.blocks.directory
    directory.failed(replica.ticket.peer_id)  # the session must start on the victim
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(23))
    with torch.no_grad(), model.inference_session(max_length=48) as cache:
        first = model.generate(prompt, max_new_tokens=8, do_sample=False)
        assert [s.peer_id for s in model.blocks.chain][-1] == victim.ticket.peer_id
        directory.succeeded(replica.ticket.peer_id)
        swarm.kill(victim)
        out = model.generate(first, max_new_tokens=24, do_sample=False)
        (record,) = cache.session.recoveries
    assert record.failed == victim.ticket.peer_id and replica.server.counters.sessions_opened == 1
    assert torch.equal(out[:, prompt.shape[1] :], reference_generate(c.reference, prompt, local, 32))
    swarm.kill(replica)


@pytest.mark.parametrize("name", list(SEEDS))
def test_lora_generation_equals_peft(case, name):
    c = case(name)
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(copy.deepcopy(c.reference), str(c.adapter_dir)).eval()
    prompt = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(31))
    greedy = {"max_new_tokens": 32, "do_sample": False}
    with torch.no_grad():
        base = c.reference.generate(prompt, **greedy)
        want = peft_model.generate(input_ids=prompt, **greedy)
    assert not torch.equal(base, want), "the adapter should change the greedy output"
    model = c.swarm.connect(adapter=ADAPTER)  # every server is an initial peer: routing keeps the adapter's
    lora_servers = [s for s in c.swarm.servers if s.alive and s.server.info.adapters]
    assert [s.blocks for s in model.blocks.chain] == CHAINS[2] == [s.blocks for s in lora_servers]
    assert {s.peer_id for s in model.blocks.chain} == {s.ticket.peer_id for s in lora_servers}
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, **greedy), want)
        pinned = c.swarm.connect(adapter=f"{ADAPTER}@{adapter_digest(c.adapter_dir)}")
        assert torch.equal(pinned.generate(prompt, **greedy), want)
        plain = AutoDistributedModelForCausalLM.from_pretrained(
            str(c.model_dir), [s.ticket for s in lora_servers], transport=c.swarm.transport,
            start_node=c.swarm.start_node,
        )  # fmt: skip
        c.swarm.clients.append(plain)
        assert torch.equal(plain.generate(prompt, **greedy), base)  # the same servers, without the adapter


@pytest.mark.parametrize("name", ["llama"])
def test_an_adapter_no_server_has_is_an_error_naming_it(case, name):
    c = case(name)
    with pytest.raises(NoRouteError, match=r"no server has adapter 'missing' for blocks 0-3; they have tiny-lora@"):
        c.swarm.connect(adapter="missing")
    with pytest.raises(NoRouteError, match=r"no server has adapter 'tiny-lora@000000000000' for blocks 0-3"):
        c.swarm.connect(adapter=f"{ADAPTER}@{'0' * 64}")
