"""A fuzz campaign against a live ``shoal serve`` process (issue #32: no peer can exhaust a node):
the code of ``python -m bench.fuzz`` and ``tests/attacks/test_fuzz_short.py``.

:func:`run_campaign` saves a tiny random llama, starts ``shoal serve`` of its first block in a swarm of
its own (so it serves the meta, blocks and swarm protocols), and

1. warms it up with honest traffic from one peer (sessions, forwards), then reads its resident memory;
2. records what an honest session (a prefill and two decode steps) and seeded forwards return;
3. has ``concurrency`` workers of a second, hostile peer send frames until ``frames`` were sent or
   ``seconds`` passed (:data:`CASES`: valid requests, every metadata field mutated, frame
   mutations, random bytes, messages out of order or on the wrong protocol, half-sent messages
   finished, aborted or left hanging, oversized declared sizes, sessions misused);
4. asks whether the server still answers, runs the honest session again from a new peer (its
   outputs must be equal to those before), reads its memory again and stops it.

Every reply is counted by its error's wire reason or code (``errors``; ``closed``: a stream the server
ended without a reply, ``reset``: one it stopped reading while we sent), and each case that must get a
certain answer and got another is a ``problem``. A message the server answers with an error on a
stream it then closes ends that stream: the worker opens a new one and goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from shoal.errors import ClosedError, ShoalError, WireError
from shoal.ids import BlockRange
from shoal.launch import ServerProcess, serve_args, stop_all
from shoal.limits import Limits, MiB
from shoal.protocols import BLOCKS
from shoal.swarm.service import SWARM, blob
from shoal.transport import META, MessageStream, Node, Protocol, Ticket, TransportConfig
from shoal.transport.loop import run as run_loop
from shoal.wire import Message
from shoal.wire.schema import (
    Empty,
    ForwardRequest,
    Gossip,
    OpenReply,
    OpenRequest,
    Ping,
    PushHop,
    PushRequest,
    StepRequest,
)
from testkit.mutations import (
    HIDDEN,
    MUTATIONS,
    PROTOCOL_OF,
    Outcome,
    Stats,
    count_frames,
    frame_data,
    head,
    meta_mutations,
    random_case,
    raw,
    read_outcome,
    valid_requests,
)
from testkit.tiny import inputs, tiny_checkpoint

CLIENT = TransportConfig(bind_addr="127.0.0.1:0")
#: Case kinds and their weights.
CASES = {"valid": 22, "meta": 24, "order": 10, "wire": 22, "random": 10, "half": 6, "session": 6}
REPLY_TIMEOUT = 10.0
MAX_HANGING = 32  # half-sent messages left open at once (the server cuts each after its data_timeout)
FORWARD_SEEDS = 4
NO_SESSION = "0" * 32


@dataclass(frozen=True)
class FuzzConfig:
    frames: int = 100_000  # stop once this many frames were sent...
    seconds: float = 600.0  # ... or this many seconds passed
    seed: int = 0
    concurrency: int = 8  # workers of the hostile peer, each with its own streams
    data_timeout: float = 2.0  # the server's --data-timeout
    warmup: int = 20  # honest sessions before the first memory reading
    rss_sample_every: float = 5.0  # seconds between readings of the server's peak memory


class Worker:
    """One hostile peer's worker: persistent streams for well-framed cases, fresh ones for the rest."""

    def __init__(self, campaign: Campaign, index: int):
        self.campaign, self.stats, self.node, self.ticket = campaign, campaign.stats, campaign.node, campaign.ticket
        self.rng = random.Random(f"{campaign.seed}/{index}")
        self.streams: dict[Protocol, MessageStream] = {}

    async def run(self) -> None:
        kinds, weights = list(CASES), list(CASES.values())
        while not self.campaign.done():
            case = self.rng.choices(kinds, weights)[0]
            self.stats.cases[case] += 1
            try:
                await getattr(self, case)()
            except ShoalError as exc:  # a stream or connection could not be opened: is the server there?
                self.stats.problems.append(f"{case}: {type(exc).__name__}: {exc}")
                self.streams.clear()
                if not self.campaign.server.alive:
                    return

    # ---- sending ------------------------------------------------------------------------------
    async def _persistent(self, protocol: Protocol) -> MessageStream:
        stream = self.streams.get(protocol)
        if stream is None or stream.broken:
            stream = self.streams[protocol] = await self.node.open_stream(self.ticket, protocol)
        return stream

    async def _send(self, stream: MessageStream, data: bytes, expected: str | None = None, case: str = "") -> bool:
        """Write ``data``; False (counted as ``reset``, a problem unless ``expected`` is None) if the
        server stopped reading the stream."""
        self.stats.frames += count_frames(data)
        try:
            await stream.send_raw(data)
            return True
        except (ClosedError, WireError):
            stream.broken = True
            self.stats.outcome(Outcome("reset"), expected, case)
            return False

    async def _exchange(self, protocol: Protocol, data: bytes, expected: str, case: str) -> Outcome:
        """``data`` on the persistent stream of ``protocol``, its answer counted and returned."""
        stream = await self._persistent(protocol)
        if not await self._send(stream, data, expected, case):
            return Outcome("reset")
        outcome = await read_outcome(stream, REPLY_TIMEOUT, drain=False)
        if outcome.kind not in ("result", "error"):
            stream.broken = True
        self.stats.outcome(outcome, expected, case)
        return outcome

    async def _fresh(self, protocol: Protocol, data: bytes, expected: str | None, case: str) -> None:
        """``data`` on a new stream, ended after it; its answer counted (a reset is fine)."""
        stream = await self.node.open_stream(self.ticket, protocol)
        try:
            if await self._send(stream, data):
                await stream.finish()
                self.stats.outcome(await read_outcome(stream, REPLY_TIMEOUT), expected, case)
        finally:
            await stream.stop()

    # ---- cases --------------------------------------------------------------------------------
    async def valid(self) -> None:
        """A valid request on a persistent stream, its answer checked (a ping's echo, a forward's
        output equal to the honest peer's before the fuzz)."""
        choice, rng = self.rng.randrange(4), self.rng
        if choice == 0:
            generator = torch.Generator().manual_seed(rng.getrandbits(32))
            check = torch.randn(rng.choice((1, 16, 256, 4096)), generator=generator)
            protocol, message = META, Message("ping", 1, Ping(), [check])
        elif choice == 1:
            protocol, message, check = BLOCKS, Message("info", 1), None
        elif choice == 2:
            seed = rng.randrange(FORWARD_SEEDS)
            protocol, message = BLOCKS, Message("forward", 1, ForwardRequest(), inputs(HIDDEN, 3, seed=seed))
            check = self.campaign.reference[3 + seed]
        else:
            protocol, message, check = SWARM, Message("gossip", 1, Gossip(op="table"), [blob(b"")]), None
        outcome = await self._exchange(protocol, raw(message), "result", f"valid {message.kind}")
        if outcome.kind != "result":
            return
        if check is not None and not torch.equal(outcome.reply.tensors[0], check):
            self.stats.problems.append(f"valid {message.kind}: answered with other tensors")
        else:
            self.stats.valid_served += 1

    async def meta(self) -> None:
        """A metadata mutation: answered bad_request, on a stream that stays usable."""
        mutation = self.rng.choice(self.campaign.mutations)
        data = raw(mutation.message(1))
        await self._exchange(PROTOCOL_OF.get(mutation.kind, BLOCKS), data, "bad_request", f"meta {mutation.kind}")

    async def order(self) -> None:
        """Well-framed messages out of order or on the wrong protocol (the stream goes on)."""
        rng = self.rng
        cases = [
            (BLOCKS, Message("step", 1, StepRequest(session=NO_SESSION, position=0), inputs(HIDDEN, 1)), "not_found"),
            (BLOCKS, Message("close", 1), "bad_request"),
            (BLOCKS, Message("ping", 1, Ping(), [torch.ones(2)]), "bad_request"),
            (BLOCKS, Message("result", 1), "bad_request"),
            (META, Message("open", 1, OpenRequest(max_length=8)), "bad_request"),
            (META, Message("error", 1, Empty()), "bad_request"),
            (SWARM, Message("info", 1), "bad_request"),
        ]
        if rng.randrange(4):
            protocol, message, expected = rng.choice(cases)
            await self._exchange(protocol, raw(message), expected, f"order {message.kind}")
            return
        # a push into no session (never answered), then an info: the info's result comes back
        push = PushRequest(session=NO_SESSION, token=NO_SESSION, position=0, step=1)
        data = raw(Message("push", 1, push, inputs(HIDDEN, 1))) + raw(Message("info", 2))
        await self._exchange(BLOCKS, data, "result", "order push")

    async def wire(self) -> None:
        """A frame mutation on a fresh stream (after 0-2 valid pings on it): answered with its reason."""
        reason, data = self.rng.choice(MUTATIONS)
        protocol = self.rng.choice((META, BLOCKS, SWARM))
        pings = self.rng.choice((0, 0, 1, 2))
        if pings == 0:
            await self._fresh(protocol, data, reason, f"wire {reason}")
            return
        stream = await self.node.open_stream(self.ticket, META)
        try:
            prefix = b"".join(raw(Message("ping", i, Ping(), [torch.ones(4)])) for i in range(1, pings + 1))
            if await self._send(stream, prefix + data):
                await stream.finish()
                for _ in range(pings):
                    self.stats.outcome(await read_outcome(stream, REPLY_TIMEOUT, drain=False), "result", "wire ping")
                self.stats.outcome(await read_outcome(stream, REPLY_TIMEOUT), reason, f"wire {reason} after pings")
        finally:
            await stream.stop()

    async def random(self) -> None:
        """Truncated, bit-flipped or random bytes: any answer, in time."""
        await self._fresh(self.rng.choice((META, BLOCKS, SWARM)), random_case(self.rng), None, "random")

    async def half(self) -> None:
        """A message whose header declares more data than comes: the stream finished (truncated),
        aborted by us, or left hanging (the server's data_timeout cuts it); or one declaring more
        than the kind may carry (message_too_large at once)."""
        rng = self.rng
        protocol, kind, cap = rng.choice(((META, "ping", Limits().max_ping_bytes), (BLOCKS, "forward", None)))
        cap = cap or Limits().max_message_bytes
        mode = rng.choice(("finish", "abort", "hang", "oversized"))
        if mode == "hang" and self.campaign.hanging.locked():
            mode = "finish"
        declared = cap + 1 + rng.randrange(1 << 20) if mode == "oversized" else rng.choice((64, 4096, 1 << 20, cap))
        data = head(k=kind, m={}, t=[["u8", [declared], "raw"]], n=declared)
        if mode != "oversized":
            sent = rng.randrange(min(declared, 4096))
            data += frame_data(rng.randbytes(sent), declare=sent + rng.choice((0, 0, 1, 1000)))
        if mode in ("finish", "oversized"):
            expected = "message_too_large" if mode == "oversized" else "truncated"
            await self._fresh(protocol, data, expected, f"half {mode}")
            return
        stream = await self.node.open_stream(self.ticket, protocol)
        if not await self._send(stream, data):
            return
        if mode == "abort":
            await stream.abort()
            return
        await self.campaign.hanging.acquire()
        task = asyncio.get_running_loop().create_task(self.campaign.hang(stream))
        self.campaign.hang_tasks.add(task)
        task.add_done_callback(self.campaign.hang_tasks.discard)

    async def session(self) -> None:
        """A session misused: steps at wrong positions, of another width or past its max_length,
        mutated step metadata, other kinds on its stream; then closed, abandoned or cut by a bad frame."""
        rng = self.rng
        stream = await self.node.open_stream(self.ticket, BLOCKS)
        try:
            max_length = rng.choice((4, 8, 16))
            if not await self._send(
                stream, raw(Message("open", 1, OpenRequest(max_length=max_length))), "result", "open"
            ):
                return
            opened = await read_outcome(stream, REPLY_TIMEOUT, drain=False)
            if opened.kind != "result":
                self.stats.outcome(opened, "result", "session open")
                return
            session, position = opened.reply.reply(OpenReply).session, 0
            for _ in range(rng.randint(1, 4)):
                action, n = rng.randrange(5), rng.randint(1, 3)
                tensors, at, expected = inputs(HIDDEN, n, position), position, "result"
                if action == 1:
                    at, expected = position + 1 + rng.randrange(3), "bad_request"
                elif action == 2:
                    tensors, expected = inputs(HIDDEN // 2, n, position), "bad_request"
                elif action == 3:
                    data, expected = raw(rng.choice(self.campaign.step_mutations).message(2)), "bad_request"
                elif action == 4:
                    data, expected = raw(Message("info", 2)), "bad_request"
                if action < 3:
                    expected = "bad_request" if at + n > max_length else expected
                    data = raw(Message("step", 2, StepRequest(session=session, position=at), tensors))
                if not await self._send(stream, data, expected, f"session action {action}"):
                    return
                outcome = await read_outcome(stream, REPLY_TIMEOUT, drain=False)
                self.stats.outcome(outcome, expected, f"session action {action}")
                position += n if outcome.kind == "result" and action < 3 else 0
            end = rng.randrange(3)
            if end == 0 and await self._send(stream, raw(Message("close", 3)), "result", "session close"):
                self.stats.outcome(await read_outcome(stream, REPLY_TIMEOUT), "result", "session close")
            elif end == 1:
                reason, data = rng.choice([m for m in MUTATIONS if m[0] not in ("bad_request", "truncated")])
                if await self._send(stream, data):
                    self.stats.outcome(await read_outcome(stream, REPLY_TIMEOUT), reason, f"session {reason}")
        finally:
            await stream.finish()
            await stream.stop()


class Campaign:
    """The hostile peer's workers, what they share, and the half-sent messages left hanging."""

    def __init__(self, node: Node, server: ServerProcess, reference: list[torch.Tensor], config: FuzzConfig):
        self.node, self.server, self.ticket, self.reference = node, server, server.ticket, reference
        self.config, self.seed, self.stats = config, config.seed, Stats()
        hop = PushHop(ticket=str(self.ticket), session=NO_SESSION, token=NO_SESSION)
        self.mutations = meta_mutations(valid_requests(NO_SESSION, NO_SESSION, hop))
        self.step_mutations = [m for m in self.mutations if m.kind in ("step", "close")]
        self.hanging = asyncio.Semaphore(MAX_HANGING)
        self.hang_tasks: set[asyncio.Task] = set()
        self.deadline = 0.0

    def done(self) -> bool:
        return self.stats.frames >= self.config.frames or time.monotonic() >= self.deadline or not self.server.alive

    async def hang(self, stream: MessageStream) -> None:
        """Wait for the server to cut a half-sent message left hanging (or give up and abort it)."""
        try:
            outcome = await read_outcome(stream, self.config.data_timeout + REPLY_TIMEOUT)
            self.stats.outcome(outcome, "data_timeout", "half hang")
        finally:
            await stream.abort()
            self.hanging.release()

    async def run(self) -> None:
        self.deadline = time.monotonic() + self.config.seconds
        await asyncio.gather(*(Worker(self, i).run() for i in range(self.config.concurrency)))
        await asyncio.gather(*list(self.hang_tasks))


async def honest_outputs(node: Node, ticket: Ticket) -> list[torch.Tensor]:
    """An honest session's outputs (a prefill of 4 positions, two decode steps), then those of
    :data:`FORWARD_SEEDS` forwards of 3 positions: all seeded, so equal from a healthy server."""
    stream = await node.open_stream(ticket, BLOCKS)
    try:
        opened = (await stream.request(Message("open", 1, OpenRequest(max_length=16)))).reply(OpenReply)
        outputs, position = [], 0
        for seed, n in ((101, 4), (102, 1), (103, 1)):
            meta = StepRequest(session=opened.session, position=position)
            reply = await stream.request(
                Message("step", stream.next_id(), meta, inputs(HIDDEN, n, position, seed=seed))
            )
            outputs.append(reply.tensors[0])
            position += n
        await stream.request(Message("close", stream.next_id()))
    finally:
        await stream.finish()
    for seed in range(FORWARD_SEEDS):
        forward = Message("forward", 1, ForwardRequest(), inputs(HIDDEN, 3, seed=seed))
        outputs.append((await node.request(ticket, BLOCKS, forward, timeout=REPLY_TIMEOUT)).tensors[0])
    return outputs


async def _campaign(server: ServerProcess, config: FuzzConfig) -> dict:
    process = psutil.Process(server.pid)
    async with await Node.start(CLIENT) as honest:
        for _ in range(config.warmup):
            before = await honest_outputs(honest, server.ticket)
    rss_before = process.memory_info().rss
    peak = rss_before
    async with await Node.start(CLIENT) as hostile:
        campaign = Campaign(hostile, server, before, config)
        started = time.monotonic()
        fuzz = asyncio.get_running_loop().create_task(campaign.run())
        while not fuzz.done():
            await asyncio.wait({fuzz}, timeout=config.rss_sample_every)
            with contextlib.suppress(psutil.Error):
                peak = max(peak, process.memory_info().rss)
        await fuzz
        seconds = time.monotonic() - started
    stats = campaign.stats
    report = {"frames": stats.frames, "crashes": 0, "serves_after": 0}
    async with await Node.start(CLIENT) as after:  # a new peer
        try:
            await after.request(server.ticket, BLOCKS, Message("info", 1), timeout=REPLY_TIMEOUT)
        except ShoalError as exc:
            report["crashes"] = 1
            stats.problems.append(f"after: the server does not answer: {exc}")
        try:
            outputs = await honest_outputs(after, server.ticket)
            report["serves_after"] = int(all(torch.equal(a, b) for a, b in zip(outputs, before, strict=True)))
        except ShoalError as exc:
            stats.problems.append(f"after: the honest session failed: {exc}")
    report["rss_growth_mb"] = report["rss_before_mb"] = report["rss_peak_growth_mb"] = None
    if not server.alive:
        report["crashes"] = 1
    else:
        rss_after = process.memory_info().rss
        report |= {
            "rss_growth_mb": round((rss_after - rss_before) / MiB, 2),
            "rss_before_mb": round(rss_before / MiB, 1),
        }
        report["rss_peak_growth_mb"] = round((max(peak, rss_after) - rss_before) / MiB, 2)
    return report | {
        "errors": dict(sorted(stats.errors.items())),
        "valid_served": stats.valid_served,
        "cases": dict(sorted(stats.cases.items())),
        "problems": len(stats.problems),
        "problem_samples": sorted(set(stats.problems))[:12],
        "seconds": round(seconds, 1),
        "frames_per_second": round(stats.frames / seconds, 1),
    }


def run_campaign(config: FuzzConfig = FuzzConfig()) -> dict:
    """The whole campaign (see the module docstring); its report."""
    flags = ["--num-threads", "1", "--new-swarm", "--throughput", "10", "--data-timeout", str(config.data_timeout)]
    with tempfile.TemporaryDirectory(prefix="shoal-fuzz-") as tmp:
        model_dir = tiny_checkpoint(Path(tmp), "llama", seed=1)
        server = ServerProcess(serve_args(model_dir, BlockRange(0, 1), *flags), env={"OMP_NUM_THREADS": "1"})
        try:
            report = run_loop(_campaign(server, config))
        finally:
            stop_all([server], 30)
    output = server.text()
    return report | {
        "server_exit": server.proc.returncode,
        "tracebacks": output.count("Traceback"),
        "data_timeout": config.data_timeout,
        "seed": config.seed,
        "concurrency": config.concurrency,
    }


__all__ = ["CASES", "Campaign", "FuzzConfig", "honest_outputs", "run_campaign"]
