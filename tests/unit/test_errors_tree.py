"""The exception tree drawn in :mod:`shoal.errors` is complete, and users can catch every error shoal
raises on purpose as a :class:`~shoal.errors.ShoalError`. Read from the source (no imports): every
class in ``shoal/`` whose bases lead to a built-in exception."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import shoal
import shoal.errors

ROOT = Path(shoal.__file__).parent
#: Control flow inside the client's session driver: caught where raised, never seen by a caller.
INTERNAL = {"HopFailed", "PushLost", "_RebuildFailed"}


def exception_classes() -> dict[str, tuple[str, list[str]]]:
    """Class name -> (module path, base names) of every class in shoal."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b).split(".")[-1] for b in node.bases]
                # a base of the same name is another library's (class ArgumentParser(argparse.ArgumentParser))
                classes[node.name] = (str(path.relative_to(ROOT)), [b for b in bases if b != node.name])
    return classes


def leads_to(name: str, target: str, classes: dict[str, tuple[str, list[str]]]) -> bool:
    if name == target:
        return True
    if name not in classes:
        return False
    return any(leads_to(base, target, classes) for base in classes[name][1])


def is_exception(name: str, classes: dict[str, tuple[str, list[str]]]) -> bool:
    builtin = getattr(builtins, name, None)
    if isinstance(builtin, type) and issubclass(builtin, BaseException):
        return True
    return name in classes and any(is_exception(base, classes) for base in classes[name][1])


def test_every_exception_users_can_meet_is_a_shoal_error_and_drawn_in_the_tree():
    classes = exception_classes()
    errors = sorted(n for n in classes if is_exception(n, classes) and n not in INTERNAL)
    assert len(errors) > 30  # the walk found the tree
    outside = [n for n in errors if not leads_to(n, "ShoalError", classes)]
    assert outside == [], f"not ShoalError subclasses: {outside}"
    drawing = shoal.errors.__doc__
    undrawn = [n for n in errors if not re.search(rf"(^|[\s─]){n}\s", drawing, re.MULTILINE)]
    assert undrawn == [], f"missing from the tree in shoal/errors.py: {undrawn}"


def test_the_internal_exceptions_exist_and_stay_internal():
    """What INTERNAL excuses is real, and no module outside the client names it."""
    classes = exception_classes()
    assert set(classes) >= INTERNAL
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        for name in INTERNAL - {"_RebuildFailed"}:
            if name in text:
                assert "client" in path.relative_to(ROOT).parts, f"{path} names the internal {name}"
