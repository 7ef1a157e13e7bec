"""The package's shape (issue 28): no import circle among its modules' top-level imports, and no module
imports another module's private name (`from .x import _y`), lazily inside a function or not."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "omni_cli"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def resolved(name: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".")
    is_package = MODULES[name].name == "__init__.py"
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


MODULES = modules()


def imports(name: str, top_level_only: bool):
    tree = ast.parse(MODULES[name].read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            target = resolved(name, node)
            for alias in node.names:
                yield target, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None


def test_no_import_circle_at_module_level():
    graph = {m: {t for t, n in imports(m, True) if t in MODULES or f"{t}.{n}" in MODULES} for m in MODULES}
    graph = {m: {t if t in MODULES else t for t in ts if t != m} for m, ts in graph.items()}
    done, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for t in graph.get(m, ()):
            if t in MODULES and not m.startswith(t + ".") and t != m.rsplit(".", 1)[0]:
                visit(t)
        stack.pop()
        done.add(m)

    for m in sorted(MODULES):
        visit(m)


def test_no_private_name_is_imported_from_another_module():
    found = []
    for m in MODULES:
        for target, name in imports(m, False):
            if target.startswith("omni_cli") and name and name.startswith("_") and not name.startswith("__"):
                found.append(f"{m}: from {target} import {name}")
    assert found == []
