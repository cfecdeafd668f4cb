"""Fixtures and test order of the integration tests.

* Tests here parametrized by ``name`` (a model) run grouped by model, within each module, so a module
  that keeps one model's swarm at a time builds each swarm once.
* ``smollm2_dir`` (tests/conftest.py): the fetched SmolLM2 checkpoint; a missing one FAILS the test.
* ``parity_findings``: lines printed in the terminal summary (e.g. whether logits were bitwise equal).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_FINDINGS = pytest.StashKey[list[str]]()


def _model_of(item: pytest.Item) -> str | None:
    """The ``name`` parameter of a test (the model it runs), if any."""
    name = getattr(getattr(item, "callspec", None), "params", {}).get("name")
    return name if isinstance(name, str) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Within each module of this directory, run the tests grouped by model, models in the order
    they first appear (stable otherwise). pytest's own grouping of module-scoped parameters does
    not do it here: it groups by ``hops`` as readily as by ``name``."""
    here = Path(__file__).parent
    by_module: dict[Path, list[int]] = {}
    for i, item in enumerate(items):
        if here in Path(item.path).parents:
            by_module.setdefault(Path(item.path), []).append(i)
    for slots in by_module.values():
        names = list(dict.fromkeys(_model_of(items[i]) for i in slots))
        ordered = sorted((items[i] for i in slots), key=lambda item: names.index(_model_of(item)))
        for slot, item in zip(slots, ordered, strict=True):
            items[slot] = item


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    findings = config.stash.get(_FINDINGS, [])
    if findings:
        terminalreporter.section("swarm parity findings")
        for line in findings:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def parity_findings(pytestconfig: pytest.Config) -> list[str]:
    return pytestconfig.stash.setdefault(_FINDINGS, [])
