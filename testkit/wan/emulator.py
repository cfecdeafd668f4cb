"""The emulator proper: one proxy per node, a pipe per direction with its conditions and counters,
and the thread that moves datagrams between them (the topology is described in :mod:`testkit.wan`)."""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import random
import select
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from heapq import heappop, heappush
from typing import Any, TypeVar

from shoal.transport.ticket import Ticket
from testkit.wan.addresses import Address, first_ipv4, parse_address, socket_name
from testkit.wan.links import DirectionStats, Lateness, LinkConditions, Pipe
from testkit.wan.sealing import seal, wait_bound, wait_sealed

T = TypeVar("T")

_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux value; the kernel's receive time
_TIMESPEC = struct.Struct("@qq")
_CMSG_SPACE = socket.CMSG_SPACE(_TIMESPEC.size)
_MAX_DATAGRAM = 65535
_SOCKET_BUFFER = 4 << 20
_BATCH = 256  # datagrams read from one socket before the others get a turn
_MAX_LEAD = 0.0003  # at most this early
_LEAD_STEP = 0.0002


@dataclass(frozen=True)
class WanNode:
    """A node as the emulator knows it: who it is, where it really listens, where others reach it."""

    name: str
    peer_id: str
    addr: Address  # the node's IPv4 socket: what the proxy forwards to
    own_addrs: frozenset[Address]  # every address of its own ticket: how its datagrams are recognised
    proxy_addr: Address  # P_D: the only address other nodes are given for it

    def ticket(self, swarm_id: str | None = None) -> Ticket:
        if not self.peer_id:
            raise LookupError(f"node {self.name!r} was attached without its peer id: it hands out its own ticket")
        host, port = self.proxy_addr
        return Ticket(self.peer_id, (f"{host}:{port}",), None, swarm_id)


class WanEmulator:
    """The proxies, their thread and the per-direction conditions (see :mod:`testkit.wan`).

    Every public method may be called from any thread; the emulator's own state is only touched on
    its thread (calls are handed over and waited for). ``conditions(src, dst)``, if given, says
    what each new direction starts with (e.g. a round trip drawn per link), else ``default``."""

    def __init__(
        self,
        default: LinkConditions = LinkConditions(),
        seed: int = 0,
        host: str = "127.0.0.2",
        conditions: Callable[[str, str], LinkConditions] | None = None,
    ):
        self.default = default
        self._conditions_of = conditions  # a new direction's (src, dst) conditions; None: default
        self.seed = seed
        self.host = host
        self._nodes: dict[str, WanNode] = {}
        self._by_addr: dict[Address, str] = {}
        self._proxies: dict[str, socket.socket] = {}
        self._upstreams: dict[tuple[str, str], socket.socket] = {}
        self._return_addrs: dict[tuple[str, str], Address] = {}  # where S's datagrams to P_D came from
        self._pipes: dict[tuple[str, str], Pipe] = {}
        self._heap: list[tuple[float, int, socket.socket, Address, bytes, Pipe]] = []
        self._seq = 0
        self._lead = 0.0  # how early the thread wakes for a delivery (see _deliver_due)
        self._stray = 0
        self._retired = DirectionStats()  # the counters of removed nodes' directions
        self._lateness = Lateness()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closing = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="wan-emulator", daemon=True)
        self._thread.start()

    # ---- public API (any thread) -------------------------------------------------------------
    def add_node(self, ticket: Ticket, name: str | None = None, pid: int | None = None, sealed: bool = True) -> WanNode:
        """Register a node by its own ticket (peer id + bound addresses) and open its proxy.

        ``sealed`` (the default) makes the node's sockets, in process ``pid`` (default: this
        one), drop every datagram that does not come from the emulator (:func:`seal`): without
        it, iroh's address exchange connects loopback nodes around the emulator."""
        addrs = self._checked_addrs(ticket)
        if sealed:
            seal(addrs, self.host, pid)
        return self._call(lambda: self._add_node(name or ticket.peer_id[:10], ticket.peer_id, addrs))

    def _checked_addrs(self, ticket: Ticket) -> list[Address]:
        addrs = [parse_address(a) for a in ticket.addrs]
        if not addrs or any(not ipaddress.ip_address(h).is_loopback for h, _ in addrs):
            raise ValueError(f"node {ticket.peer_id[:10]} must be bound to loopback only, has {ticket.addrs}")
        if any(h == self.host for h, _ in addrs):
            raise ValueError(f"node {ticket.peer_id[:10]} is bound to the emulator's own host {self.host}")
        if ticket.relay_url is not None:
            raise ValueError(f"node {ticket.peer_id[:10]} uses a relay ({ticket.relay_url}): disable relays")
        first_ipv4(addrs)
        return addrs

    def readdress(self, name: str, ticket: Ticket, pid: int | None = None, sealed: bool = True) -> WanNode:
        """Point ``name`` at the node's new addresses (a server restarted with the same identity,
        elsewhere): its proxy, so every ticket handed out for it, stays the same."""
        addrs = self._checked_addrs(ticket)
        if ticket.peer_id != self._nodes[name].peer_id:
            raise ValueError(f"{name!r} is {self._nodes[name].peer_id[:10]}, the ticket {ticket.peer_id[:10]}")
        if sealed:
            seal(addrs, self.host, pid)

        def apply() -> WanNode:
            old = self._nodes[name]
            for addr in old.own_addrs:
                self._by_addr.pop(addr, None)
            self._claim(name, addrs)
            node = self._nodes[name] = replace(old, addr=first_ipv4(addrs), own_addrs=frozenset(addrs))
            return node

        return self._call(apply)

    def reserve(self, name: str) -> Address:
        """Open ``name``'s proxy before its node exists: the address to start the node with as the
        one it announces (``shoal serve --announce-addr HOST:PORT``), so that every ticket and swarm
        record it hands out is the proxy's. :meth:`attach` registers the node once it runs."""
        return self._call(lambda: self._reserve(name))

    def attach(self, name: str, pid: int, peer_id: str = "", timeout: float = 30.0, sealed: bool = True) -> WanNode:
        """Register the node of process ``pid`` (a child of this one, or this one) as ``name``, at
        the proxy :meth:`reserve` opened (else a new one), as soon as the process has bound its
        loopback UDP sockets: they are found and sealed there (:func:`wait_bound`), so this may
        run while the process starts. What it sends before is dropped as stray and resent by QUIC.
        ``peer_id`` may stay empty when nobody needs :meth:`ticket` (the node announces the proxy)."""
        addrs = wait_sealed(pid, self.host, timeout) if sealed else wait_bound(pid, timeout)
        self._checked_addrs(Ticket(peer_id, tuple(_text(a) for a in addrs)))
        return self._call(lambda: self._add_node(name, peer_id, addrs))

    def remove(self, name: str) -> None:
        """Forget ``name`` (its process ended): its proxy and per-pair sockets close, its addresses
        may be claimed by a new node, its directions' counters join :meth:`totals`."""
        self._call(lambda: self._remove(name))

    def totals(self) -> DirectionStats:
        """Every direction's counters summed, removed nodes' included."""

        def total() -> DirectionStats:
            result = replace(self._retired)
            for pipe in self._pipes.values():
                result.add(pipe.stats)
            return result

        return self._call(total)

    def lateness(self) -> Lateness:
        """How late the datagrams forwarded so far left, against their due times."""
        return self._call(lambda: replace(self._lateness))

    def node(self, name: str) -> WanNode:
        return self._nodes[name]

    @property
    def nodes(self) -> list[WanNode]:
        return list(self._nodes.values())

    def ticket(self, name: str, swarm_id: str | None = None) -> Ticket:
        """The ticket every other node uses to reach ``name``: its peer id, the proxy's address."""
        return self._nodes[name].ticket(swarm_id)

    def set_link(self, a: str, b: str, conditions: LinkConditions | None = None, **changes: Any) -> None:
        """Both directions between ``a`` and ``b``: ``conditions``, or the current ones with
        ``changes`` (e.g. ``loss=1.0``). Datagrams already in flight keep their delivery times."""
        self.set_direction(a, b, conditions, **changes)
        self.set_direction(b, a, conditions, **changes)

    def set_direction(self, src: str, dst: str, conditions: LinkConditions | None = None, **changes: Any) -> None:
        def apply() -> None:
            pipe = self._pipes[(src, dst)]
            pipe.conditions = replace(conditions or pipe.conditions, **changes)

        self._call(apply)

    def conditions(self, src: str, dst: str) -> LinkConditions:
        return self._pipes[(src, dst)].conditions

    def stats(self, src: str, dst: str) -> DirectionStats:
        """A snapshot of the counters of datagrams from ``src`` to ``dst``."""
        return self._call(lambda: replace(self._pipes[(src, dst)].stats))

    def all_stats(self) -> dict[tuple[str, str], DirectionStats]:
        return self._call(lambda: {key: replace(pipe.stats) for key, pipe in self._pipes.items()})

    def reset_stats(self) -> None:
        def reset() -> None:
            for pipe in self._pipes.values():
                pipe.stats = DirectionStats()
            self._stray = 0

        self._call(reset)

    @property
    def stray_datagrams(self) -> int:
        """Datagrams that reached an emulator socket from an address it does not expect there."""
        return self._stray

    def socket_addresses(self) -> set[Address]:
        """Every address the emulator sends from (proxies and per-pair sockets)."""
        return self._call(lambda: {socket_name(s) for s in [*self._proxies.values(), *self._upstreams.values()]})

    def in_flight(self) -> int:
        return len(self._heap)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._wake()
        self._thread.join(5.0)
        for sock in [*self._proxies.values(), *self._upstreams.values(), self._wake_r, self._wake_w]:
            sock.close()
        self._selector.close()
        while self._commands:  # handed over as the thread stopped
            self._commands.popleft()[1].set_exception(RuntimeError("the WAN emulator is closed"))

    def __enter__(self) -> WanEmulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the emulator thread -----------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        if threading.current_thread() is self._thread:
            return fn()
        if self._failure is not None:
            raise RuntimeError("the WAN emulator's thread failed") from self._failure
        if self._closing:
            raise RuntimeError("the WAN emulator is closed")
        future: Future = Future()
        self._commands.append((fn, future))
        self._wake()
        return future.result(timeout=10.0)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_w.send(b"w")

    def _open_socket(self, role: tuple) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        sock.bind((self.host, 0))
        self._selector.register(sock, selectors.EVENT_READ, role)
        return sock

    def _add_node(self, name: str, peer_id: str, addrs: list[Address]) -> WanNode:
        if name in self._nodes:
            raise ValueError(f"a node named {name!r} is already registered")
        self._claim(name, addrs)
        proxy = self._proxies.get(name) or self._open_socket(("proxy", name))  # reserved, or opened now
        node = WanNode(name, peer_id, first_ipv4(addrs), frozenset(addrs), socket_name(proxy))
        for other in self._nodes:
            for key in ((name, other), (other, name)):
                first = self._conditions_of(*key) if self._conditions_of is not None else self.default
                self._pipes[key] = Pipe(first, random.Random(f"{self.seed}/{key[0]}/{key[1]}"))
        self._nodes[name] = node
        self._proxies[name] = proxy
        return node

    def _reserve(self, name: str) -> Address:
        if name in self._proxies:
            raise ValueError(f"a node named {name!r} is already registered or reserved")
        self._proxies[name] = self._open_socket(("proxy", name))
        return socket_name(self._proxies[name])

    def _remove(self, name: str) -> None:
        node = self._nodes.pop(name, None)
        for addr in node.own_addrs if node is not None else ():
            self._by_addr.pop(addr, None)
        sockets = [self._proxies.pop(name)] if name in self._proxies else []
        for key in [k for k in self._upstreams if name in k]:
            sockets.append(self._upstreams.pop(key))
            self._return_addrs.pop(key, None)
        for sock in sockets:  # datagrams still queued for them are counted dropped when due
            self._selector.unregister(sock)
            sock.close()
        for key in [k for k in self._pipes if name in k]:
            self._retired.add(self._pipes.pop(key).stats)

    def _claim(self, name: str, addrs: list[Address]) -> None:
        taken = [a for a in addrs if self._by_addr.get(a, name) != name]
        if taken:
            raise ValueError(f"address {taken[0]} already belongs to node {self._by_addr[taken[0]]!r}")
        for addr in addrs:
            self._by_addr[addr] = name

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # surfaced by the next call from outside
            self._failure = exc
            self._closing = True
            while self._commands:
                self._commands.popleft()[1].set_exception(exc)
            raise

    def _loop(self) -> None:
        _fine_timer_slack()
        wait_fd = self._selector.fileno()
        while not self._closing:
            ready: Any = True
            timeout = self._heap[0][0] - self._lead - time.time() if self._heap else None
            # select() on the selector's own descriptor waits with microsecond precision (epoll's
            # timeout is whole milliseconds); the selector then only collects what is ready
            if timeout is None or timeout > 0:
                try:
                    ready = select.select([wait_fd], [], [], timeout)[0]
                except ValueError:  # descriptor beyond FD_SETSIZE: millisecond waits it is
                    ready = self._selector.select(timeout)
            self._deliver_due(timer_woke=not ready)
            for key, _ in self._selector.select(0):
                role = key.data
                if role is None:
                    self._run_commands()
                elif role[0] == "proxy":
                    self._receive(key.fileobj, self._from_source, role[1])
                else:
                    self._receive(key.fileobj, self._from_destination, role[1], role[2])
            self._deliver_due()

    def _run_commands(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        while self._commands:
            fn, future = self._commands.popleft()
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _receive(self, sock: Any, handle: Callable[..., None], *role: str) -> None:
        for _ in range(_BATCH):
            try:
                data, ancillary, _flags, source = sock.recvmsg(_MAX_DATAGRAM, _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # e.g. an ICMP error queued on the socket
            arrived = None
            for level, kind, value in ancillary:
                if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(value) >= _TIMESPEC.size:
                    seconds, nanoseconds = _TIMESPEC.unpack_from(value)
                    arrived = seconds + nanoseconds * 1e-9
            handle(data, (source[0], source[1]), time.time() if arrived is None else arrived, *role)

    def _from_source(self, data: bytes, source: Address, arrived: float, dst: str) -> None:
        """A datagram at D's proxy: from S (known by its address) to D, via U_SD."""
        src = self._by_addr.get(source)
        if src is None or src == dst or dst not in self._nodes:  # unknown sender, or D only reserved
            self._stray += 1
            return
        key = (src, dst)
        upstream = self._upstreams.get(key)
        if upstream is None:
            upstream = self._upstreams[key] = self._open_socket(("upstream", src, dst))
        self._return_addrs[key] = source
        self._schedule(self._pipes[key], arrived, data, upstream, self._nodes[dst].addr)

    def _from_destination(self, data: bytes, source: Address, arrived: float, src: str, dst: str) -> None:
        """A datagram at U_SD: D answering S, handed to S from D's proxy."""
        if source != self._nodes[dst].addr:
            self._stray += 1
            return
        self._schedule(self._pipes[(dst, src)], arrived, data, self._proxies[dst], self._return_addrs[(src, dst)])

    def _schedule(self, pipe: Pipe, arrived: float, data: bytes, sock: socket.socket, target: Address) -> None:
        due = pipe.admit(arrived, len(data))
        if due is not None:
            self._seq += 1
            heappush(self._heap, (due, self._seq, sock, target, data, pipe))

    def _deliver_due(self, timer_woke: bool = False) -> None:
        """Send what is due. The thread wakes ``_lead`` seconds before a delivery is due: that
        lead tracks how late wake-ups are (the OS's timer, the interpreter), measured on every
        wake-up by the timer, so deliveries leave on time on average instead of a fraction of a
        millisecond late (never more than ``_MAX_LEAD`` early)."""
        heap, now = self._heap, time.time()
        while heap and heap[0][0] <= now + self._lead:
            due, _seq, sock, target, data, pipe = heappop(heap)
            if timer_woke:
                # a step per wake-up, bounded: a wake-up delayed by a busy machine must not
                # make later deliveries early
                error = min(_LEAD_STEP, max(-_LEAD_STEP, time.time() - due))
                self._lead = min(_MAX_LEAD, max(0.0, self._lead + 0.1 * error))
                timer_woke = False
            try:
                sock.sendto(data, target)
            except OSError:  # the kernel's buffer is full, or the node is gone
                pipe.drop(len(data))
                continue
            pipe.stats.forwarded_datagrams += 1
            pipe.stats.forwarded_bytes += len(data)
            self._lateness.note(time.time() - due)
            if not heap or heap[0][0] > now + self._lead:
                now = time.time()


def _text(addr: Address) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _fine_timer_slack() -> None:
    """Ask Linux to end this thread's sleeps on time (the default slack is 50 us)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns


__all__ = ["DirectionStats", "Lateness", "LinkConditions", "WanEmulator", "WanNode"]
