"""A model's chunk manifest: every file and tensor a party may need, cut into fixed-size chunks,
each named by its BLAKE3 digest, so a peer can check every chunk another peer gives it.

The manifest lists the model's small files (config, tokenizer) and every tensor of its safetensors
checkpoint *as stored* (the bytes a block's fingerprint is taken over), with the block each tensor
belongs to (-1: none, e.g. the client's embeddings and head). It travels as msgpack; its BLAKE3
digest goes into the swarm's signed model record (:class:`shoal.swarm.records.ModelRecord`), so
a member fetches the manifest itself from any peer and checks it against the record. Built once
per checkpoint and cached beside it (keyed by the files' sizes and times), like its fingerprints.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import blake3
import msgspec

from shoal.checkpoints.loading import CheckpointError, holds_every_block, load_config, weight_map
from shoal.models import get_family

FORMAT = "shoal/manifest/1"
CHUNK_SIZE = 4 << 20
MIN_CHUNK, MAX_CHUNK = 64 << 10, 16 << 20
MAX_MANIFEST_BYTES = 16 << 20
MAX_ITEMS = 1 << 16
MAX_FILE_BYTES = 64 << 20  # a config or tokenizer file
DIGEST_BYTES = 32
CACHE_FILE = ".shoal-manifest.msgpack"
#: The small files a server needs beside its tensors (as :func:`shoal.checkpoints.resolve_model` fetches).
META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
              "chat_template.json", "tokenizer.model")  # fmt: skip
#: safetensors dtype -> bytes per element
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}  # fmt: skip

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Size = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class Item(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One file (``dtype`` empty) or tensor, and the digests of its chunks in order."""

    name: Name
    size: Size
    chunks: tuple[bytes, ...]
    dtype: Annotated[str, msgspec.Meta(max_length=8)] = ""
    shape: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=8)] = ()
    block: Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)] = -1


class Manifest(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Files then tensors; ``items`` numbers them in that order (a chunk is ``(item, index)``)."""

    format: str
    model: Name
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    chunk_size: Annotated[int, msgspec.Meta(ge=MIN_CHUNK, le=MAX_CHUNK)]
    files: Annotated[tuple[Item, ...], msgspec.Meta(max_length=64)]
    tensors: Annotated[tuple[Item, ...], msgspec.Meta(max_length=MAX_ITEMS)]

    @property
    def items(self) -> tuple[Item, ...]:
        return self.files + self.tensors

    def chunk_bytes(self, item: Item, index: int) -> int:
        """How many bytes chunk ``index`` of ``item`` holds (the last one may be short)."""
        return min(self.chunk_size, item.size - index * self.chunk_size)

    def span_items(self, start: int, end: int) -> list[int]:
        """Indices (into :attr:`items`) of the files and of blocks ``[start, end)``'s tensors."""
        first = len(self.files)
        return [*range(first), *(first + i for i, t in enumerate(self.tensors) if start <= t.block < end)]

    def client_items(self) -> list[int]:
        """Indices (into :attr:`items`) of the files and of the tensors of no block (the embeddings,
        final norm and head a client runs)."""
        return self.span_items(-1, 0)


class ManifestError(CheckpointError):
    """A manifest that does not decode or does not add up (chunk counts, sizes, digests)."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    return _ENCODER.encode(manifest)


def manifest_digest(data: bytes) -> bytes:
    """What the model record carries: BLAKE3 of the manifest as it travels."""
    return blake3.blake3(data).digest()


def chunk_digest(data: bytes | memoryview) -> bytes:
    return blake3.blake3(data).digest()


def decode_manifest(data: bytes) -> Manifest:
    """The manifest ``data`` holds, every count and size checked once here; :class:`ManifestError`."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes > {MAX_MANIFEST_BYTES}")
    try:
        manifest = _DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ManifestError(f"manifest: {exc}") from None
    if manifest.format != FORMAT:
        raise ManifestError(f"manifest format {manifest.format!r:.40}, not {FORMAT}")
    names = set()
    for item in manifest.items:
        why = _item_problem(item, manifest)
        if why is not None:
            raise ManifestError(f"manifest item {item.name!r:.80}: {why}")
        names.add((bool(item.dtype), item.name))
    if len(names) != len(manifest.items):
        raise ManifestError("manifest names an item twice")
    return manifest


def _item_problem(item: Item, manifest: Manifest) -> str | None:
    if len(item.chunks) != math.ceil(item.size / manifest.chunk_size):
        return "chunk count does not match its size"
    if any(len(d) != DIGEST_BYTES for d in item.chunks):
        return "chunk digests must be 32 bytes"
    if not item.dtype:
        ok = item.size <= MAX_FILE_BYTES and item.block == -1 and not item.shape and "/" not in item.name
        return None if ok and item.name in META_FILES else "not a known small file"
    if item.dtype not in DTYPE_BYTES:
        return f"unknown dtype {item.dtype!r:.10}"
    if math.prod(item.shape) * DTYPE_BYTES[item.dtype] != item.size:
        return "size does not match dtype and shape"
    if item.block >= manifest.num_blocks:
        return "block past the model's last"
    return None


@dataclass(frozen=True)
class Stored:
    """Where an item's bytes lie in a checkpoint directory: ``path`` from ``offset``."""

    path: Path
    offset: int


def safetensors_layout(path: Path) -> tuple[int, dict[str, dict]]:
    """The data's start in a safetensors file and its header entries (name -> dtype, shape, offsets)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 << 20:
            raise CheckpointError(f"{path}: a safetensors header of {length} bytes")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def _layouts(model_dir: Path) -> dict[str, tuple[Path, int, dict]]:
    """Tensor name -> (shard path, data start, header entry) of every tensor in the checkpoint."""
    try:
        where = weight_map(model_dir)
    except CheckpointError:  # nothing held yet
        return {}
    out = {}
    for shard in sorted(set(where.values())):
        path = model_dir / shard
        if not path.is_file():
            continue
        start, header = safetensors_layout(path)
        out.update({name: (path, start, entry) for name, entry in header.items()})
    return out


def _digests(path: Path, offset: int, size: int, chunk_size: int) -> tuple[bytes, ...]:
    out = []
    with open(path, "rb") as f:
        f.seek(offset)
        for begin in range(0, size, chunk_size):
            out.append(chunk_digest(f.read(min(chunk_size, size - begin))))
    return tuple(out)


def build_manifest(model_dir: str | Path, name: str, chunk_size: int = CHUNK_SIZE) -> Manifest | None:
    """The manifest of the checkpoint at ``model_dir`` (the model ``name`` in its swarm), or None when
    a shard is absent here (a party holding a slice cannot vouch for the whole model)."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    family = get_family(config)
    num_blocks = family.num_blocks(config)
    where = weight_map(model_dir)
    if not all((model_dir / shard).is_file() for shard in set(where.values())) or not holds_every_block(config, where):
        return None
    prefixes = [family.block_tensor_prefix(config, i) for i in range(num_blocks)]
    layouts = _layouts(model_dir)
    files = tuple(
        Item(f, (model_dir / f).stat().st_size, _digests(model_dir / f, 0, (model_dir / f).stat().st_size, chunk_size))
        for f in META_FILES
        if (model_dir / f).is_file()
    )
    tensors = []
    for tensor in sorted(layouts):
        path, start, entry = layouts[tensor]
        begin, end = entry["data_offsets"]
        block = next((i for i, p in enumerate(prefixes) if tensor.startswith(p)), -1)
        digests = _digests(path, start + begin, end - begin, chunk_size)
        tensors.append(Item(tensor, end - begin, digests, entry["dtype"], tuple(entry["shape"]), block))
    return Manifest(FORMAT, name, num_blocks, chunk_size, files, tuple(tensors))


def cached_manifest(model_dir: str | Path, name: str, chunk_size: int = CHUNK_SIZE) -> tuple[Manifest, bytes] | None:
    """:func:`build_manifest` and its encoding, cached beside the checkpoint when it is writable
    (keyed by the name, the chunk size and every file's size and time); None as there."""
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    stamp = _ENCODER.encode([name, chunk_size, [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]])
    cache = model_dir / CACHE_FILE
    try:
        saved = cache.read_bytes()
        if saved.startswith(stamp):
            data = saved[len(stamp) :]
            return decode_manifest(data), data
    except (OSError, ManifestError):
        pass
    manifest = build_manifest(model_dir, name, chunk_size)
    if manifest is None:
        return None
    data = encode_manifest(manifest)
    try:  # whole or not at all: servers of the same checkpoint may build it at once
        partial = cache.with_name(f"{CACHE_FILE}.{os.getpid()}")
        partial.write_bytes(stamp + data)
        os.replace(partial, cache)
    except OSError:
        pass
    return manifest, data


def holds_item(stored: Stored, item: Item, chunk_size: int) -> bool:
    """Whether the bytes at ``stored`` are ``item``'s, chunk by chunk (BLAKE3): :func:`locate` matches
    sizes only, which is all a giver needs (its fetcher checks every chunk), not a fetcher keeping
    files another manifest left."""
    try:
        return _digests(stored.path, stored.offset, item.size, chunk_size) == item.chunks
    except OSError:
        return False


def locate(model_dir: str | Path, manifest: Manifest) -> list[Stored | None]:
    """Where each of ``manifest``'s items lies under ``model_dir`` (None: not held here, or held
    with another size)."""
    model_dir = Path(model_dir)
    layouts = _layouts(model_dir)
    out: list[Stored | None] = []
    for item in manifest.files:
        path = model_dir / item.name
        out.append(Stored(path, 0) if path.is_file() and path.stat().st_size == item.size else None)
    for item in manifest.tensors:
        held = layouts.get(item.name)
        if held is None or held[2]["data_offsets"][1] - held[2]["data_offsets"][0] != item.size:
            out.append(None)
        else:
            out.append(Stored(held[0], held[1] + held[2]["data_offsets"][0]))
    return out


__all__ = [
    "CHUNK_SIZE",
    "DTYPE_BYTES",
    "Item",
    "Manifest",
    "ManifestError",
    "Stored",
    "build_manifest",
    "cached_manifest",
    "chunk_digest",
    "decode_manifest",
    "encode_manifest",
    "holds_item",
    "locate",
    "manifest_digest",
    "safetensors_layout",
]
