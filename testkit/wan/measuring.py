"""Measuring through the emulator, and checking that nothing went around it: a packet capture on
``lo``, the kernel's drop counters of sealed sockets, round trips of shoal's own requests."""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from shoal.transport.ticket import Ticket
from testkit.wan.addresses import Address, bound_at

if TYPE_CHECKING:
    from testkit.wan.emulator import DirectionStats, WanEmulator

_MAX_DATAGRAM = 65535
_SOCKET_BUFFER = 4 << 20


@dataclass(frozen=True)
class CapturedDatagram:
    src: Address
    dst: Address
    payload_bytes: int
    seen: float = 0.0  # time.monotonic() when the capture read it (after the kernel passed it on)


class LoopbackCapture:
    """Every UDP datagram on ``lo`` while open (a packet socket: needs CAP_NET_RAW, which the
    loopback-only namespace of ``scripts/isolated`` grants). It shows what no proxy counter can:
    traffic that went around the emulator."""

    def __init__(self, interface: str = "lo"):
        eth_p_all = 0x0003
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(eth_p_all))
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        self._sock.bind((interface, 0))
        self._sock.settimeout(0.05)
        self.datagrams: list[CapturedDatagram] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lo-capture", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                packet, link = self._sock.recvfrom(_MAX_DATAGRAM + 128)
            except TimeoutError:
                continue
            except OSError:
                return
            if link[2] == socket.PACKET_OUTGOING:  # loopback shows each packet leaving and arriving
                continue
            datagram = _parse_udp(packet)
            if datagram is not None:
                self.datagrams.append(replace(datagram, seen=time.monotonic()))

    def close(self) -> list[CapturedDatagram]:
        """Stop (after what is already queued was read) and return the datagrams."""
        time.sleep(0.1)
        self._stop = True
        self._thread.join(2.0)
        self._sock.close()
        return self.datagrams

    def __enter__(self) -> LoopbackCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._stop:
            self.close()


def _parse_udp(packet: bytes) -> CapturedDatagram | None:
    """An IPv4 or IPv6 UDP packet's addresses and payload size (extension headers not followed)."""
    if not packet:
        return None
    version = packet[0] >> 4
    if version == 4 and len(packet) >= 28 and packet[9] == socket.IPPROTO_UDP:
        header = (packet[0] & 0x0F) * 4
        total = struct.unpack_from("!H", packet, 2)[0]
        src, dst = socket.inet_ntop(socket.AF_INET, packet[12:16]), socket.inet_ntop(socket.AF_INET, packet[16:20])
    elif version == 6 and len(packet) >= 48 and packet[6] == socket.IPPROTO_UDP:
        header = 40
        total = 40 + struct.unpack_from("!H", packet, 4)[0]
        src, dst = socket.inet_ntop(socket.AF_INET6, packet[8:24]), socket.inet_ntop(socket.AF_INET6, packet[24:40])
    else:
        return None
    sport, dport = struct.unpack_from("!HH", packet, header)
    return CapturedDatagram((src, sport), (dst, dport), max(0, total - header - 8))


async def request_rtts(
    node: Any, ticket: Ticket, count: int, payload_bytes: int = 1024, timeout: float = 10.0
) -> list[float]:
    """``count`` round trips, in seconds, of a ``ping`` on the meta protocol carrying a
    ``payload_bytes`` uint8 tensor, each a :meth:`Node.request` (a fresh stream on the pooled
    connection), after one warm-up request that dials (or re-validates) the connection."""
    import torch

    from shoal.transport import META
    from shoal.wire import Message
    from shoal.wire.schema import Ping

    payload = torch.arange(payload_bytes, dtype=torch.int64).to(torch.uint8)
    reply = await node.request(ticket, META, Message("ping", 1, Ping(), [payload]), timeout=timeout)
    if not torch.equal(reply.tensors[0], payload):
        raise AssertionError("the ping's tensor came back altered")
    samples = []
    for i in range(count):
        started = time.perf_counter()
        await node.request(ticket, META, Message("ping", i + 2, Ping(), [payload]), timeout=timeout)
        samples.append(time.perf_counter() - started)
    return samples


def wait_quiet(wan: WanEmulator, seconds: float = 0.3, limit: float = 5.0) -> None:
    """Block until the emulator ``wan`` forwarded and dropped nothing, and holds nothing in flight,
    for ``seconds`` (e.g. before comparing its counters with a capture); AssertionError after
    ``limit`` seconds."""
    deadline, last, since = time.monotonic() + limit, None, time.monotonic()
    while time.monotonic() < deadline:
        now = sum(s.forwarded_datagrams + s.dropped_datagrams for s in wan.all_stats().values()), wan.in_flight()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= seconds:
            return
        time.sleep(0.02)
    raise AssertionError(f"the WAN emulator did not go quiet for {seconds} s within {limit} s")


def udp_drops(addrs: set[Address]) -> dict[Address, int]:
    """The kernel's drop counter of each UDP socket bound at one of ``addrs`` (this network
    namespace's /proc/net/udp and udp6): datagrams a sealed socket refused show up here."""
    drops: dict[Address, int] = {}
    for table, family in (("/proc/net/udp", socket.AF_INET), ("/proc/net/udp6", socket.AF_INET6)):
        with contextlib.suppress(FileNotFoundError), open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                host_hex, port_hex = fields[1].split(":")
                raw = bytes.fromhex(host_hex)
                # the kernel prints the address as 32-bit words in host order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                host = socket.inet_ntop(family, words) if sys.byteorder == "little" else socket.inet_ntop(family, raw)
                for addr in addrs:
                    if bound_at(addr, host, int(port_hex, 16)):
                        drops[addr] = drops.get(addr, 0) + int(fields[-1])
    return drops


__all__ = ["CapturedDatagram", "LoopbackCapture", "request_rtts", "udp_drops", "wait_quiet"]


def check_capture_against_counters(
    datagrams: Iterable[CapturedDatagram],
    node_addrs: Mapping[str, Iterable[Address]],
    emulator: set[Address],
    stats: Mapping[tuple[str, str], DirectionStats],
    around_before: float = math.inf,
) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Assert that a capture of ``lo`` agrees with the emulator's counters: every payload byte the
    emulator delivered to a node, and every one a node sent to it, is counted on that node's links;
    the emulator's sockets talk to nodes only. Returns, per node, the payload bytes delivered into
    it and sent out of it through the emulator, and the datagrams that reached it straight from
    another node (around the emulator; those seen before ``around_before``), which its seal must
    have dropped."""
    owner = {addr: name for name, addrs in node_addrs.items() for addr in addrs}
    into, out_of, around = Counter(), Counter(), Counter()
    for d in datagrams:
        if d.src in emulator and d.dst in owner:
            into[owner[d.dst]] += d.payload_bytes
        elif d.src in owner and d.dst in emulator:
            out_of[owner[d.src]] += d.payload_bytes
        elif d.src in owner and d.dst in owner:
            around[owner[d.dst]] += d.seen < around_before
        else:
            assert d.src not in emulator and d.dst not in emulator, d  # emulator sockets talk to nodes only
    for name in node_addrs:
        assert into[name] == sum(s.forwarded_bytes for (_, dst), s in stats.items() if dst == name), name
        assert out_of[name] == sum(s.total_bytes for (src, _), s in stats.items() if src == name), name
    return into, out_of, around
