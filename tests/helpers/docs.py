"""What the README and the documentation site name: paths, ``python -m`` modules and ``shoal`` commands,
found in their code (inline and fenced), for the tests that check each one exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from shoal.cli.main import build_parser

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
TOP_LEVEL = {p.name for p in ROOT.iterdir()} - {".git"}  # a token starting with one of these is a path
# names shaped like paths that are not files: protocol ids, and placeholders the text explains
NOT_PATHS = re.compile(r"^shoal/(blocks|swarm|meta)/\d+$|^path/to/|^org/name$")


def doc_files() -> list[Path]:
    """The README and every page of the site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def name_of(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_spans(text: str) -> list[str]:
    """Inline code and the lines of fenced code blocks."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.DOTALL)
    return [line for block in blocks for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", rest)


def mentioned_paths(text: str) -> set[str]:
    found = set()
    for span in code_spans(text) + re.findall(r"\(([\w./-]+)\)", text):
        for token in re.findall(r"(?<![\w$~:/.-])(\.{0,2}/?[\w.*-]+(?:/[\w.*-]+)+/?)", span):
            first = token.split("/")[0]
            if first in ("..", ".") or first in TOP_LEVEL:
                found.add(token)
    return {p for p in found if not NOT_PATHS.search(p)}


def mentioned_modules(text: str) -> set[str]:
    return set(re.findall(r"python -m ([\w.]+)", text))


def shoal_commands(text: str) -> list[str]:
    """Each ``shoal ...`` command line of the text's code (after ``&&``, ``scripts/isolated``, ...)."""
    commands = []
    for span in code_spans(text):
        for part in re.split(r"&&|;|\|\|", span.split("#")[0]):
            match = re.match(r"\s*(?:scripts/isolated\s+)?shoal\s+(.*)", part)
            if match:
                commands.append(match.group(1).strip().rstrip("\\").strip())
    return commands


def parser_for(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub)command parser the leading words reach, and the words left over."""
    parser = build_parser()
    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser, words = subs[0].choices[words[0]], words[1:]
    return parser, words


def check_path(path: str, where: str) -> None:
    if "*" in path:
        assert list(ROOT.glob(path)), f"{where} names {path}: nothing matches"
    else:
        assert (ROOT / path).exists(), f"{where} names {path}, which this repository does not have"


def check_module(module: str) -> None:
    base = ROOT / Path(*module.split("."))
    assert base.with_suffix(".py").is_file() or (base / "__main__.py").is_file(), f"no module {module}"


def check_command(command: str) -> None:
    """``shoal COMMAND`` reaches a command that takes every flag the line gives it."""
    words = command.split()
    top = {flag for action in build_parser()._actions for flag in action.option_strings}
    while words and words[0].startswith("-"):  # `shoal -v serve ...`
        assert words[0] in top, f"`shoal {command}`: shoal has no flag {words[0]}"
        words = words[1:]
    if not words:  # `shoal --version`
        return
    if words[0].isupper():  # `shoal COMMAND --help`: a flag every command has
        words = ["serve", *words[1:]]
    parser, rest = parser_for(words)
    assert not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions), (
        f"`shoal {command}`: {parser.prog} needs a subcommand, not {rest[:1]}"
    )
    known = {flag for action in parser._actions for flag in action.option_strings}
    for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", " ".join(rest)):
        assert flag in known, f"`shoal {command}`: {parser.prog} has no flag {flag}"
