"""The packages import one way, as docs/layout.md lists them: nothing imports a layer above
its own (a task that imported the outputs gateway pulled a web server into every flow run)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

# docs/layout.md, top down; packages of one row may import each other.
LAYERS = [
    ("cli", "servers"),
    ("flows",),
    ("tasks",),
    ("registry", "gate", "deployments"),
    ("backends",),
    ("core",),
    ("training", "staging"),
    ("imagedata",),
    ("common",),
]
RANK = {package: i for i, row in enumerate(LAYERS) for package in row}


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_no_package_imports_a_layer_above_its_own() -> None:
    upward = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package, rank in RANK.items()
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _imports(path)
        if RANK.get(name.split(".")[0], rank) < rank
    ]
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "report.py"
    module.write_text("from servers.gateway import serve\nimport core.links\n")
    assert _imports(module) == ["servers.gateway", "core.links"]
    assert RANK["servers"] < RANK["tasks"]
