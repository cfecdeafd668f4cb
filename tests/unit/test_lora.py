"""LoRA adapters on spans (shoal.models.lora) must compute what peft computes on the whole model: the
same hidden states with the adapter active, the base ones without it, the gradient of the span's input
as peft's autograd gives it; the digest must not depend on the blocks a server holds; every option shoal
cannot serve must be refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from shoal.errors import BadRequest, UsageError
from shoal.models import get_family
from shoal.models.lora import LoraLinear, SpanAdapters, UnknownAdapter, adapter_digest, read_adapter
from shoal.wire.schema import AdapterInfo
from testkit.tiny import tiny_model

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

USUAL_INIT = 0.02  # hidden states of a few units (the tiny default's large init grows them to ~100)
FAMILIES = ("llama", "qwen2")
SPLITS = {"whole": [(0, 4)], "split": [(0, 2), (2, 4)]}
ATOL = 1e-5
# alpha: per-module rank and alpha, block 2 left out (it runs as base); beta: rsLoRA on other modules
ADAPTERS = {
    "alpha": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"v_proj": 16},
        layers_to_transform=[0, 1, 3],
    ),
    "beta": dict(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"], use_rslora=True),
}


def make_peft(family: str, adapter: str, dtype: torch.dtype = torch.float32):
    """A tiny model (seed 0) with a random non-zero peft LoRA adapter, in eval mode."""
    model = tiny_model(family, 0, dtype=dtype, initializer_range=USUAL_INIT)
    torch.manual_seed(1 + sorted(ADAPTERS).index(adapter))
    config = peft.LoraConfig(init_lora_weights=False, **ADAPTERS[adapter])  # B random, not zeros
    return peft.get_peft_model(model, config).eval()


class Setup:
    def __init__(self, family: str, root):
        self.family_name = family
        self.base = tiny_model(family, 0, initializer_range=USUAL_INIT)
        self.config = self.base.config
        self.family = get_family(self.config)
        self.state = {k: v.clone() for k, v in self.base.state_dict().items()}
        self.peft, self.paths = {}, {}
        for name in ADAPTERS:
            self.peft[name] = make_peft(family, name)
            self.paths[name] = root / name
            self.peft[name].save_pretrained(str(self.paths[name]))
        torch.manual_seed(7)
        self.ids = torch.randint(2, self.config.vocab_size, (2, 9))
        self.positions = torch.arange(9).expand(2, 9)

    def span(self, start: int, end: int, dtype=torch.float32):
        return self.family.build_span(self.config, start, end, self.state, dtype, "cpu")

    def adapted(self, ranges, names=tuple(ADAPTERS)):
        """(span, its SpanAdapters) per range, with ``names`` added."""
        out = []
        for start, end in ranges:
            span = self.span(start, end)
            adapters = SpanAdapters(span)
            for name in names:
                adapters.add(name, read_adapter(self.paths[name], self.config, start, end))
            out.append((span, adapters))
        return out

    def embed(self) -> torch.Tensor:
        return self.base.model.embed_tokens(self.ids).detach()


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory) -> Setup:
    return Setup(request.param, tmp_path_factory.mktemp(request.param))


def run(chain, hidden, positions, name):
    """Each span's output, every span running adapter ``name``."""
    outs = []
    for span, adapters in chain:
        with adapters.active(name):
            hidden = span(hidden, positions, None)
        outs.append(hidden)
    return outs


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_spans_with_adapter_match_peft(setup, name, split):
    ranges = SPLITS[split]
    chain = setup.adapted(ranges)
    with torch.no_grad():
        outs = run(chain, setup.embed(), setup.positions, name)
        ref = setup.peft[name](setup.ids, output_hidden_states=True).hidden_states
        base = setup.base(setup.ids, output_hidden_states=True).hidden_states
    norm = setup.base.model.norm
    got = [*outs[:-1], norm(outs[-1])]
    want = [ref[end] for _, end in ranges[:-1]] + [ref[-1]]
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= ATOL
    assert (got[-1] - base[-1]).abs().max().item() > 0.05  # the adapter really changes the blocks' output


def test_no_adapter_is_the_base_span_bitwise(setup):
    chain = setup.adapted(SPLITS["split"])
    plain = [setup.span(s, e) for s, e in SPLITS["split"]]
    with torch.no_grad():
        want = run([(span, SpanAdapters(span)) for span in plain], setup.embed(), setup.positions, None)
        for selected in (None, "alpha"):
            got = run(chain, setup.embed(), setup.positions, selected)
            if selected is None:
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        # outside any active(): the base, also after an active() that ended in an exception
        with pytest.raises(RuntimeError), chain[0][1].active("alpha"):
            raise RuntimeError("boom")
        got = [span(h, setup.positions, None) for (span, _), h in zip(chain, [setup.embed(), want[0]], strict=True)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_active_nests_and_restores(setup):
    ((span, adapters),) = setup.adapted([(0, 4)])
    q_proj = span.layers[0].self_attn.q_proj
    assert isinstance(q_proj, LoraLinear)
    with adapters.active("alpha"):
        assert q_proj._selection.name == "alpha"
        with adapters.active(None):
            assert q_proj._selection.name is None
        assert q_proj._selection.name == "alpha"
    assert q_proj._selection.name is None


def test_wrapped_layers_keep_the_base_parameters_frozen(setup):
    span = setup.span(0, 4)
    before = dict(span.named_parameters())
    adapters = SpanAdapters(span)
    adapters.add("alpha", read_adapter(setup.paths["alpha"], setup.config, 0, 4))
    after = dict(span.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # names and tensors
    lora = span.layers[0].self_attn.q_proj.adapters["alpha"]
    assert all(not t.requires_grad and t.dtype == torch.float32 for t in lora[:2]) and lora[2] == 2.0
    assert type(span.layers[2].self_attn.q_proj) is nn.Linear  # alpha leaves block 2 out: not wrapped
    assert span.layers[0].self_attn.v_proj.adapters["alpha"][2] == 4.0  # alpha_pattern: 16 / 4
    assert span.layers[0].mlp.down_proj.adapters["alpha"][2] == 4.0  # rank_pattern: 8 / 2
    assert type(span.layers[0].self_attn.k_proj) is nn.Linear  # no adapter targets it yet: not wrapped
    adapters.add("beta", read_adapter(setup.paths["beta"], setup.config, 0, 4))
    assert span.layers[0].self_attn.k_proj.adapters["beta"][2] == pytest.approx(8 / 2)  # rsLoRA: 8 / sqrt(4)
    assert adapters.nbytes() == 4 * sum(a.numel() + b.numel() for a, b in _all_pairs(setup, 0, 4))


def _all_pairs(setup, start, end):
    for name in ADAPTERS:
        yield from read_adapter(setup.paths[name], setup.config, start, end).tensors.values()


def test_digest_is_of_the_whole_adapter(setup, tmp_path):
    first = read_adapter(setup.paths["alpha"], setup.config, 0, 1)
    rest = read_adapter(setup.paths["alpha"], setup.config, 1, 4)
    assert first.tensors.keys() == {(0, "self_attn.q_proj"), (0, "self_attn.v_proj"), (0, "mlp.down_proj")}
    assert {k[0] for k in rest.tensors} == {0, 2}  # global blocks 1 and 3 (block 2 has none)
    digest = adapter_digest(setup.paths["alpha"])
    assert first.digest == rest.digest == digest and len(digest) == 64
    assert adapter_digest(setup.paths["beta"]) != digest
    # the same tensors stored in another order with other metadata: other file bytes, the same digest
    tensors = load_file(setup.paths["alpha"] / "adapter_model.safetensors")
    shutil.copytree(setup.paths["alpha"], tmp_path / "copy")
    copy = tmp_path / "copy" / "adapter_model.safetensors"
    save_file(dict(reversed(list(tensors.items()))), copy, metadata={"note": "reordered"})
    assert copy.read_bytes() != (setup.paths["alpha"] / "adapter_model.safetensors").read_bytes()
    assert adapter_digest(copy.parent) == digest
    changed = dict(tensors)
    key = next(iter(changed))
    changed[key] = changed[key].clone()
    changed[key].view(-1)[0] += 1e-3
    save_file(changed, copy)
    assert adapter_digest(copy.parent) != digest
    span = setup.span(0, 1)
    adapters = SpanAdapters(span)
    adapters.add("b", read_adapter(setup.paths["beta"], setup.config, 0, 1))
    adapters.add("a", first)
    assert adapters.infos() == (AdapterInfo("a", digest), AdapterInfo("b", adapter_digest(setup.paths["beta"])))
    assert adapters.names() == ("a", "b")


def test_unknown_adapter_names_it_and_the_known_ones(setup):
    ((_, adapters),) = setup.adapted([(0, 2)])
    with pytest.raises(UnknownAdapter, match=r"'gamma'.*alpha, beta") as raised, adapters.active("gamma"):
        pass
    assert isinstance(raised.value, BadRequest) and raised.value.code == "bad_request"
    with pytest.raises(UnknownAdapter, match=r"'alpha'.*none"), SpanAdapters(setup.span(0, 2)).active("alpha"):
        pass


def test_gradient_of_the_span_input_matches_peft(setup):
    chain = setup.adapted(SPLITS["split"])
    torch.manual_seed(3)
    weights = torch.randn(2, 9, setup.config.hidden_size)
    for name in ADAPTERS:
        x = setup.embed().requires_grad_(True)
        hidden = run(chain, x, setup.positions, name)[-1]
        (grad,) = torch.autograd.grad((setup.base.model.norm(hidden) * weights).sum(), x)
        x_ref = setup.embed().requires_grad_(True)
        final = setup.peft[name](inputs_embeds=x_ref, output_hidden_states=True).hidden_states[-1]
        (grad_ref,) = torch.autograd.grad((final * weights).sum(), x_ref)
        assert (grad - grad_ref).abs().max().item() <= 1e-4 * grad_ref.abs().max().item() + 1e-7
        assert grad.abs().max().item() > 0
    assert all(not t.requires_grad for span, _ in chain for t in span.parameters())


def test_adapters_added_under_inference_mode_still_differentiate(setup):
    """A server may load under inference mode; its backward must still save the adapters' tensors."""
    span = setup.span(0, 4)
    adapters = SpanAdapters(span)
    with torch.inference_mode():
        adapters.add("alpha", read_adapter(setup.paths["alpha"], setup.config, 0, 4))
    x = setup.embed().requires_grad_(True)
    with adapters.active("alpha"):
        (grad,) = torch.autograd.grad(span(x, setup.positions, None).sum(), x)
    assert grad.abs().max().item() > 0


def test_half_precision_span_matches_peft_bitwise(setup, tmp_path):
    """peft keeps LoRA weights in fp32 on a bf16 model (autocast_adapter_dtype) and so does a span."""
    model = make_peft(setup.family_name, "alpha", torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    base = tiny_model(setup.family_name, 0, dtype=torch.bfloat16, initializer_range=USUAL_INIT)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    span = setup.family.build_span(setup.config, 0, 4, state, torch.bfloat16, "cpu")
    adapters = SpanAdapters(span)
    adapters.add("alpha", read_adapter(tmp_path, setup.config, 0, 4))
    assert span.layers[0].self_attn.q_proj.adapters["alpha"][0].dtype == torch.float32
    with torch.no_grad(), adapters.active("alpha"):
        out = span(model.get_input_embeddings()(setup.ids), setup.positions, None)
        ref = model(setup.ids, output_hidden_states=True).hidden_states
    assert torch.equal(model.base_model.model.model.norm(out), ref[-1])


# --- refusals, on one family ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Setup:
    return Setup("llama", tmp_path_factory.mktemp("llama_refusals"))


def edited(setup: Setup, tmp_path, options=None, tensors=None):
    """A copy of adapter alpha with ``options`` set in its config and its tensors passed through ``tensors``."""
    path = tmp_path / "edited"
    shutil.copytree(setup.paths["alpha"], path)
    if options:
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, **options}))
    if tensors:
        file = path / "adapter_model.safetensors"
        save_file(tensors(load_file(file)), file)
    return path


@pytest.mark.parametrize(
    "options, named",
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "LOHA"}, "peft_type 'LOHA'"),
        ({"lora_bias": True}, "lora_bias"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
        ({"r": 8}, "r=8"),
    ],
)
def test_unsupported_options_are_refused_by_name(llama, tmp_path, options, named):
    with pytest.raises(UsageError, match=named.replace("[", r"\[")):
        read_adapter(edited(llama, tmp_path, options), llama.config, 0, 4)


def _renamed(old: str, new: str):
    return lambda tensors: {k.replace(old, new): v for k, v in tensors.items()}


def _with(name: str, tensor: torch.Tensor):
    return lambda tensors: {**tensors, name: tensor}


@pytest.mark.parametrize(
    "tensors, named",
    [
        (_with("base_model.model.model.embed_tokens.lora_embedding_A", torch.ones(4, 256)), "outside the transformer"),
        (_with("base_model.model.lm_head.lora_A.weight", torch.ones(4, 64)), "outside the transformer blocks"),
        (_with("base_model.model.model.layers.0.self_attn.q_proj.lora_embedding_A", torch.ones(4, 64)), "embedding"),
        (_renamed("layers.3.", "layers.9."), "block 9; the model has blocks 0 to 3"),
        (_with("base_model.model.model.layers.0.self_attn.q_proj.bias", torch.ones(64)), "not a lora_A/lora_B"),
        (_with("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", torch.ones(4, 64)), "two"),
        (lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.q_proj.lora_B" not in k}, "without its pair"),
    ],
)
def test_tensors_outside_the_blocks_are_refused(llama, tmp_path, tensors, named):
    with pytest.raises(UsageError, match=named):
        read_adapter(edited(llama, tmp_path, tensors=tensors), llama.config, 0, 4)


def test_peft_default_adapter_names_are_read(llama, tmp_path):
    path = edited(llama, tmp_path, tensors=_renamed(".weight", ".default.weight"))
    assert (
        read_adapter(path, llama.config, 0, 4).tensors.keys()
        == read_adapter(llama.paths["alpha"], llama.config, 0, 4).tensors.keys()
    )


@pytest.mark.parametrize(
    "tensors, named",
    [
        (_renamed("self_attn.q_proj", "input_layernorm"), "input_layernorm' of block 0 is LlamaRMSNorm, not nn.Linear"),
        (_renamed("self_attn.q_proj", "self_attn.nope"), "has no module 'self_attn.nope'"),
        (
            lambda t: {**t, "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": torch.ones(4, 32)},
            r"self_attn.q_proj of block 1 is 64 x 64, its LoRA A \(4, 32\)",
        ),
    ],
)
def test_adapters_that_do_not_fit_the_blocks_are_refused_on_add(llama, tmp_path, tensors, named):
    weights = read_adapter(edited(llama, tmp_path, tensors=tensors), llama.config, 0, 4)
    span = llama.span(0, 4)
    adapters = SpanAdapters(span)
    with pytest.raises(UsageError, match=named):
        adapters.add("bad", weights)
    assert adapters.names() == () and not any(isinstance(m, LoraLinear) for m in span.modules())  # nothing changed


def test_add_refuses_a_wrong_range_a_taken_or_bad_name(llama):
    adapters = SpanAdapters(llama.span(0, 2))
    with pytest.raises(UsageError, match=r"read for blocks \[0, 4\), this span is \[0, 2\)"):
        adapters.add("alpha", read_adapter(llama.paths["alpha"], llama.config, 0, 4))
    weights = read_adapter(llama.paths["alpha"], llama.config, 0, 2)
    adapters.add("alpha", weights)
    with pytest.raises(UsageError, match="already loaded"):
        adapters.add("alpha", weights)
    with pytest.raises(UsageError, match="adapter name"):
        adapters.add("no spaces", weights)
    with pytest.raises(UsageError, match=r"bad block range \[3, 5\)"):
        read_adapter(llama.paths["alpha"], llama.config, 3, 5)


def test_pickled_or_missing_adapters_are_refused(llama, tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    shutil.copy(llama.paths["alpha"] / "adapter_config.json", path)
    torch.save(load_file(llama.paths["alpha"] / "adapter_model.safetensors"), path / "adapter_model.bin")
    with pytest.raises(UsageError, match=r"adapter_model\.bin"):
        read_adapter(path, llama.config, 0, 4)
    with pytest.raises(UsageError, match=r"adapter_model\.bin"):
        adapter_digest(path)
    with pytest.raises(UsageError, match="no LoRA adapter"):
        adapter_digest(tmp_path / "nothing")
    with pytest.raises(UsageError, match=r"adapter_config\.json"):
        read_adapter(tmp_path / "nothing", llama.config, 0, 4)


class FakeLinear4bit(nn.Linear):
    """Stands for bitsandbytes' Linear4bit: an nn.Linear subclass with its own weight format."""


def test_quantised_spans_are_refused(llama):
    weights = read_adapter(llama.paths["alpha"], llama.config, 0, 4)
    span = llama.span(0, 4)
    span.layers[1].mlp.up_proj = FakeLinear4bit(64, 128, bias=False)
    with pytest.raises(UsageError, match=r"LoRA adapters on quantised servers are not supported.*FakeLinear4bit"):
        SpanAdapters(span).add("alpha", weights)
    from shoal.quantization.formats import Quantization
    from shoal.quantization.weights import block_quantizer

    try:
        quantize = block_quantizer(Quantization.INT8)
    except UsageError:
        pytest.skip("torchao is not installed")
    span = llama.span(0, 4)
    quantize(span.layers[3])
    with pytest.raises(UsageError, match="LoRA adapters on quantised servers are not supported"):
        SpanAdapters(span).add("alpha", weights)
