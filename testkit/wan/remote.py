"""The emulator in a process of its own, for a harness whose own process is busy.

:class:`~testkit.wan.WanEmulator`'s thread needs the GIL for every delivery: in a process whose
other threads run Python (a benchmark driver reading HTTP streams, starting servers, sampling
memory) a delivery waits for the interpreter's switch interval, or for a thread that holds the GIL
while the OS has it descheduled. :class:`RemoteEmulator` runs the emulator in a child process
(:func:`serve`, serving a :mod:`multiprocessing` manager on a Unix socket;
started as a plain child, so nothing of the caller's ``__main__`` is imported there) whose only
busy thread is the emulator's, and keeps that process at normal scheduling priority where allowed (a harness run
under ``nice`` must not slow its network down with it). Sealing stays in this process (the nodes
are its children: it has the rights pidfd_getfd needs); calls are forwarded and their results
pickled back.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.managers import BaseManager, BaseProxy
from typing import Any

from shoal.transport.ticket import Ticket
from testkit.wan.addresses import Address, parse_address
from testkit.wan.emulator import WanEmulator, WanNode
from testkit.wan.links import DirectionStats, Lateness, LinkConditions
from testkit.wan.sealing import seal, wait_sealed


class _EmulatorProxy(BaseProxy):
    """The child's emulator: ``call(method, *args)``, ``attribute(name)``."""

    _exposed_ = ("reserve", "add_node", "remove", "totals", "lateness", "stats", "ticket", "close", "__getattribute__")

    def call(self, method: str, *args: Any) -> Any:
        return self._callmethod(method, args)

    def attribute(self, name: str) -> Any:
        return self._callmethod("__getattribute__", (name,))


class _Manager(BaseManager):
    pass


_Manager.register("WanEmulator", WanEmulator, proxytype=_EmulatorProxy)


def _normal_priority() -> None:
    with contextlib.suppress(OSError):  # only a privileged process may lower its niceness
        os.setpriority(os.PRIO_PROCESS, 0, 0)


class RemoteEmulator:
    """A :class:`~testkit.wan.WanEmulator` (same arguments) in a child process; the methods a
    harness wires nodes with, with the same meaning. ``conditions`` must pickle (a module-level
    function, or a method of a module-level value)."""

    def __init__(
        self,
        default: LinkConditions = LinkConditions(),
        seed: int = 0,
        host: str = "127.0.0.2",
        conditions: Callable[[str, str], LinkConditions] | None = None,
    ):
        self.host = host
        authkey = os.urandom(16)
        # its standard input stays open while this process lives: the child ends when it closes
        self._child = subprocess.Popen(
            [sys.executable, "-c", "from testkit.wan.remote import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid: int = self._child.pid
        try:
            assert self._child.stdin is not None and self._child.stdout is not None
            self._child.stdin.write(authkey.hex() + "\n")
            self._child.stdin.flush()
            address = self._child.stdout.readline().strip()
            if not address:
                raise RuntimeError("the WAN emulator's process ended before it served")
            self._manager = _Manager(address=address, authkey=authkey)
            self._manager.connect()
            self._emulator = self._manager.WanEmulator(default, seed, host, conditions)  # type: ignore[attr-defined]
        except BaseException:
            self._end_child()
            raise

    def reserve(self, name: str) -> Address:
        host, port = self._emulator.call("reserve", name)
        return host, port

    def add_node(self, ticket: Ticket, name: str | None = None, pid: int | None = None) -> WanNode:
        """A node by its own ticket, sealed here (in process ``pid``, default this one)."""
        seal([parse_address(a) for a in ticket.addrs], self.host, pid)
        return self._emulator.call("add_node", ticket, name, None, False)

    def attach(self, name: str, pid: int, peer_id: str = "", timeout: float = 30.0) -> WanNode:
        """As :meth:`WanEmulator.attach`: found and sealed here, registered there."""
        addrs = wait_sealed(pid, self.host, timeout)
        texts = tuple(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in addrs)
        return self._emulator.call("add_node", Ticket(peer_id, texts), name, None, False)

    def remove(self, name: str) -> None:
        self._emulator.call("remove", name)

    def ticket(self, name: str, swarm_id: str | None = None) -> Ticket:
        return self._emulator.call("ticket", name, swarm_id)

    @property
    def nodes(self) -> list[WanNode]:
        return self._emulator.attribute("nodes")

    def stats(self, src: str, dst: str) -> DirectionStats:
        return self._emulator.call("stats", src, dst)

    def totals(self) -> DirectionStats:
        return self._emulator.call("totals")

    def lateness(self) -> Lateness:
        return self._emulator.call("lateness")

    @property
    def stray_datagrams(self) -> int:
        return self._emulator.attribute("stray_datagrams")

    def close(self) -> None:
        try:
            with contextlib.suppress(Exception):
                self._emulator.call("close")
                del self._emulator  # the proxy's release, while the server still answers
        finally:
            self._end_child()

    def _end_child(self) -> None:
        with contextlib.suppress(OSError):
            self._child.stdin.close()  # type: ignore[union-attr]
        try:
            self._child.wait(10.0)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait(5.0)

    def __enter__(self) -> RemoteEmulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve() -> None:
    """The child: the manager's server on a Unix socket (its path printed), until stdin closes."""
    _normal_priority()
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    server = _Manager(address=None, authkey=authkey).get_server()
    print(server.address, flush=True)

    def watch_parent() -> None:
        sys.stdin.read()  # EOF: the parent closed it, or ended
        os._exit(0)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    server.serve_forever()


__all__ = ["RemoteEmulator"]
