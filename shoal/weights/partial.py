"""Where a span's fetched chunks are kept until the span is whole: a partial directory that survives
a restart.

``ROOT/.partial/`` holds the span's tensors as one safetensors file laid out in advance (header
first, then each tensor at its place; a chunk is written where it belongs), the small files, and a
journal of the chunks written. On restart every chunk the journal names is read back and checked
against the manifest: those that match are kept, the rest fetched again. When every chunk is in,
the files move into ``ROOT`` beside what earlier fetches left there, and ``ROOT``'s index maps
each tensor to its file, so the checkpoint loaders (:mod:`shoal.checkpoints`) read it as any other.
The manifest stays beside them (:func:`fetched_manifest`), so the server gives on what it fetched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from shoal.checkpoints.fetch import SWARM_MARKER as MARKER
from shoal.checkpoints.loading import INDEX_FILE
from shoal.checkpoints.manifest import (
    Item,
    Manifest,
    ManifestError,
    chunk_digest,
    decode_manifest,
    encode_manifest,
    manifest_digest,
)

PARTIAL = ".partial"
JOURNAL = "journal"
MANIFEST = ".shoal-swarm-manifest.msgpack"  # the manifest the weights beside it were fetched by


def _header(items: list[Item]) -> bytes:
    entries, offset = {}, 0
    for item in items:
        entries[item.name] = {"dtype": item.dtype, "shape": list(item.shape),
                              "data_offsets": [offset, offset + item.size]}  # fmt: skip
        offset += item.size
    entries["__metadata__"] = {"format": "pt"}
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data starts 8-byte aligned
    return len(body).to_bytes(8, "little") + body


class PartialSpan:
    """The chunks of ``wanted`` (indices into ``manifest.items``) of the manifest whose digest is
    ``digest``, as they arrive under ``root``. Opening it again resumes: :attr:`done` holds the
    chunks kept (read back and checked), :attr:`discarded` counts those that did not check out."""

    def __init__(self, root: Path, manifest: Manifest, digest: bytes, wanted: list[int], name: str):
        self.root, self.manifest, self.digest, self.name = root, manifest, digest, name
        self.dir = root / PARTIAL
        self.tensor_file = self.dir / f"{name}.safetensors"
        items = manifest.items
        tensors = [i for i in wanted if items[i].dtype]
        self.places: dict[int, tuple[Path, int]] = {}
        header = _header([items[i] for i in tensors])
        offset = len(header)
        for i in tensors:
            self.places[i] = (self.tensor_file, offset)
            offset += items[i].size
        for i in wanted:
            if not items[i].dtype:
                self.places[i] = (self.dir / items[i].name, 0)
        self.chunks = [(i, c) for i in wanted for c in range(len(items[i].chunks))]
        self.done: set[tuple[int, int]] = set()
        self.discarded = 0
        self._open(header, offset)

    def _open(self, header: bytes, size: int) -> None:
        stamp = self.dir / "manifest"
        if not (stamp.is_file() and stamp.read_text() == f"{self.digest.hex()} {self.name}"):
            shutil.rmtree(self.dir, ignore_errors=True)  # another manifest or span: start afresh
        self.dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(f"{self.digest.hex()} {self.name}")
        for path in {p for p, _ in self.places.values()}:
            if not path.exists():
                with open(path, "wb") as f:
                    f.truncate(size if path == self.tensor_file else 0)
        if self.tensor_file in {p for p, _ in self.places.values()}:
            with open(self.tensor_file, "r+b") as f:
                f.write(header)
        self._fds = {p: os.open(p, os.O_RDWR) for p in {p for p, _ in self.places.values()}}
        journal = self.dir / JOURNAL
        if journal.is_file():
            for line in journal.read_text().splitlines():
                parts = line.split()
                if len(parts) != 2 or not all(p.isdigit() for p in parts):
                    continue
                key = (int(parts[0]), int(parts[1]))
                if key in self.done or key[0] not in self.places or key[1] >= len(self.manifest.items[key[0]].chunks):
                    continue
                if self._check(*key):
                    self.done.add(key)
                else:
                    self.discarded += 1
        self._journal = open(journal, "w")  # noqa: SIM115 (open until finish or close) rewritten: what checked out
        self._journal.writelines(f"{i} {c}\n" for i, c in sorted(self.done))
        self._journal.flush()

    def _where(self, item: int, chunk: int) -> tuple[int, int, int]:
        path, base = self.places[item]
        size = self.manifest.chunk_bytes(self.manifest.items[item], chunk)
        return self._fds[path], base + chunk * self.manifest.chunk_size, size

    def _check(self, item: int, chunk: int) -> bool:
        fd, offset, size = self._where(item, chunk)
        return chunk_digest(os.pread(fd, size, offset)) == self.manifest.items[item].chunks[chunk]

    @property
    def missing(self) -> list[tuple[int, int]]:
        return [key for key in self.chunks if key not in self.done]

    def keep(self, item: int, chunk: int, data: bytes | memoryview) -> bool:
        """Check a received chunk against the manifest (size and BLAKE3 digest) and, if it is the
        manifest's, write it; return whether it was. One call, so that a fetch hashes and writes on
        one worker thread (both release the GIL) and its event loop does neither."""
        if len(data) != self.manifest.chunk_bytes(self.manifest.items[item], chunk):
            return False
        if chunk_digest(data) != self.manifest.items[item].chunks[chunk]:
            return False
        self.write(item, chunk, data)
        return True

    def write(self, item: int, chunk: int, data: bytes | memoryview) -> None:
        """Keep a chunk already checked against the manifest (blocking: call it off the event loop)."""
        fd, offset, size = self._where(item, chunk)
        if len(data) != size:
            raise ValueError("chunk of the wrong size")
        os.pwrite(fd, data, offset)
        self._journal.write(f"{item} {chunk}\n")
        self._journal.flush()
        self.done.add((item, chunk))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        self._journal.close()

    def finish(self) -> None:
        """Every chunk is in: move the files into ``root`` and index the tensors there."""
        if self.missing:
            raise ValueError(f"{len(self.missing)} chunks are still missing")
        for fd in self._fds.values():
            os.fsync(fd)
        self.close()
        items = self.manifest.items
        for path in {p for p, _ in self.places.values()}:
            os.replace(path, self.root / path.name)
        _update_index(self.root, {items[i].name: self.tensor_file.name for i in self.places if items[i].dtype})
        data = encode_manifest(self.manifest)
        if manifest_digest(data) == self.digest:  # it re-encodes as fetched (msgpack arrays: it should)
            (self.root / MANIFEST).write_bytes(data)
        else:  # not kept: the span is not given on, and what it holds is checked at the next fetch
            (self.root / MANIFEST).unlink(missing_ok=True)
        (self.root / MARKER).write_text(json.dumps({"model": self.manifest.model, "manifest": self.digest.hex()}))
        shutil.rmtree(self.dir, ignore_errors=True)


def forget_tensors(root: Path, names: list[str]) -> None:
    """Take tensors ``names`` out of ``root``'s index: what the loaders and :func:`locate
    <shoal.checkpoints.manifest.locate>` no longer find there is fetched again (their bytes stay in
    their files until those are replaced)."""
    if names and (root / INDEX_FILE).is_file():
        _update_index(root, dict.fromkeys(names))


def _update_index(root: Path, files: dict[str, str | None]) -> None:
    """Map each tensor of ``files`` to its file in ``root``'s index (None: take it out), replacing
    the index whole (made when absent)."""
    index_path = root / INDEX_FILE
    index = json.loads(index_path.read_text()) if index_path.is_file() else {"metadata": {}, "weight_map": {}}
    for name, file in files.items():
        if file is None:
            index["weight_map"].pop(name, None)
        else:
            index["weight_map"][name] = file
    tmp = root / f"{INDEX_FILE}.tmp"
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
    os.replace(tmp, index_path)


def fetched_manifest(root: Path) -> tuple[Manifest, bytes] | None:
    """The swarm's manifest the weights under ``root`` were fetched by, and its encoding (kept by
    :meth:`PartialSpan.finish`); None when ``root`` holds no fetched weights, or the manifest kept
    is not the one its marker names."""
    try:
        named = json.loads((root / MARKER).read_text()).get("manifest")
        data = (root / MANIFEST).read_bytes()
    except (OSError, ValueError, AttributeError):
        return None
    if manifest_digest(data).hex() != named:
        return None
    try:
        return decode_manifest(data), data
    except ManifestError:
        return None


__all__ = ["MANIFEST", "MARKER", "PARTIAL", "PartialSpan", "fetched_manifest", "forget_tensors"]
