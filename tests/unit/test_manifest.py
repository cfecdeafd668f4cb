"""The chunk manifest (:mod:`shoal.checkpoints.manifest`) and its place in the model record: built
from a checkpoint's files as stored, checked once when decoded, its digest signed in the record."""

from __future__ import annotations

import math

import msgspec
import pytest

from shoal.checkpoints.loading import load_config, weight_map
from shoal.checkpoints.manifest import (
    Item,
    ManifestError,
    build_manifest,
    cached_manifest,
    chunk_digest,
    decode_manifest,
    encode_manifest,
    locate,
    manifest_digest,
)
from shoal.models import get_family
from shoal.swarm.members import public_key
from shoal.swarm.records import ModelRecord, RecordError, decode, sign
from shoal.swarm.table import RecordTable
from shoal.transport.identity import generate_key
from testkit.tiny import char_tokenizer, tiny_checkpoint

CHUNK = 64 << 10
NOW = 1_000_000.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("manifest") / "tiny", "llama", 3, tokenizer=char_tokenizer(),
                           hidden_size=128, intermediate_size=512)  # fmt: skip


def test_the_manifest_covers_every_tensor_as_stored_in_chunks_named_by_blake3(model_dir):
    manifest = build_manifest(model_dir, "tiny", CHUNK)
    config = load_config(model_dir)
    assert {t.name for t in manifest.tensors} == set(weight_map(model_dir))
    assert {"config.json", "tokenizer.json"} <= {f.name for f in manifest.files}
    family = get_family(config)
    for item, stored in zip(manifest.items, locate(model_dir, manifest), strict=True):
        assert stored is not None and len(item.chunks) == math.ceil(item.size / CHUNK)
        with open(stored.path, "rb") as f:
            f.seek(stored.offset)
            data = f.read(item.size)
        assert [chunk_digest(data[i : i + CHUNK]) for i in range(0, item.size, CHUNK)] == list(item.chunks)
        if item.dtype and item.name.startswith(family.block_tensor_prefix(config, 2)):
            assert item.block == 2
    assert manifest.span_items(1, 2) == [
        *range(len(manifest.files)),
        *(len(manifest.files) + i for i, t in enumerate(manifest.tensors) if t.block == 1),
    ]
    assert any(len(t.chunks) > 1 for t in manifest.tensors)  # the MLP weights take several chunks
    assert decode_manifest(encode_manifest(manifest)) == manifest
    again = cached_manifest(model_dir, "tiny", CHUNK)
    assert (
        again is not None
        and again[0] == manifest
        and manifest_digest(again[1]) == manifest_digest(encode_manifest(manifest))
    )


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda item: msgspec.structs.replace(item, chunks=item.chunks[:-1] or (b"",) * 2), "chunk count"),
        (lambda item: msgspec.structs.replace(item, chunks=(b"x" * 31,) * len(item.chunks)), "32 bytes"),
        (lambda item: msgspec.structs.replace(item, dtype="Q7"), "unknown dtype"),
        (lambda item: msgspec.structs.replace(item, shape=(*item.shape, 2)), "dtype and shape"),
        (lambda item: msgspec.structs.replace(item, block=99), "block past"),
    ],
)
def test_a_manifest_that_does_not_add_up_is_refused(model_dir, change, why):
    manifest = build_manifest(model_dir, "tiny", CHUNK)
    bad = msgspec.structs.replace(manifest, tensors=(change(manifest.tensors[0]), *manifest.tensors[1:]))
    with pytest.raises(ManifestError, match=why):
        decode_manifest(encode_manifest(bad))


def test_only_known_small_files_travel(model_dir):
    manifest = build_manifest(model_dir, "tiny", CHUNK)
    sneaky = Item("../../.bashrc", 3, (chunk_digest(b"abc"),))
    with pytest.raises(ManifestError, match="not a known small file"):
        decode_manifest(encode_manifest(msgspec.structs.replace(manifest, files=(*manifest.files, sneaky))))
    with pytest.raises(ManifestError):
        decode_manifest(b"\x93garbage")


def test_the_model_record_carries_the_manifest_digest_and_the_first_one_stands():
    key, other = generate_key(), generate_key()
    fps = tuple(bytes([i]) * 32 for i in range(4))
    digest = manifest_digest(b"manifest")
    record = ModelRecord("s", public_key(key), "tiny", 4, fps, NOW, NOW + 60, digest)
    signed = sign(record, key)
    assert decode(signed.data).record.manifest == digest
    plain = ModelRecord("s", public_key(key), "tiny", 4, fps, NOW, NOW + 60)
    assert decode(sign(plain, key).data).record.manifest == b""  # 7 fields, as before manifests
    with pytest.raises(RecordError, match="manifest"):
        decode(sign(ModelRecord("s", public_key(key), "tiny", 4, fps, NOW, NOW + 60, b"short"), key).data)
    table = RecordTable("s", clock=lambda: NOW + 1)
    assert table.merge(signed)
    forged = ModelRecord("s", public_key(other), "tiny", 4, fps, NOW + 5, NOW + 65, manifest_digest(b"other"))
    assert not table.merge(sign(forged, other))
    assert table.rejected["manifest_mismatch"] == 1
    assert table.model("tiny").manifest == digest
