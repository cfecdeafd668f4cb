"""Giving and keeping chunks (:mod:`shoal.weights.give`, :mod:`shoal.weights.partial`) without a
network: a giver's chunks are the checkpoint's bytes as the manifest names them, read on a thread of
their own into reused buffers (a reused buffer never leaks a longer chunk's tail), held back while
the compute thread is busy (at most ``MAX_YIELD_S``); a fetcher keeps a chunk only if its size and
BLAKE3 digest are the manifest's."""

from __future__ import annotations

import asyncio
import threading

import pytest

from shoal.checkpoints.manifest import cached_manifest, chunk_digest, manifest_digest
from shoal.weights import give
from shoal.weights.give import Giver
from shoal.weights.partial import PartialSpan
from testkit.tiny import char_tokenizer, tiny_checkpoint

pytestmark = pytest.mark.timeout(60)
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("give") / "tiny", "qwen2", 5, tokenizer=char_tokenizer(),
                           hidden_size=128, intermediate_size=512, num_hidden_layers=2)  # fmt: skip


def make_giver(model_dir, busy=None) -> Giver:
    manifest, data = cached_manifest(model_dir, "tiny", CHUNK)
    return Giver(model_dir, manifest, data, manifest_digest(data), rate=1e12, busy=busy)


def every_chunk(giver: Giver) -> list[tuple[int, int]]:
    return [(i, c) for i, item in enumerate(giver.manifest.items) for c in range(len(item.chunks))]


def test_given_chunks_are_the_manifests_read_off_the_loop_into_reused_buffers(model_dir):
    giver = make_giver(model_dir)
    threads: set[str] = set()
    read = giver.reader._read

    def spy(*args):
        threads.add(threading.current_thread().name)
        return read(*args)

    giver.reader._read = spy
    chunks = every_chunk(giver)
    sizes = {giver.manifest.chunk_bytes(giver.manifest.items[i], c) for i, c in chunks}
    assert len(sizes) > 1 and CHUNK in sizes  # whole chunks and short last ones, interleaved below

    async def give_all() -> set[int]:
        buffers = set()
        for item, index in chunks:
            data = await giver.give(item, index)
            assert len(data) == giver.manifest.chunk_bytes(giver.manifest.items[item], index)
            assert chunk_digest(data) == giver.manifest.items[item].chunks[index]
            buffers.add(id(data.obj))
            giver.reader.release(data)
        return buffers

    buffers = asyncio.run(give_all())
    assert len(buffers) == 1  # one buffer served every chunk, one at a time
    assert giver.given == len(chunks) and giver.given_bytes == sum(i.size for i in giver.manifest.items)
    assert len(threads) == 1 and next(iter(threads)).startswith("shoal-give")


def test_a_giver_waits_while_the_compute_thread_is_busy_and_at_most_max_yield(model_dir, monkeypatch):
    busy = threading.Event()
    busy.set()
    giver = make_giver(model_dir, busy=busy.is_set)
    item, index = every_chunk(giver)[-1]

    async def held_then_freed() -> None:
        task = asyncio.create_task(giver.give(item, index))
        await asyncio.sleep(0.1)
        assert not task.done() and giver.given == 0  # held back while busy
        busy.clear()
        data = await asyncio.wait_for(task, 5.0)
        assert chunk_digest(data) == giver.manifest.items[item].chunks[index]

    asyncio.run(held_then_freed())
    waited = giver.yielded_s
    assert 0.1 <= waited < 5.0
    monkeypatch.setattr(give, "MAX_YIELD_S", 0.05)
    busy.set()  # busy for ever: the chunk still goes, after the longest wait
    data = asyncio.run(asyncio.wait_for(giver.give(item, index), 5.0))
    assert chunk_digest(data) == giver.manifest.items[item].chunks[index]
    assert 0.05 <= giver.yielded_s - waited < 2.0


def test_a_fetcher_keeps_only_chunks_of_the_manifests_size_and_digest(model_dir, tmp_path):
    giver = make_giver(model_dir)
    manifest = giver.manifest
    wanted = manifest.span_items(0, 2)
    partial = PartialSpan(tmp_path, manifest, giver.digest, wanted, "span")
    item = next(i for i in wanted if manifest.items[i].dtype and len(manifest.items[i].chunks) > 1)
    good = bytes(asyncio.run(giver.give(item, 0)))
    damaged = bytes([good[0] ^ 1]) + good[1:]
    assert not partial.keep(item, 0, damaged) and not partial.keep(item, 0, good[:-1])
    assert (item, 0) not in partial.done
    assert not partial.keep(item, 1, good)  # another chunk's bytes: not this chunk's digest
    assert partial.keep(item, 0, good) and (item, 0) in partial.done
    partial.close()
