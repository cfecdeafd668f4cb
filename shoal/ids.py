"""The value types that travel between shoal's layers: peer and session ids, block ranges, and the
cutting of a run of positions into chunks.

A :class:`BlockRange` is half-open, ``[start, end)``, and non-empty. It is the one type for "these
blocks" everywhere: routing, the server, swarm records, placement and the client. It is a msgspec
struct, so it travels on the wire as ``[start, end]`` and is validated where it enters.
"""

from __future__ import annotations

import ipaddress
from typing import NewType

import msgspec

#: An ed25519 public key in hex: the iroh endpoint id of a peer, and the signer of its records.
PeerId = NewType("PeerId", str)
#: A session's id on the server that holds it (chosen by that server).
SessionId = NewType("SessionId", str)


class BlockRange(msgspec.Struct, frozen=True, array_like=True, order=True, forbid_unknown_fields=True):
    """Blocks ``[start, end)`` of a model: ``0 <= start < end``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"a block range is [start, end) with 0 <= start < end, got [{self.start}, {self.end})")

    @classmethod
    def parse(cls, text: str) -> BlockRange:
        """``"START:END"`` (as ``--blocks`` takes it)."""
        start, sep, end = text.partition(":")
        if not sep:
            raise ValueError(f"blocks are START:END (half-open), got {text!r}")
        try:
            return cls(int(start), int(end))
        except ValueError as exc:
            raise ValueError(f"blocks {text!r}: {exc}") from None

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, block: object) -> bool:
        return isinstance(block, int) and self.start <= block < self.end

    def blocks(self) -> range:
        return range(self.start, self.end)

    def within(self, num_blocks: int) -> bool:
        return self.end <= num_blocks

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


class OnBlocks:
    """For types that hold a ``blocks: BlockRange`` (a server's span, a placement, a record): its
    ``start`` and ``end`` without spelling ``.blocks``."""

    blocks: BlockRange

    @property
    def start(self) -> int:
        return self.blocks.start

    @property
    def end(self) -> int:
        return self.blocks.end


def socket_address(text: str) -> str:
    """``IP:PORT`` (an IPv6 address in brackets), normalised as tickets and records carry it
    (``127.0.0.1:7000``, ``[::1]:7000``). A peer announces such addresses (``--announce-addr``):
    they are dialled as given, so a host name, a missing port or port 0 is refused here."""
    host, colon, port = text.strip().rpartition(":")
    if not colon or not host:
        raise ValueError(f"an address is IP:PORT (IPv6 as [IP]:PORT), got {text!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address (names are not resolved): IP:PORT, got {text!r}") from None
    if ip.version == 6 and not bracketed:
        raise ValueError(f"an IPv6 address goes in brackets: [{host}]:{port}")
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"the port of {text!r} must be within 1..65535")
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


__all__ = ["BlockRange", "OnBlocks", "PeerId", "SessionId", "socket_address"]


def chunk_bounds(n: int, size: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of ``n`` positions cut every ``size`` (None or 0: one chunk);
    the last chunk takes the remainder. The one cutting rule of the client's pipelined prefill and
    the server's prefill, recompute and training chunks."""
    if size is not None and size < 0:
        raise ValueError(f"a chunk size must be None, 0 (off) or positive, not {size}")
    if not size or n <= size:
        return [(0, n)]
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def rows_chunk_bounds(rows: int, tokens: int, max_positions: int) -> list[tuple[int, int]]:
    """``[a, b)`` token ranges of a step of ``rows`` rows, cut so each holds at most ``max_positions``
    rows x tokens (at least one token each: a step of more rows than that runs a token at a time)."""
    return chunk_bounds(tokens, max(1, max_positions // max(rows, 1))) if tokens > 0 else []
