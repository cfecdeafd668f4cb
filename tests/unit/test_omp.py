"""shoal's own processes set libgomp's spin count before torch loads, unless the user chose one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shoal.omp import SPIN_COUNT, apply_defaults, child_environment

pytestmark = pytest.mark.timeout(60)
# imports the CLI (which must change nothing), then runs its entry point as far as --help
PROBE = """
import os, sys
import shoal.cli.main as cli
print("imported", os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
try:
    cli.main(["--help"])
except SystemExit:
    pass
print("main", os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


def probe(**env: str) -> dict[str, list[str]]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith(("imported ", "main "))]
    return {line[0]: line[1:] for line in lines}


def cli_spin_count(**env: str) -> str:
    return probe(**env)["main"][0]


def test_cli_sets_the_spin_count_at_its_entry_point_before_torch_loads():
    seen = probe()
    assert seen["imported"] == ["None", "False"]  # importing the CLI has no side effects
    # its entry point sets it (apply_defaults is a no-op once torch is loaded: it came first)
    assert seen["main"][0] == SPIN_COUNT


@pytest.mark.parametrize("knob", ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_a_users_choice_is_kept(knob):
    expected = "5" if knob == "GOMP_SPINCOUNT" else "None"
    assert cli_spin_count(**{knob: "5" if knob == "GOMP_SPINCOUNT" else "passive"}) == expected


def test_too_late_once_torch_is_loaded():
    import torch  # noqa: F401  (libgomp has read its environment)

    environ: dict[str, str] = {}
    assert apply_defaults(environ) is False and environ == {}


@pytest.mark.parametrize("knob", ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_child_environment_sets_the_spin_count_unless_chosen(knob):
    base = {"PATH": "/bin"}
    assert child_environment(base) == {"PATH": "/bin", "GOMP_SPINCOUNT": SPIN_COUNT}
    assert base == {"PATH": "/bin"}  # a copy: the caller's mapping is left as it was
    chosen = {**base, knob: "5"}
    assert child_environment(chosen) == chosen
