"""The README is a front door: short, with the test command CI and the issue tracker call "the README's
test command", and it names only what a user of this repository has (every path, ``python -m`` module
and ``shoal`` command with its flags; checked for every page of the site in ``tests/docs``)."""

from __future__ import annotations

import pytest

from tests.helpers.docs import (
    README,
    check_command,
    check_module,
    check_path,
    mentioned_modules,
    mentioned_paths,
    shoal_commands,
)

TEXT = README.read_text()


def test_the_readme_is_at_most_200_lines():
    assert len(TEXT.splitlines()) <= 200, "the README is a front door: move the details to a page under docs/"


def test_the_readme_keeps_the_test_commands():
    assert "scripts/test -q" in TEXT and "scripts/test -q -m slow" in TEXT


def test_the_readme_names_no_path_outside_the_repository():
    assert "../" not in TEXT, "the README points outside the repository (e.g. ../shared): users do not have it"


@pytest.mark.parametrize("path", sorted(mentioned_paths(TEXT)))
def test_every_path_exists(path: str):
    check_path(path, "README")


@pytest.mark.parametrize("module", sorted(mentioned_modules(TEXT)))
def test_every_module_exists(module: str):
    check_module(module)


COMMANDS = shoal_commands(TEXT)


def test_the_readme_shows_shoal_commands():
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("command", COMMANDS)
def test_every_shoal_command_and_flag_exists(command: str):
    check_command(command)
