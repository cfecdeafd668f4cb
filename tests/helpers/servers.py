"""Block servers in child processes, and a thin client for their ``shoal/blocks/1`` protocol.

    python -m tests.helpers.servers hold-session TICKET MAX_LENGTH HIDDEN_SIZE

opens a session on the server of ``TICKET``, takes one step, prints ``session: <id>`` and then
waits for its standard input to close (tests kill it to play a client that vanishes mid-session).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import psutil
import torch

from shoal.checkpoints import weight_map
from shoal.checkpoints.loading import INDEX_FILE
from shoal.protocols import BLOCKS
from shoal.transport import MessageStream, Node, Ticket, TransportConfig
from shoal.wire import Message
from tests.helpers.processes import PeerProcess

CLIENT_CONFIG = TransportConfig(bind_addr="127.0.0.1:0")


def start_server(model_dir: str | Path, blocks: str, *flags: str, ready_timeout: float = 180.0) -> PeerProcess:
    """``shoal serve`` on loopback with one compute thread."""
    args = ["-m", "shoal.cli.main", "serve", str(model_dir), "--blocks", blocks, "--host", "127.0.0.1"]
    return PeerProcess([*args, "--num-threads", "1", *flags], ready_timeout=ready_timeout)


def stop_servers(processes: Iterable[PeerProcess], timeout: float = 30.0) -> None:
    """:func:`stop_server` for several, shutting down in parallel; stops them all before failing."""
    processes = list(processes)
    for process in processes:
        _terminate(process)
    failures = []
    for process in processes:
        try:
            stop_server(process, timeout)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)


def _terminate(process: PeerProcess) -> None:
    """One SIGTERM only: a second one could land after the server's event loop removed its
    handler, and kill it mid-shutdown."""
    if process.proc.poll() is None and not getattr(process, "terminated", False):
        process.proc.terminate()
        process.terminated = True


def stop_server(process: PeerProcess, timeout: float = 30.0) -> str:
    """SIGTERM (a server's clean shutdown), SIGKILL if it does not exit in time; fail unless it
    exited cleanly without logging a traceback. Returns its output."""
    _terminate(process)
    try:
        process.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"server {process.args} ignored SIGTERM for {timeout} s") from None
    time.sleep(0.1)  # let the output reader catch the last lines
    output = "".join(process.output)
    assert process.proc.returncode == 0, f"server exited with {process.proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, f"server logged a traceback:\n{output[-4000:]}"
    return output


def inputs(
    hidden_size: int, n: int, start: int = 0, batch: int = 1, seed: int = 0, mask: bool = False
) -> list[torch.Tensor]:
    """``[hidden, position_ids(, attention_mask)]`` for ``n`` new tokens at positions ``start...``."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, n, hidden_size, generator=generator)
    position_ids = torch.arange(start, start + n).expand(batch, n).contiguous()
    tensors = [hidden, position_ids]
    if mask:
        tensors.append(torch.ones(batch, start + n, dtype=torch.bool))
    return tensors


async def info(node: Node, ticket: Ticket) -> dict:
    return (await node.request(ticket, BLOCKS, Message("info", 1))).meta


async def forward(node: Node, ticket: Ticket, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    reply = await node.request(ticket, BLOCKS, Message("forward", 1, {}, list(tensors)))
    return reply.tensors[0]


class Session:
    """One session on one server, over the stream that opened it."""

    def __init__(self, stream: MessageStream, session_id: str, max_length: int):
        self.stream, self.id, self.max_length = stream, session_id, max_length

    @classmethod
    async def open(cls, node: Node, ticket: Ticket, max_length: int, batch_size: int = 1) -> Session:
        stream = await node.open_stream(ticket, BLOCKS)
        try:
            reply = await stream.request(Message("open", 1, {"max_length": max_length, "batch_size": batch_size}))
        except BaseException:
            await stream.finish()
            raise
        return cls(stream, reply.meta["session"], reply.meta["max_length"])

    async def step(self, position: int, tensors: Sequence[torch.Tensor], session_id: str | None = None) -> torch.Tensor:
        meta = {"session": self.id if session_id is None else session_id, "position": position}
        reply = await self.stream.request(Message("step", self.stream.next_id(), meta, list(tensors)))
        assert reply.meta["position"] == position + tensors[0].shape[1]
        return reply.tensors[0]

    async def close(self) -> None:
        try:
            await self.stream.request(Message("close", self.stream.next_id()), timeout=10)
        finally:
            await self.stream.finish()


async def wait_for_info(
    node: Node, ticket: Ticket, done: Callable[[dict], bool], timeout: float = 60.0, interval: float = 0.1
) -> dict:
    """Poll ``info`` until ``done(meta)``; fail with the last meta after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        meta = await info(node, ticket)
        if done(meta):
            return meta
        if time.monotonic() > deadline:
            raise AssertionError(f"server state not reached within {timeout} s: {meta}")
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


# ---- a client in its own process ---------------------------------------------------------------
class SessionHolder:
    """A child process holding one open session (see the module docstring); :meth:`kill` makes it
    vanish without closing anything."""

    def __init__(self, ticket: Ticket, max_length: int, hidden_size: int, timeout: float = 120.0):
        cmd = [sys.executable, "-m", "tests.helpers.servers", "hold-session", str(ticket)]
        self.proc = subprocess.Popen(
            [*cmd, str(max_length), str(hidden_size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("session: "):
                self.session_id = line.split()[1]
                return
        self.kill()
        raise RuntimeError(f"session holder did not open a session:\n{''.join(lines)[-4000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


async def _hold_session(ticket: Ticket, max_length: int, hidden_size: int) -> None:
    node = await Node.start(CLIENT_CONFIG)
    session = await Session.open(node, ticket, max_length)
    await session.step(0, inputs(hidden_size, 2))
    print(f"session: {session.id}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await session.close()
    await node.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    hold = sub.add_parser("hold-session")
    hold.add_argument("ticket")
    hold.add_argument("max_length", type=int)
    hold.add_argument("hidden_size", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    asyncio.run(_hold_session(Ticket.parse(args.ticket), args.max_length, args.hidden_size))


if __name__ == "__main__":
    main()
