"""The fetching side of the weights protocol: a span's chunks from several givers at once, each
checked against the manifest before it is kept.

Every giver is first asked which items it holds (a server that fetched its own span from the swarm
gives that span on, and nothing else), then gets a few streams, each asking for the next missing
chunk it holds, so a faster giver gives more. A chunk whose size or BLAKE3 digest is wrong is
dropped and asked again of another giver, and its sender is banned for the rest of the fetch (a
giver that lies once may lie again); a giver that fails or lacks a chunk hands the chunk back to
the others. Chunks are kept in a :class:`~shoal.weights.partial.PartialSpan`, so a fetch cut short
resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable
from dataclasses import dataclass, field

from shoal.checkpoints.loading import progress_bar
from shoal.checkpoints.manifest import Manifest, ManifestError, decode_manifest, manifest_digest
from shoal.errors import BusyError, Forbidden, NotFound, RemoteError, ShoalError, TransportError, WireError
from shoal.protocols import WEIGHTS
from shoal.transport import BaseNode, Ticket
from shoal.weights.partial import PartialSpan
from shoal.wire import Message
from shoal.wire.schema import ChunkRequest, HeldRequest, ManifestRequest

log = logging.getLogger(__name__)
STREAMS_PER_GIVER = 4
MAX_FAILURES = 3  # requests in a row a giver may fail (not lie: that bans at once) before it is dropped


class WeightsError(ShoalError):
    """A span's weights could not be fetched from the swarm: no model record with a manifest, no
    giver, every giver banned or gone, or fetched blocks whose fingerprints are not the model's."""


@dataclass
class FetchReport:
    """What one fetch did: chunks fetched now, kept from before (resumed), refused (bad digest or
    size) and re-asked, and the givers banned for sending them."""

    fetched: int = 0
    resumed: int = 0
    discarded: int = 0  # journalled before a restart, but not what the manifest says: fetched again
    rejected: int = 0
    bytes: int = 0
    seconds: float = 0.0
    banned: set[str] = field(default_factory=set)
    by_giver: Counter = field(default_factory=Counter)


def _payload(reply: Message) -> memoryview:
    """The reply's bytes, as a view of its one u8 tensor (no copy)."""
    tensors = reply.tensors
    if len(tensors) != 1 or tensors[0].dim() != 1 or tensors[0].element_size() != 1:
        raise WireError("bad_reply", "a weights reply carries one 1-d u8 tensor")
    return memoryview(tensors[0].numpy()).cast("B")


async def fetch_manifest(node: BaseNode, givers: list[Ticket], model: str, digest: bytes, timeout: float) -> Manifest:
    """The manifest of ``model`` whose BLAKE3 is ``digest``, from the first giver whose copy matches."""
    for ticket in givers:
        try:
            data = _payload(await node.request(ticket, WEIGHTS, Message("manifest", 1, ManifestRequest(model=model)),
                                               timeout))  # fmt: skip
            data = bytes(data)
            if manifest_digest(data) != digest:
                log.warning("giver %s sent a manifest that is not the model record's", ticket.peer_id[:12])
                continue
            return decode_manifest(data)
        except (ShoalError, ManifestError) as exc:
            log.info("giver %s gave no manifest: %s", ticket.peer_id[:12], exc)
    raise WeightsError(f"no giver of {model} gave its manifest (of {len(givers)} asked)")


async def held_items(node: BaseNode, giver: Ticket, manifest: Manifest, digest: bytes, timeout: float) -> set[int]:
    """The items of ``manifest`` (whose BLAKE3 is ``digest``) that ``giver`` holds: none when it gives
    another manifest (it is then left out of the fetch); all when it cannot say (a failure, or a
    giver from before this request), so that its chunk requests find out."""
    try:
        reply = await node.request(giver, WEIGHTS, Message("held", 1, HeldRequest(manifest=digest.hex())), timeout)
        held = _payload(reply)
    except (NotFound, Forbidden):  # gives another manifest, or does not give to this peer
        return set()
    except ShoalError as exc:
        log.info("giver %s did not say what it holds (%s): asking it for every chunk", giver.peer_id[:12], exc)
        return set(range(len(manifest.items)))
    if len(held) != len(manifest.items):
        log.warning("giver %s said what it holds of another manifest", giver.peer_id[:12])
        return set()
    return {i for i, flag in enumerate(held) if flag}


Key = tuple[int, int]  # (item, chunk)


class ChunkQueue:
    """The chunks a fetch still wants, queued per giver: each giver's queue holds only the items it
    said it holds, a chunk leaves every queue once a worker takes it (queues are cleaned lazily), and
    one that comes back (failed, refused, not held after all) is queued again for every live giver
    that may hold it. Workers with nothing to take wait for :meth:`changed`, not on a timer."""

    def __init__(self, keys: list[Key], holds: dict[str, set[int]]):
        self.pending = set(keys)
        self.holds, self.live = holds, set(holds)
        self.lacking: dict[Key, set[str]] = {}  # said not_found after all
        self.queues = {peer: deque(k for k in keys if k[0] in held) for peer, held in holds.items()}
        self.in_flight = 0
        self._changed = asyncio.Event()

    def _may_give(self, peer: str, key: Key) -> bool:
        return key[0] in self.holds[peer] and peer not in self.lacking.get(key, ())

    def take(self, peer: str) -> Key | None:
        """The next chunk ``peer`` may give, taken (counted in flight until :meth:`done`), or None."""
        queue = self.queues[peer]
        while queue:
            key = queue.popleft()
            if key in self.pending and self._may_give(peer, key):
                self.pending.discard(key)
                self.in_flight += 1
                return key
        return None

    def done(self) -> None:
        """A taken chunk was kept, or given back."""
        self.in_flight -= 1
        self._notify()

    def give_back(self, key: Key, first: bool = False, lacked_by: str | None = None) -> None:
        """``key`` is wanted again (``first``: before the rest); ``lacked_by`` said it does not hold it."""
        if lacked_by is not None:
            self.lacking.setdefault(key, set()).add(lacked_by)
        self.pending.add(key)
        for peer in self.live:
            if self._may_give(peer, key):
                (self.queues[peer].appendleft if first else self.queues[peer].append)(key)

    def changed(self) -> Awaitable[bool]:
        """Resolves once a chunk in flight is kept or given back."""
        return self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


async def fetch_chunks(
    node: BaseNode, givers: list[Ticket], partial: PartialSpan, timeout: float,
    streams_per_giver: int = STREAMS_PER_GIVER, progress: bool | None = None,
) -> FetchReport:  # fmt: skip
    """Fetch every chunk ``partial`` misses from ``givers``; raises :class:`WeightsError` when chunks
    remain that no giver left can give. The partial span is left open: finish or close it."""
    manifest, digest = partial.manifest, partial.digest.hex()
    report = FetchReport(resumed=len(partial.done), discarded=partial.discarded)
    started = time.perf_counter()
    missing = partial.missing
    wanted = {item for item, _ in missing}
    holds = dict(zip((t.peer_id for t in givers), await asyncio.gather(
        *(held_items(node, t, manifest, partial.digest, timeout) for t in givers)), strict=True))  # fmt: skip
    givers = [t for t in givers if holds[t.peer_id] & wanted]
    chunks = ChunkQueue(missing, {t.peer_id: holds[t.peer_id] for t in givers})
    total = sum(manifest.chunk_bytes(manifest.items[i], c) for i, c in missing)

    async def worker(ticket: Ticket, stream_holder: list, bar) -> None:
        peer, failures = ticket.peer_id, 0
        while peer in chunks.live:
            key = chunks.take(peer)
            if key is None:  # none it holds, unless one in flight elsewhere comes back
                if chunks.in_flight == 0:
                    return
                await chunks.changed()
                continue
            try:
                item, index = key
                size = manifest.chunk_bytes(manifest.items[item], index)
                try:
                    if not stream_holder:
                        stream_holder.append(await node.open_stream(ticket, WEIGHTS, timeout))
                    request = Message("chunk", stream_holder[0].next_id(),
                                      ChunkRequest(manifest=digest, item=item, chunk=index))  # fmt: skip
                    data = _payload(await stream_holder[0].request(request, timeout))
                except NotFound:
                    chunks.give_back(key, lacked_by=peer)
                    continue
                except BusyError:
                    chunks.give_back(key)
                    await asyncio.sleep(0.05)
                    continue
                except (TransportError, WireError, RemoteError) as exc:
                    stream_holder.clear()
                    failures += 1
                    if failures >= MAX_FAILURES:
                        log.warning("giver %s dropped from the fetch: %s", peer[:12], exc)
                        chunks.live.discard(peer)
                    chunks.give_back(key)
                    continue
                failures = 0
                if not await asyncio.to_thread(partial.keep, item, index, data):  # checked and written off the loop
                    report.rejected += 1
                    report.banned.add(peer)
                    chunks.live.discard(peer)
                    chunks.give_back(key, first=True)
                    log.warning("giver %s sent item %d chunk %d that is not the manifest's: banned for this fetch",
                                peer[:12], item, index)  # fmt: skip
                    return
                report.fetched += 1
                report.bytes += size
                report.by_giver[peer] += 1
                bar.update(size)
            finally:
                chunks.done()

    with progress_bar(progress, total=total, unit="B", unit_scale=True, desc="fetch weights") as bar:
        holders: list[list] = []
        tasks = []
        for ticket in givers:
            for _ in range(streams_per_giver):
                holders.append([])
                tasks.append(asyncio.create_task(worker(ticket, holders[-1], bar)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for holder in holders:
                for stream in holder:
                    await _quietly(stream.finish())
    report.seconds = time.perf_counter() - started
    if partial.missing:
        gone = f"{len(report.banned)} banned for bad chunks, " if report.banned else ""
        raise WeightsError(f"{len(partial.missing)} chunks could not be fetched: {gone}no giver left that has them")
    return report


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except ShoalError:
        pass


__all__ = ["ChunkQueue", "FetchReport", "WeightsError", "fetch_chunks", "fetch_manifest", "held_items"]
