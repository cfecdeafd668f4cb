"""The ``shoal`` command's surface: ``--version``, ``models list``, and ``--help`` of every command
(a description, help text on every flag, and the default of every flag that has one)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from shoal import __version__
from shoal.checkpoints import KNOWN_MODELS, is_fetched
from shoal.cli.main import build_parser
from shoal.models import supported_model_types
from tests.cli.test_errors import shoal

pytestmark = pytest.mark.timeout(120)


Command = tuple[tuple[str, ...], argparse.ArgumentParser]


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[Command]:
    """Every (sub)command's parser, with the words that reach it: ``(("models", "list"), parser)``."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += commands(child, (*path, name))
    return found


ALL = commands(build_parser())
LEAVES = [(path, p) for path, p in ALL if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]


def test_version():
    outcome = shoal("--version")
    assert (outcome.status, outcome.stdout, outcome.stderr) == (0, f"shoal {__version__}\n", "")


def test_every_command_is_described_at_the_top():
    top = shoal("--help")
    assert top.status == 0 and top.stderr == ""
    for path, _ in ALL:
        if len(path) == 1:
            assert re.search(rf"^\s+{path[0]}\s+\S", top.stdout, re.MULTILINE), f"`shoal --help` omits {path[0]}"


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[" ".join(path) or "shoal" for path, _ in ALL])
def test_every_flag_has_help_and_its_default(path, parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            named = " ".join(path)
            assert all(child.help for child in action._choices_actions), f"shoal {named}: a command has no help"
            continue
        label = "/".join(action.option_strings) or action.dest
        assert action.help, f"shoal {' '.join(path)} {label} has no help text"
    text = parser.format_help()
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS) or default == []:
            continue
        shown = f"(default: {default})" in " ".join(text.split())
        assert shown, f"shoal {' '.join(path)}: {action.option_strings} hides its default"


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[" ".join(path) or "shoal" for path, _ in ALL])
def test_no_flag_names_a_default_twice(path, parser):
    """The formatter adds ``(default: X)``: a help text that names a default itself shows two."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS):
            continue
        shown = formatter._expand_help(action)  # the flag's text as --help prints it, default included
        assert shown.lower().count("default") <= 1, f"shoal {' '.join(path)} {action.option_strings}: {shown!r}"


def test_api_help_shows_the_bind_address_default_once():
    text = " ".join(dict(ALL)[("api",)].format_help().split())
    assert "--host HOST HTTP address to bind (0.0.0.0: every interface) (default: 127.0.0.1)" in text


@pytest.mark.parametrize("path", [path for path, _ in LEAVES], ids=[" ".join(path) for path, _ in LEAVES])
def test_help_of_every_command_runs(path):
    outcome = shoal(*path, "--help")
    assert outcome.status == 0 and outcome.stderr == ""
    assert outcome.stdout.startswith(f"usage: shoal {' '.join(path)}")


def test_serve_help_shows_the_defaults_users_ask_about():
    text = " ".join(shoal("serve", "--help").stdout.split())
    for shown in ("(default: 0.0.0.0)", "(default: float32)", "(default: 8192)", "(default: 16)"):
        assert shown in text


def test_models_list(smollm2_dir):
    table = shoal("models", "list")
    assert table.status == 0 and table.stderr == ""
    listed = json.loads(shoal("models", "list", "--json").stdout)
    assert [m["name"] for m in listed["models"]] == sorted(KNOWN_MODELS)
    assert {m["name"]: m["fetched"] for m in listed["models"]} == {name: is_fetched(name) for name in KNOWN_MODELS}
    assert listed["families"] == list(supported_model_types())
    smollm2 = next(line for line in table.stdout.splitlines() if line.startswith("smollm2 "))
    assert str(smollm2_dir) in smollm2  # fetched: where it is
    for family in supported_model_types():
        assert family in table.stdout


def test_the_choices_the_parser_spells_are_the_real_ones():
    """cli/args.py spells choices of lower layers so that building the parser stays import-light."""
    from shoal.cli.args import CODECS, NETWORK_PROFILES
    from shoal.transport import NetworkProfile
    from shoal.wire import Codec

    assert tuple(p.value for p in NetworkProfile) == NETWORK_PROFILES
    assert tuple(c.value for c in Codec) == CODECS and CODECS[0] == Codec.RAW.value


def test_building_the_parser_imports_neither_torch_nor_the_transport():
    import subprocess
    import sys

    code = (
        "import sys; from shoal.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'shoal.transport', 'iroh') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr
