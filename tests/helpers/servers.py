"""Block servers in child processes, and a thin client for the ``shoal/blocks/2`` protocol that works
on any node (iroh or in-memory): typed requests in, typed replies out, no client-side policy.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import psutil
import torch

from shoal.checkpoints import weight_map
from shoal.checkpoints.loading import INDEX_FILE
from shoal.errors import remote_error
from shoal.ids import BlockRange
from shoal.launch import ServerProcess, serve_args, stop_all
from shoal.protocols import BLOCKS
from shoal.transport import BaseNode, MessageStream, Ticket, TransportConfig
from shoal.verify.tokens import push_token
from shoal.wire import Message
from shoal.wire.schema import InfoReply, OpenReply, OpenRequest, PushHop, StepReply, StepRequest
from testkit.tiny import inputs as inputs  # re-exported: the tests' span inputs

CLIENT_CONFIG = TransportConfig(bind_addr="127.0.0.1:0")


ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # a test's child processes: one OpenMP thread each


def start_server(model_dir: str | Path, blocks: str, *flags: str, ready_timeout: float = 180.0) -> ServerProcess:
    """``shoal serve`` on loopback with one compute thread."""
    args = serve_args(model_dir, BlockRange.parse(blocks), "--num-threads", "1", *flags)
    return ServerProcess(args, ready_timeout, env=ONE_THREAD)


def stop_servers(processes: Iterable[ServerProcess], timeout: float = 30.0) -> None:
    """Stop them in parallel (:func:`shoal.launch.stop_all`); fail unless every one exited cleanly
    (SIGTERM, not SIGKILL) without logging a traceback."""
    processes = list(processes)
    stop_all(processes, timeout)
    failures = [problem for process in processes if (problem := _unclean(process))]
    assert not failures, "\n".join(failures)


def stop_server(process: ServerProcess, timeout: float = 30.0) -> str:
    """:func:`stop_servers` for one; returns its output."""
    stop_servers([process], timeout)
    return process.text()


def _unclean(process: ServerProcess) -> str | None:
    time.sleep(0.1)  # let the output reader catch the last lines
    output = process.text()
    if process.proc.returncode != 0:
        return f"server {process.args} exited with {process.proc.returncode}:\n{output[-4000:]}"
    if "Traceback" in output:
        return f"server {process.args} logged a traceback:\n{output[-4000:]}"
    return None


async def info(node: BaseNode, ticket: Ticket) -> InfoReply:
    return (await node.request(ticket, BLOCKS, Message("info", 1))).reply(InfoReply)


async def forward(node: BaseNode, ticket: Ticket, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    reply = await node.request(ticket, BLOCKS, Message("forward", 1, tensors=list(tensors)))
    return reply.tensors[0]


class Session:
    """One session on one server, over the stream that opened it."""

    def __init__(self, stream: MessageStream, reply: OpenReply):
        self.stream, self.id, self.token, self.max_length = stream, reply.session, reply.token, reply.max_length

    @classmethod
    async def open(cls, node: BaseNode, ticket: Ticket, max_length: int, batch_size: int = 1) -> Session:
        stream = await node.open_stream(ticket, BLOCKS)
        try:
            reply = await stream.request(Message("open", 1, OpenRequest(max_length=max_length, batch_size=batch_size)))
        except BaseException:
            await stream.finish()
            raise
        return cls(stream, reply.reply(OpenReply))

    def push_hop(
        self, ticket: Ticket, previous: str, *, step: int, position: int, n: int, receipt: bool = False
    ) -> PushHop:
        """Where the server ``previous`` (a peer id) pushes step ``step`` (``n`` positions at
        ``position``) of this session (``ticket``: this session's server), with the token bound to
        that peer and that step."""
        token = push_token(self.token, previous, step=step, position=position, n=n, receipt=receipt)
        return PushHop(ticket=str(ticket), session=self.id, token=token)

    async def send_step(
        self,
        position: int,
        tensors: Sequence[torch.Tensor],
        session_id: str | None = None,
        push=(),
        step_id: int | None = None,
    ) -> int:
        """Send a step without waiting for its reply; returns its id (``step_id``: one taken from
        the stream's ``next_id`` already, e.g. to bind push tokens to it)."""
        step_id = self.stream.next_id() if step_id is None else step_id
        meta = StepRequest(session=self.id if session_id is None else session_id, position=position, push=tuple(push))
        await self.stream.send(Message("step", step_id, meta, list(tensors)))
        return step_id

    async def result(self, step_id: int, timeout: float = 10.0) -> tuple[StepReply, torch.Tensor]:
        """The reply to step ``step_id`` (an error reply is raised as its :class:`RemoteError`)."""
        reply = await self.stream.recv(timeout)
        if reply.kind == "error":
            raise remote_error(*reply.error_info())
        assert reply.id == step_id, f"reply {reply.id} to step {step_id}"
        return reply.reply(StepReply), reply.tensors[0]

    async def step(self, position: int, tensors: Sequence[torch.Tensor], session_id: str | None = None) -> torch.Tensor:
        meta, out = await self.result(await self.send_step(position, tensors, session_id))
        assert meta.position == position + tensors[0].shape[1]
        return out

    async def close(self) -> None:
        try:
            await self.stream.request(Message("close", self.stream.next_id()), timeout=10)
        finally:
            await self.stream.finish()


async def wait_for_info(
    node: BaseNode, ticket: Ticket, done: Callable[[InfoReply], bool], timeout: float = 10.0, interval: float = 0.01
) -> InfoReply:
    """Poll ``info`` until ``done(reply)``; fail with the last reply after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        reply = await info(node, ticket)
        if done(reply):
            return reply
        if time.monotonic() > deadline:
            raise AssertionError(f"server state not reached within {timeout} s: {reply}")
        await asyncio.sleep(interval)


@torch.inference_mode()
def local_forward(span, tensors: Sequence[torch.Tensor], cache=None, past_length: int = 0) -> torch.Tensor:
    """What a server hosting ``span`` should answer for ``[hidden, position_ids(, mask)]``."""
    mask = tensors[2] if len(tensors) == 3 else None
    return span(tensors[0], tensors[1], mask, cache=cache, past_length=past_length).to(tensors[0].dtype)


# ---- checkpoints -------------------------------------------------------------------------------
def shard_files(model_dir: Path) -> dict[str, set[str]]:
    """Shard file -> tensor names, from the checkpoint index."""
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map(model_dir).items():
        shards.setdefault(shard, set()).add(name)
    return shards


def copy_keeping(model_dir: Path, out_dir: Path, keep: Callable[[str], bool]) -> Path:
    """Copy a sharded checkpoint with only the shards whose every tensor ``keep(name)`` accepts
    (config, index and other small files are copied as they are)."""
    out_dir.mkdir(parents=True)
    shards = shard_files(model_dir)
    for path in model_dir.iterdir():
        if path.name in shards:
            if all(keep(name) for name in shards[path.name]):
                shutil.copy2(path, out_dir / path.name)
        elif path.is_file():
            shutil.copy2(path, out_dir / path.name)
    assert (out_dir / INDEX_FILE).is_file()
    return out_dir


def block_prefixes(blocks: Iterable[int]) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}." for i in blocks)


# ---- process memory ----------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def peak_rss_bytes(pid: int) -> int:
    """The process's high-water resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")
