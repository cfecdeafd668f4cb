"""shoal's own processes set libgomp's spin count before torch loads, unless the user chose one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shoal.omp import SPIN_COUNT, apply_defaults, child_environment

pytestmark = pytest.mark.timeout(60)
PROBE = "import shoal.cli.main, os, sys; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"


def cli_spin_count(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.split()[0]


def test_cli_sets_the_spin_count_before_torch_loads():
    assert cli_spin_count() == SPIN_COUNT


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
