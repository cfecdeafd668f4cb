"""The soak's links (:mod:`bench.soak_wan`): each pair's round trip drawn, seeded, from the range,
the same both ways, with the plan's jitter and loss; and the flags that set them."""

from __future__ import annotations

import pytest

from bench.soak import parse
from bench.soak_wan import WanPlan, parse_rtt

pytestmark = pytest.mark.timeout(30)


def test_each_link_draws_its_round_trip_from_the_range_seeded_and_symmetric():
    plan = WanPlan((20.0, 80.0), jitter_ms=5.0, loss=0.01, seed=3)
    names = [f"honest-{i}" for i in range(12)] + ["gateway", "driver-0"]
    rtts = {(a, b): plan.conditions(a, b).rtt_ms for a in names for b in names if a < b}
    assert all(20.0 <= r <= 80.0 for r in rtts.values())
    assert max(rtts.values()) - min(rtts.values()) > 30.0  # spread over the range, not one value
    assert all(plan.conditions(b, a).rtt_ms == r for (a, b), r in rtts.items())
    assert WanPlan((20.0, 80.0), seed=3).conditions("gateway", "honest-1") == plan.conditions("gateway", "honest-1")
    assert WanPlan((20.0, 80.0), seed=4).conditions("gateway", "honest-1").rtt_ms != rtts[("gateway", "honest-1")]
    link = plan.conditions("gateway", "honest-1")
    assert (link.jitter_ms, link.loss, link.bandwidth_mbit) == (5.0, 0.01, None)


def test_the_flags_set_the_plan_and_bad_ones_are_refused():
    args = parse(["--rtt-ms", "30,60", "--jitter-ms", "2", "--loss", "0.02"])
    assert (args.rtt_ms, args.jitter_ms, args.loss, args.no_wan) == ((30.0, 60.0), 2.0, 0.02, False)
    defaults = parse([])
    assert (defaults.rtt_ms, defaults.loss, parse(["--no-wan"]).no_wan) == ((20.0, 80.0), 0.01, True)
    assert parse_rtt("40") == (40.0, 40.0)
    with pytest.raises(ValueError, match="LOW <= HIGH"):
        WanPlan((80.0, 20.0))
    with pytest.raises(ValueError, match="loss must be within"):
        WanPlan(loss=1.5)
    with pytest.raises(SystemExit):
        parse(["--rtt-ms", "1,2,3"])
