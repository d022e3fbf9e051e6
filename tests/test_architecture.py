"""
The house's rules that a reader relies on (docs/architecture.md): the core's files each readable in one sitting,
and the tests using the core's public names only (the pass through core/layout.py's `running`, never its stack).

    python -m pytest -q tests/test_architecture.py
"""

import ast
import pathlib

from conftest import REPO

ROOT = pathlib.Path(REPO)
CORE = ROOT / "nanogns" / "core"
MOST_LINES = 400  # a file of the core is read in one sitting


def test_no_file_of_the_core_runs_past_400_lines():
    long = {p.name: n for p in sorted(CORE.glob("*.py")) if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, f"files of nanogns/core/ over {MOST_LINES} lines: {long}"


def private_uses_of_the_core(source):
    """[(line, what)] where `source` reaches a private name (one underscore first, not a dunder) of a module of
    nanogns.core: imported by name, read as an attribute of the module, or named in a string to
    setattr/getattr/monkeypatch.setattr on it."""
    tree = ast.parse(source)
    modules = set()  # the names the source binds to modules of the core
    found = []

    def private(name):
        return name.startswith("_") and not name.startswith("__")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanogns.core"):
            for alias in node.names:
                if private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                elif node.module == "nanogns.core":  # from nanogns.core import layout
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanogns.core.") and alias.asname:
                    modules.add(alias.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if private(node.attr):
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            if (
                isinstance(target, ast.Name)
                and target.id in modules
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and private(name.value)
            ):
                found.append((node.lineno, f"{ast.unparse(node.func)}({target.id}, {name.value!r}, ...)"))
    return sorted(found)


def test_no_test_reaches_a_private_name_of_the_core():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line, what in private_uses_of_the_core(path.read_text())
    ]
    assert not found, "tests reaching private names of nanogns.core (use its public API):\n" + "\n".join(found)


def test_the_check_finds_what_it_forbids():
    old = """
from nanogns.core import layout
from nanogns.core.layout import _in_backward
import nanogns.core.uses as summed
layout._active.append(None)
monkeypatch.setattr(layout, "_tagged_inputs", None)
summed._chunk(1, 2)
layout.__name__
"""
    assert [what for _, what in private_uses_of_the_core(old)] == [
        "from nanogns.core.layout import _in_backward",
        "layout._active",
        "monkeypatch.setattr(layout, '_tagged_inputs', ...)",
        "summed._chunk",
    ]
