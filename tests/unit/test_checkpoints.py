"""Per-block shards, slice loading that touches only a party's shards, fingerprints, model resolution."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.checkpoints import (
    CheckpointError,
    block_fingerprint,
    load_client_head,
    load_span,
    load_tensors,
    resolve_model,
    save_sharded,
    span_fingerprints,
    weight_map,
)
from shoal.checkpoints import loading as loading_module
from shoal.ids import BlockRange
from testkit.tiny import tiny_model
from tests.helpers.servers import shard_files

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")  # 4 blocks, hidden 64, untied head


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory) -> Path:
    return save_sharded(model, model.config, tmp_path_factory.mktemp("tiny"))


def test_one_shard_per_block_and_transformers_loads_it(model, saved):
    shards = shard_files(saved)
    assert len(shards) == 4 + 1
    for i in range(4):
        (block,) = [names for names in shards.values() if any(n.startswith(f"model.layers.{i}.") for n in names)]
        assert all(n.startswith(f"model.layers.{i}.") for n in block)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} in shards.values()
    reloaded = AutoModelForCausalLM.from_pretrained(str(saved)).eval()
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_tied_head_is_not_stored(tmp_path):
    tied = tiny_model("llama", tie_word_embeddings=True)
    save_sharded(tied, tied.config, tmp_path)
    assert "lm_head.weight" not in weight_map(tmp_path)
    head = load_client_head(tmp_path)
    assert head.lm_head.weight is head.embed_tokens.weight


def test_span_loads_after_other_shards_are_deleted(model, saved, tmp_path):
    part = Path(shutil.copytree(saved, tmp_path / "part"))
    where = weight_map(part)
    keep = {where["model.layers.1.mlp.up_proj.weight"], where["model.layers.2.mlp.up_proj.weight"]}
    for shard in set(weight_map(part).values()) - keep:
        (part / shard).unlink()
    span, prints = load_span(part, 1, 3)
    assert sorted(prints) == [1, 2]
    hidden, pos = torch.randn(1, 5, 64), torch.arange(5)[None]
    with torch.no_grad():
        expected = model.model.layers[2](
            model.model.layers[1](hidden, position_embeddings=model.model.rotary_emb(hidden, pos)),
            position_embeddings=model.model.rotary_emb(hidden, pos),
        )
    # no mask given to the reference layers: sdpa with is_causal, as the span does without padding
    assert torch.equal(span(hidden, pos, None), expected)

    with pytest.raises(CheckpointError, match=r"missing shard files: model-00002-of-00005\.safetensors"):
        load_span(part, 0, 2)
    with pytest.raises(CheckpointError, match="model-00001-of-00005"):
        load_client_head(part)


def test_load_tensors_reads_only_wanted_shards(saved, monkeypatch):
    opened = []
    real = loading_module.safe_open

    def spy(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loading_module, "safe_open", spy)
    tensors = load_tensors(saved, lambda name: name.startswith("model.layers.3."))
    assert opened == [weight_map(saved)["model.layers.3.input_layernorm.weight"]]
    assert len(tensors) == 9 and all(name.startswith("model.layers.3.") for name in tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.9\.nope"):
        load_tensors(saved, ["model.norm.weight", "model.layers.9.nope"])


def test_single_file_checkpoint(model, tmp_path):
    model.save_pretrained(str(tmp_path))
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / "model.safetensors.index.json").exists()
    tensors = load_tensors(tmp_path, ["model.norm.weight"])
    assert torch.equal(tensors["model.norm.weight"], model.model.norm.weight)
    with pytest.raises(CheckpointError, match="neither"):
        load_tensors(tmp_path / "nowhere", ["x"])


def test_fingerprints_are_stable_and_distinct(model, saved, tmp_path):
    tensors = load_tensors(saved, lambda name: name.startswith("model.layers."))
    prints = span_fingerprints(model.config, 0, 4, tensors)
    assert len(set(prints.values())) == 4
    assert prints == span_fingerprints(model.config, 0, 4, load_tensors(saved, lambda n: "layers" in n))
    assert load_span(saved, 2, 4)[1] == {2: prints[2], 3: prints[3]}  # a server gets the same values
    block1 = {k: v for k, v in tensors.items() if k.startswith("model.layers.1.")}
    # names are relative to the block: the same weights under another index hash the same
    moved = {k.replace("layers.1.", "layers.7."): v for k, v in block1.items()}
    assert block_fingerprint(moved, "model.layers.7.") == prints[1]
    # dtype and every byte count
    assert block_fingerprint({k: v.to(torch.bfloat16) for k, v in block1.items()}, "model.layers.1.") != prints[1]
    tweaked = dict(block1)
    name = "model.layers.1.mlp.down_proj.weight"
    tweaked[name] = block1[name].clone()
    tweaked[name][0, 0] += 1e-3
    assert block_fingerprint(tweaked, "model.layers.1.") != prints[1]
    with pytest.raises(ValueError, match="prefix"):
        block_fingerprint(block1, "model.layers.2.")


def test_resolve_model_local_and_errors(saved):
    assert resolve_model(str(saved)) == saved
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_model("./no/such/dir")


def test_resolve_model_hub_fetches_only_needed_shards(saved, tmp_path, monkeypatch):
    """The Hub is unreachable here: a fake ``snapshot_download`` serves files from ``saved``."""
    import fnmatch

    import huggingface_hub

    snapshot = tmp_path / "snapshots" / "0123abcd"
    calls = []

    def fake_snapshot_download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None):
        calls.append((repo_id, revision, list(allow_patterns)))
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in saved.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    root = resolve_model("org/tiny", blocks=BlockRange(1, 3))
    assert root == snapshot and calls[1][1] == "0123abcd"  # second call pinned to the resolved commit
    present = {p.name for p in root.glob("*.safetensors")}
    where = weight_map(root)
    assert present == {where["model.layers.1.input_layernorm.weight"], where["model.layers.2.input_layernorm.weight"]}
    assert json.loads((root / "config.json").read_text())["model_type"] == "llama"
    load_span(root, 1, 3)

    resolve_model("org/tiny", client=True)
    load_client_head(root)
