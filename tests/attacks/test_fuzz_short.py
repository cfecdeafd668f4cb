"""Attack: a hostile peer fuzzes a live ``shoal serve`` process; the short run of ``python -m
bench.fuzz`` (the same campaign, :mod:`testkit.fuzzing`, at 4,000 frames instead of 100,000).

Valid requests, every metadata field mutated, frame mutations, random bytes, messages out of order
or on the wrong protocol, half-sent messages (finished, aborted, left hanging), oversized declared
sizes and misused sessions, from 8 concurrent workers: the server answers each with what it must
(or ends the stream), does not crash or hang (it used to, in about half the runs and once within
4,000 frames: a finalizer on one of iroh's threads, see :mod:`shoal.transport.binding`), its
resident memory grows by at most 64 MiB, and an honest session from a new peer afterwards gets
exactly the outputs it got before.
"""

from __future__ import annotations

import pytest

from testkit.fuzzing import FuzzConfig, run_campaign
from testkit.mutations import EXPECTED_ERRORS, MUTATIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # a `shoal serve` process, ~15 s

FRAMES = 4_000
SECONDS = 60.0
RSS_BOUND_MB = 64


def test_four_thousand_fuzz_frames_leave_the_server_up_flat_and_serving_what_it_served():
    report = run_campaign(FuzzConfig(frames=FRAMES, seconds=SECONDS, seed=32))
    print(report)
    assert report["crashes"] == 0, report["problem_samples"]
    assert report["frames"] >= FRAMES, f"only {report['frames']} frames in {SECONDS} s"
    assert report["serves_after"] == 1, report["problem_samples"]
    assert report["rss_growth_mb"] <= RSS_BOUND_MB
    assert report["problems"] == 0, report["problem_samples"]  # every case answered as it must be
    assert set(report["errors"]) <= EXPECTED_ERRORS
    assert {reason for reason, _ in MUTATIONS} | {"data_timeout", "not_found"} <= set(report["errors"])
    assert report["valid_served"] > FRAMES // 20
    assert (report["server_exit"], report["tracebacks"]) == (0, 0)  # it exited cleanly on SIGTERM
