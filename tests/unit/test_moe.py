"""The MoE families (``mixtral``, ``qwen3_moe``) load from either expert layout: the Hub's one tensor
per expert and projection (what ``save_pretrained`` and shoal's ``save_sharded`` write) and
transformers' fused 3-D parameters. Either way a span's layers hold exactly the parameters
transformers' own loading gives them, router included."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.checkpoints import load_config, load_tensors, save_sharded, span_tensor_filter, weight_map
from shoal.models import get_family
from testkit.tiny import NUM_EXPERTS, tiny_checkpoint

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

MOE = ("mixtral", "qwen3_moe")
# block 1 is sparse in both tiny configs (qwen3_moe: layers 1 and 3); its expert tensors as the Hub names them
HUB_EXPERT = {
    "mixtral": "model.layers.1.block_sparse_moe.experts.{e}.{p}.weight",
    "qwen3_moe": "model.layers.1.mlp.experts.{e}.{p}.weight",
}
PROJECTIONS = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}  # gate, up, down
ATOL = 1e-4


def build_spans(checkpoint, ranges):
    config = load_config(checkpoint)
    family = get_family(config)
    spans = []
    for start, end in ranges:
        tensors = load_tensors(checkpoint, span_tensor_filter(config, start, end))
        spans.append(family.build_span(config, start, end, tensors, torch.float32, "cpu"))
    return spans


def block_parameters(span) -> dict[str, torch.Tensor]:
    """The span's parameters named as in transformers' model: ``model.layers.{global index}.*``."""
    out = {}
    for name, tensor in span.layers.state_dict().items():
        local, rest = name.split(".", 1)
        out[f"model.layers.{span.start + int(local)}.{rest}"] = tensor
    return out


@pytest.fixture(scope="module", params=MOE)
def hub_checkpoint(request, tmp_path_factory):
    family = request.param
    return family, tiny_checkpoint(tmp_path_factory.mktemp(family), family, seed=0)


def stored_names(checkpoint) -> set[str]:
    return set(weight_map(checkpoint))


def test_save_sharded_writes_the_hub_layout(hub_checkpoint):
    family, checkpoint = hub_checkpoint
    names = stored_names(checkpoint)
    expected = {HUB_EXPERT[family].format(e=e, p=p) for e in range(NUM_EXPERTS) for p in PROJECTIONS[family]}
    assert expected <= names
    assert not [n for n in names if "gate_up_proj" in n or n.endswith("experts.down_proj")]


def test_spans_hold_transformers_own_parameters(hub_checkpoint):
    """Fused experts and router of every block equal (bitwise) what ``from_pretrained`` loads."""
    _, checkpoint = hub_checkpoint
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    expected = {k: v for k, v in reference.state_dict().items() if k.startswith("model.layers.")}
    got = {}
    for span in build_spans(checkpoint, [(0, 1), (1, 3), (3, 4)]):
        got.update(block_parameters(span))
    assert sorted(got) == sorted(expected)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in got) and any(k.endswith("mlp.gate.weight") for k in got)
    unequal = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not unequal, unequal


def test_fused_checkpoint_loads_the_same(hub_checkpoint, tmp_path):
    """A checkpoint holding transformers' fused parameters as they are gives the same spans."""
    _, checkpoint = hub_checkpoint
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    fused = save_sharded(model.state_dict(), model.config, tmp_path / "fused")  # a state dict: written as given
    assert "model.layers.1.mlp.experts.gate_up_proj" in stored_names(fused)
    for hub_span, fused_span in zip(build_spans(checkpoint, [(0, 4)]), build_spans(fused, [(0, 4)]), strict=True):
        hub, same = block_parameters(hub_span), block_parameters(fused_span)
        assert sorted(hub) == sorted(same) and all(torch.equal(hub[k], same[k]) for k in hub)


def test_missing_expert_is_named(hub_checkpoint):
    family, checkpoint = hub_checkpoint
    config = load_config(checkpoint)
    tensors = load_tensors(checkpoint, span_tensor_filter(config, 1, 2))
    down = PROJECTIONS[family][2]
    del tensors[HUB_EXPERT[family].format(e=2, p=down)]
    with pytest.raises(ValueError, match=rf"{down} tensors for experts \[0, 1, 3\], expected all of 0..3"):
        get_family(config).build_span(config, 1, 2, tensors, torch.float32, "cpu")


def test_qwen3_moe_mlp_only_layers(tmp_path):
    """``mlp_only_layers`` makes layer 2 of the otherwise all-sparse 0..3 dense; spans follow."""
    checkpoint = tiny_checkpoint(tmp_path, "qwen3_moe", seed=0, decoder_sparse_step=1, mlp_only_layers=[2])
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    spans = build_spans(checkpoint, [(0, 2), (2, 4)])
    kinds = [type(layer.mlp).__name__ for span in spans for layer in span.layers]
    assert kinds == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
    ids = torch.randint(3, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = reference.model.embed_tokens(ids)
        for span in spans:
            hidden = span(hidden, torch.arange(30).expand(2, -1), None)
        logits = reference.lm_head(reference.model.norm(hidden))
        assert (logits - reference(ids).logits).abs().max().item() <= ATOL
