"""The soak's short variant (``python -m bench.soak``, about a minute of traffic): API streams against
6 server processes behind an auditing gateway while servers are killed, drained and replaced and
byzantine servers (liars, a staller, a sender of garbage frames) join and leave. Every answer must
equal transformers' (or fail clearly), none may be lost, no honest server convicted, and every liar
that served a wrong step convicted."""

from __future__ import annotations

import json

import pytest

from bench.soak import parse, soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHORT = [
    "--minutes", "1", "--streams", "4", "--kill-every", "15", "--drain-every", "40",
    "--liar-every", "8", "--liar-life", "25", "--seed", "3",
]  # fmt: skip


def test_a_short_soak_alters_and_loses_nothing_and_convicts_only_liars(smollm2_dir):
    result = soak(parse(SHORT))
    # a string, so that pytest shows all of it (the failures' reasons included) when an assert fails
    summary = json.dumps({k: v for k, v in result.items() if k != "peak_rss_mb"}, indent=1)
    assert result["requests"] >= 10, summary
    assert result["altered"] == 0, summary
    assert result["lost"] == 0, summary
    assert result["honest_banned"] == 0 and result["broken_banned"] == 0, summary
    assert result["kills"] >= 1 and result["liars"] >= 1, summary
    assert result["liars_lied_unbanned"] == [], summary
    assert result["completed_share"] >= 0.8, summary  # the 10-minute run's target is 0.95
    assert not result["chaos_errors"], summary
