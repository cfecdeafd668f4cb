"""``scripts/test`` installs chromium (apt-get, as root) only for a run that may include the dashboard's
browser test, as ``scripts/runs-browser-test`` decides from pytest's arguments: never before a unit
test file or the fast suite. (The browser test itself fails, never skips, without chromium: CI runs it.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
BROWSER_TEST = REPO / "tests" / "gateway" / "test_dashboard_browser.py"

pytestmark = pytest.mark.timeout(60)


def runs_browser_test(*args: str) -> bool:
    done = subprocess.run([REPO / "scripts" / "runs-browser-test", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode in (0, 1) and done.stderr == "", done.stderr
    return done.returncode == 0


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "slow"],
        ["-q", "-m", ""],
        ["-m", "slow", "tests/gateway"],
        ["-m", "slow", "./tests/gateway/"],
        ["-m", "slow", "tests/gateway/test_dashboard_browser.py::test_dashboard_shows_the_swarm_its_graph_and_load"],
        ["-m", "slow", str(REPO / "tests")],
        ["-m", "slow", "."],
        ["-m", "slow", "tests/unit", "tests/gateway"],
        ["-m", "slow", "-k", "dashboard"],  # -k's value names no file: still every test path
    ],
)
def test_runs_that_may_include_it(args: list[str]):
    assert BROWSER_TEST.is_file()
    assert runs_browser_test(*args)


@pytest.mark.parametrize(
    "args",
    [
        [],  # the fast suite: the browser test is slow
        ["-q"],
        ["-q", "tests/unit/test_omp.py"],
        ["-q", "tests/gateway/test_dashboard_browser.py"],  # no -m: the default one leaves slow tests out
        ["-m", "slow", "tests/unit"],
        ["-m", "slow", "tests/cli/test_demo.py", "tests/gateway/test_chat.py"],
    ],
)
def test_runs_that_cannot(args: list[str]):
    assert not runs_browser_test(*args)
