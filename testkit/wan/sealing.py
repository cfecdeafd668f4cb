"""Sealing: a node's UDP sockets accept datagrams from the emulator's host only.

iroh tells its peers its own socket addresses inside the QUIC connection and probes theirs; on
loopback the probes succeed and the connection leaves the emulator within its first requests. A
classic BPF filter on the node's sockets makes the kernel drop every datagram not sent from the
emulator, so the probes fail and the connection stays on the proxies."""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Iterable, Iterator

from testkit.wan.addresses import Address, bound_at, socket_name

_SO_ATTACH_FILTER = 26  # Linux
_SKF_NET_OFF = -0x100000  # classic BPF: offsets relative to the IP header
_SYS_PIDFD_OPEN, _SYS_PIDFD_GETFD = 434, 438  # x86_64 and aarch64 alike


def _filter_program(allowed_ipv4: str | None) -> bytes:
    """A classic BPF socket filter: keep IPv4 datagrams whose source is ``allowed_ipv4``, drop
    everything else (None: drop all)."""
    instruction = struct.Struct("=HBBI")
    drop_all = [instruction.pack(0x06, 0, 0, 0)]  # ret #0
    if allowed_ipv4 is None:
        return b"".join(drop_all)
    source = int(ipaddress.IPv4Address(allowed_ipv4))
    return b"".join(
        [
            instruction.pack(0x20, 0, 0, (_SKF_NET_OFF + 12) & 0xFFFFFFFF),  # ld [ip source]
            instruction.pack(0x15, 0, 1, source),  # jeq #allowed, keep, drop
            instruction.pack(0x06, 0, 0, 0xFFFFFFFF),  # keep: ret #-1 (the whole datagram)
            *drop_all,
        ]
    )


def _attach_filter(sock: socket.socket, program: bytes) -> None:
    code = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HL", len(program) // 8, ctypes.addressof(code))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)


def _process_sockets(pid: int) -> Iterator[socket.socket]:
    """The UDP sockets of process ``pid`` (duplicates: closing them leaves the originals open;
    another process's through pidfd_getfd, which needs ptrace rights over it, e.g. a child)."""
    own = pid == os.getpid()
    libc = None if own else ctypes.CDLL(None, use_errno=True)
    pidfd = -1 if own else libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
    if pidfd < 0 and not own:
        raise OSError(ctypes.get_errno(), f"pidfd_open({pid})")
    try:
        for entry in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{entry}").startswith("socket:"):
                    continue
                fd = os.dup(int(entry)) if own else libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(entry), 0)
                if fd < 0:
                    code = ctypes.get_errno()
                    if code in (errno.EPERM, errno.EACCES):  # no ptrace rights over it: say so
                        raise PermissionError(code, f"pidfd_getfd on process {pid} (seal it from inside instead)")
                    continue
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            if sock.type == socket.SOCK_DGRAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                yield sock
            sock.close()
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def bound_addresses(pid: int) -> list[Address]:
    """The loopback addresses the unconnected UDP sockets of process ``pid`` receive at (a socket
    bound to an unspecified host: that family's loopback)."""
    found = []
    for sock in _process_sockets(pid):
        with sock:
            host, port = socket_name(sock)
            try:
                sock.getpeername()
                continue  # connected: a socket that learns a route's source address, not one a node receives on
            except OSError:
                pass
        ip = ipaddress.ip_address(host)
        if ip.is_unspecified:
            host = "127.0.0.1" if ip.version == 4 else "::1"
        if ipaddress.ip_address(host).is_loopback:
            found.append((host, port))
    return sorted(found)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an ended child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_bound(pid: int, timeout: float, poll: float = 0.01) -> list[Address]:
    """The loopback UDP addresses of process ``pid`` once it has bound them: an IPv4 one, and the
    IPv6 one an iroh endpoint binds in the same call (given up on a second after the IPv4 one).
    Raises if the process ends or binds none within ``timeout``."""
    deadline = time.monotonic() + timeout
    ipv4_since = None
    while True:
        if not _running(pid):
            raise ProcessLookupError(f"process {pid} ended before it bound a UDP socket")
        addrs = bound_addresses(pid)
        families = {ipaddress.ip_address(h).version for h, _ in addrs}
        if 4 in families:
            ipv4_since = ipv4_since or time.monotonic()
            if 6 in families or time.monotonic() - ipv4_since > 1.0:
                return addrs
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} bound no loopback UDP socket within {timeout:g} s")
        time.sleep(poll)


def wait_sealed(pid: int, emulator_host: str, timeout: float) -> list[Address]:
    """:func:`wait_bound`, then :func:`seal` what was found; once more if a socket found went away
    meanwhile (a short-lived one of the starting process). The addresses sealed."""
    tries = 3
    while True:
        addrs = wait_bound(pid, timeout)
        try:
            seal(addrs, emulator_host, pid)
            return addrs
        except LookupError:
            tries -= 1
            if not tries:
                raise


def seal(addrs: Iterable[Address], emulator_host: str, pid: int | None = None) -> int:
    """Make the UDP sockets bound at ``addrs`` in process ``pid`` (default: this one) drop every
    datagram not sent from ``emulator_host``: iroh tells its peers its own socket addresses inside
    the QUIC connection and probes theirs, so unsealed loopback nodes find each other directly
    and move their connection off the emulator within a round trip or two. Returns how many
    sockets were sealed (every address must be found)."""
    wanted = set(addrs)
    found: set[Address] = set()
    for sock in _process_sockets(os.getpid() if pid is None else pid):
        with sock:
            matches = {a for a in wanted if bound_at(a, *socket_name(sock))}
            if matches:
                _attach_filter(sock, _filter_program(emulator_host if sock.family == socket.AF_INET else None))
                found |= matches
    missing = wanted - found
    if missing:
        raise LookupError(f"no UDP socket bound at {sorted(missing)} in process {pid or os.getpid()}: pass its pid")
    return len(found)


__all__ = ["bound_addresses", "seal", "wait_bound", "wait_sealed"]
