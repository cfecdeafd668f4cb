"""A giver that lies about some chunks, injected from outside (as :mod:`testkit.faulty` does for
servers): ``tamper(local.gate.giver, chunks)`` makes it flip one byte of each chunk named, every
time it gives it, so a fetcher's digest check must catch it."""

from __future__ import annotations

from shoal.weights.give import Giver


def tamper(giver: Giver, chunks: set[tuple[int, int]] | None = None) -> Giver:
    """``giver`` with each of ``chunks`` ((item, chunk); None: all) given with its first byte flipped."""
    honest = giver.give
    giver.tampered = 0

    async def give(item: int, index: int) -> bytes | bytearray:
        data = await honest(item, index)
        if chunks is None or (item, index) in chunks:
            giver.tampered += 1
            return bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    giver.give = give
    return giver


__all__ = ["tamper"]
