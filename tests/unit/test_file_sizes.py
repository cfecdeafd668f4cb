"""The house rule that keeps modules to one job: no Python file of the tree is over 450 lines
(split one along a real seam before it grows past that)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("shoal", "bench", "testkit", "tests", "examples", "scripts")
MAX_LINES = 450


def test_no_python_file_is_over_450_lines():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
    }
    assert len(sizes) > 100  # the walk found the tree
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}
