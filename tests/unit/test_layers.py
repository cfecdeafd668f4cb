"""The architecture the tree shows holds in its imports: data flows one way, and no module reaches
into another's internals. Read from the source (every import, function-level ones too):

    cli -> gateway, launch -> client, server -> routing, swarm, verify -> wire, transport, models, ...

A module imports only from its own layer's package or a lower layer, and never a private name
(``_x``) of another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shoal

ROOT = Path(shoal.__file__).parent
#: Top-level package or module of shoal -> its layer (higher imports lower, never the reverse).
LAYERS = {
    "cli": 5,
    "gateway": 4,
    "launch": 4,
    "client": 3,
    "server": 3,
    "routing": 2,
    "swarm": 2,
    "verify": 2,
    "weights": 2,
    "wire": 1,
    "transport": 1,
    "models": 1,
    "checkpoints": 1,
    "quantization": 1,
    "protocols": 1,
    "errors": 0,
    "ids": 0,
    "limits": 0,
    "heap": 0,
    "omp": 0,
    "devices": 0,
}


def imports() -> list[tuple[str, int, str, str | None]]:
    """(file, line, imported module, imported name or None) for every shoal import in shoal/."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("shoal"):
                found += [(str(path.relative_to(ROOT)), node.lineno, node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), node.lineno, a.name, None) for a in node.names]
    return [f for f in found if f[2] == "shoal" or f[2].startswith("shoal.")]


def top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_part_of_shoal_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or p.is_dir()}
    parts -= {"__init__", "__pycache__"}
    assert parts <= set(LAYERS), f"give these a layer: {sorted(parts - set(LAYERS))}"


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for path, line, module, _ in imports():
        mine = top("shoal." + path.removesuffix(".py").replace("/", "."))
        theirs = top(module)
        if mine is None or theirs is None or mine == theirs:
            continue
        if LAYERS[theirs] > LAYERS[mine]:
            upward.append(f"{path}:{line} ({mine}) imports {module} ({theirs})")
    assert upward == []


def test_no_module_imports_another_modules_private_names():
    private = []
    for path, line, module, name in imports():
        own = "shoal." + path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        if name and name.startswith("_") and not name.startswith("__") and module != own:
            private.append(f"{path}:{line} imports {module}.{name}")
    assert private == []
