"""Loopback addresses as the emulator and the sealing filter see them."""

from __future__ import annotations

import ipaddress
import socket

Address = tuple[str, int]


def first_ipv4(addrs: list[Address]) -> Address:
    for addr in addrs:
        if ipaddress.ip_address(addr[0]).version == 4:
            return addr
    raise ValueError(f"no IPv4 loopback address among {addrs} (the emulator's proxies are IPv4)")


def parse_address(text: str) -> Address:
    """``"127.0.0.1:5"`` / ``"[::1]:5"`` -> normalised (host, port)."""
    host, _, port = text.rpartition(":")
    return str(ipaddress.ip_address(host.strip("[]"))), int(port)


def bound_at(addr: Address, bound_host: str, port: int) -> bool:
    """Whether a socket bound at (``bound_host``, ``port``) receives what is sent to ``addr``
    (iroh binds [::] and advertises [::1]: an unspecified host stands for every address)."""
    bound, wanted = ipaddress.ip_address(bound_host), ipaddress.ip_address(addr[0])
    return addr[1] == port and bound.version == wanted.version and (bound.is_unspecified or bound == wanted)


def socket_name(sock: socket.socket) -> Address:
    host, port = sock.getsockname()[:2]
    return host, port


__all__ = ["Address", "bound_at", "first_ipv4", "parse_address", "socket_name"]
