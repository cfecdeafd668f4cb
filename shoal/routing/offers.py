"""Which servers can run what a client asks for beyond its blocks: a pure filter before routing.

A route may need capabilities (``train``: backward passes and deep prompts) and one LoRA adapter
(``adapter="NAME"``, or ``"NAME@DIGEST"`` to pin the adapter's tensors). Servers without them are
left out of the route, as :mod:`shoal.routing.quality` leaves out servers below ``min_quality``,
and when that leaves blocks uncovered the error names the adapter or capability those blocks lack
(``no server has adapter 'x' for blocks 2-3``) instead of the plainer "no server hosts blocks".
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from shoal.errors import UsageError
from shoal.routing.chain import NoRouteError, ServerSpan, format_blocks, uncovered_blocks

ADAPTERS = "adapters"  # the capability (shoal.wire.schema.ADAPTERS; routing imports no wire code)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class AdapterChoice:
    """The LoRA adapter a client runs with; ``digest`` (sha256 hex of the whole adapter's tensors)
    pins the exact tensors, None accepts any server's adapter of that name."""

    name: str
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> AdapterChoice:
        """``"NAME"`` or ``"NAME@DIGEST"``; raises :class:`UsageError` naming what is wrong."""
        name, _, digest = text.partition("@")
        if not _NAME.match(name):
            raise UsageError(f"adapter name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting alphanumeric")
        if digest and not _DIGEST.match(digest):
            raise UsageError(f"adapter digest {digest!r}: expected 64 lowercase hex digits (sha256)")
        return cls(name, digest or None)

    def served_by(self, span: ServerSpan) -> bool:
        if ADAPTERS not in span.info.capabilities:
            return False
        return any(name == self.name and self.digest in (None, digest) for name, digest in span.info.adapters)

    def __str__(self) -> str:
        return self.name if self.digest is None else f"{self.name}@{self.digest[:12]}"


def offering(
    spans: Iterable[ServerSpan], needs: Collection[str] = (), adapter: AdapterChoice | None = None
) -> list[ServerSpan]:
    """The spans whose servers announce every capability in ``needs`` and serve ``adapter``."""
    return [s for s in spans if all(s.supports(c) for c in needs) and (adapter is None or adapter.served_by(s))]


def with_offer_hint(
    error: NoRouteError,
    spans: Sequence[ServerSpan],
    num_blocks: int,
    needs: Collection[str] = (),
    adapter: AdapterChoice | None = None,
) -> NoRouteError:
    """``error`` (from routing over :func:`offering`'s spans) told which of its missing blocks some
    server in ``spans`` does host, but without the adapter (first) or the capabilities asked for."""
    lacking = set(error.missing) & _hosted(spans, num_blocks)
    if adapter is not None:
        no_adapter = sorted(lacking & _hosted(offering(spans, needs), num_blocks))
        if no_adapter:
            return NoRouteError(_no_adapter(adapter, spans, no_adapter), error.missing)
    if lacking and needs:
        wanted = ", ".join(repr(c) for c in sorted(needs))
        where = format_blocks(sorted(lacking))
        return NoRouteError(f"no server announcing {wanted} hosts blocks {where} ({error})", error.missing)
    return error


def _hosted(spans: Sequence[ServerSpan], num_blocks: int) -> set[int]:
    return set(range(num_blocks)) - set(uncovered_blocks(spans, num_blocks))


def _no_adapter(adapter: AdapterChoice, spans: Sequence[ServerSpan], lacking: list[int]) -> str:
    """The error text for blocks that no server serves the adapter for, and what their servers have."""
    there = {
        f"{name}@{digest[:12]}"
        for s in spans
        if set(s.blocks.blocks()) & set(lacking)
        for name, digest in s.info.adapters
    }
    have = f"; they have {', '.join(sorted(there))}" if there else "; they have no adapters"
    return f"no server has adapter {str(adapter)!r} for blocks {format_blocks(lacking)}{have}"


__all__ = ["AdapterChoice", "offering", "with_offer_hint"]
