"""The documentation site (``mkdocs.yml``, ``docs/``) names only what a user of this repository has:
every path a page or the README mentions exists, every ``python -m`` module is there, every ``shoal``
command (with each of its flags) is one the ``shoal`` command accepts, every page is in the nav and
every nav entry is a page, and every object the API reference renders imports. ``mkdocs build
--strict`` (in ``.ci/run``) checks the links and anchors between pages."""

from __future__ import annotations

import importlib
import re

import pytest
import yaml

from tests.helpers.docs import (
    DOCS,
    ROOT,
    check_command,
    check_module,
    check_path,
    doc_files,
    mentioned_modules,
    mentioned_paths,
    name_of,
    shoal_commands,
)

TEXTS = {name_of(path): path.read_text() for path in doc_files()}


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


NAV = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])


def _cases(find) -> list[tuple[str, str]]:
    return sorted({(doc, item) for doc, text in TEXTS.items() for item in find(text)})


def test_the_site_has_its_pages():
    assert len(TEXTS) >= 12 and "docs/getting-started.md" in TEXTS


@pytest.mark.parametrize("doc", sorted(TEXTS))
def test_no_page_points_outside_the_repository(doc: str):
    assert "../" not in TEXTS[doc], f"{doc} points outside the repository (e.g. ../shared): users do not have it"


@pytest.mark.parametrize(("doc", "path"), _cases(mentioned_paths))
def test_every_path_exists(doc: str, path: str):
    check_path(path, doc)


@pytest.mark.parametrize(("doc", "module"), _cases(mentioned_modules))
def test_every_module_exists(doc: str, module: str):
    check_module(module)


@pytest.mark.parametrize(("doc", "command"), _cases(shoal_commands))
def test_every_shoal_command_and_flag_exists(doc: str, command: str):
    check_command(command)


def test_every_nav_entry_is_a_page_and_every_page_is_in_the_nav():
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert sorted(set(NAV) - pages) == [], "mkdocs.yml's nav names pages docs/ does not have"
    assert sorted(pages - set(NAV)) == [], "pages of docs/ that mkdocs.yml's nav leaves out"
    assert len(NAV) == len(set(NAV)), "a page is in the nav twice"


@pytest.mark.parametrize(("doc", "name"), _cases(lambda text: re.findall(r"^::: ([\w.]+)", text, re.MULTILINE)))
def test_every_reference_entry_imports(doc: str, name: str):
    module, _, attribute = name.rpartition(".")
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        assert hasattr(importlib.import_module(module), attribute), f"{doc}: ::: {name} does not import"


def test_getting_started_reaches_the_openai_client_over_two_servers():
    """The path the README promises: two `shoal serve` in one swarm, `shoal api` over it, the `openai` client."""
    text = TEXTS["docs/getting-started.md"]
    commands = shoal_commands(text)
    assert sum(c.startswith("serve ") for c in commands) == 2
    assert any("--new-swarm" in c for c in commands) and any("--join" in c and c.startswith("serve") for c in commands)
    assert any(c.startswith("api ") for c in commands)
    assert "from openai import OpenAI" in text and "chat.completions.create" in text
