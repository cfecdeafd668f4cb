"""The converted SmolLM2 cache (``shoal models fetch smollm2``): real weights that transformers and
shoal's spans both run. Never touches the network: a missing cache is a failure, not a skip."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.checkpoints import fetch as fetch_module
from shoal.checkpoints import fetch_model, is_fetched, load_client_head, load_span, model_cache_dir

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def smollm2():
    if not is_fetched("smollm2"):
        pytest.fail(f"SmolLM2 is not converted at {model_cache_dir('smollm2')}: run `shoal models fetch smollm2`")
    path = model_cache_dir("smollm2")
    return path, AutoTokenizer.from_pretrained(str(path)), AutoModelForCausalLM.from_pretrained(str(path)).eval()


def test_fetch_is_idempotent_and_offline(smollm2, monkeypatch):
    def no_subprocess(*args, **kwargs):
        raise AssertionError("fetch_model ran a subprocess although the model is cached")

    monkeypatch.setattr(fetch_module.subprocess, "run", no_subprocess)
    assert fetch_model("smollm2", progress=False) == smollm2[0]
    with pytest.raises(ValueError, match="known models are smollm2"):
        fetch_model("nope")


def test_transformers_greedy_text(smollm2):
    _, tokenizer, model = smollm2
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert tokenizer.decode(out[0, inputs.input_ids.shape[1] :]) == ", the city of Nova Haven"


def test_spans_match_transformers_on_real_weights(smollm2):
    path, tokenizer, model = smollm2
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    head = load_client_head(path)
    spans = [load_span(path, start, end)[0] for start, end in [(0, 11), (11, 30)]]
    positions = torch.arange(ids.shape[1])[None]
    hidden = head.embed(ids)
    for span in spans:
        hidden = span(hidden, positions, None)
    with torch.no_grad():
        expected = model(ids).logits
    assert (head.logits(hidden) - expected).abs().max().item() <= 1e-4
