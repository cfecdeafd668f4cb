"""Which servers a client accepts by the format of their weights: a pure filter before routing.

A client asks for a minimum (``min_quality``, see :mod:`shoal.quantization.formats`); servers
below it are left out of every route, and when that leaves blocks uncovered the error says which
servers were left out and what ``min_quality`` would accept them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.quantization.formats import Quantization
from shoal.routing.chain import NoRouteError, ServerSpan, format_blocks


def meeting(spans: Iterable[ServerSpan], min_quality: Quantization) -> list[ServerSpan]:
    """The spans whose weights are at least ``min_quality``, in their order."""
    return [s for s in spans if s.info.quantization.satisfies(min_quality)]


def with_quality_hint(error: NoRouteError, spans: Sequence[ServerSpan], min_quality: Quantization) -> NoRouteError:
    """``error``, told which of its missing blocks only servers below ``min_quality`` host."""
    below = [s for s in spans if not s.info.quantization.satisfies(min_quality)]
    hidden = sorted({b for s in below for b in s.blocks.blocks()} & set(error.missing))
    if not hidden:
        return error
    formats = sorted({s.info.quantization for s in below}, key=lambda q: -q.quality)
    hint = (
        f"{error}; blocks {format_blocks(hidden)} are served only in {', '.join(formats)}, below "
        f"min_quality {min_quality} (min_quality={formats[-1].value!r} accepts them)"
    )
    return NoRouteError(hint, error.missing)
