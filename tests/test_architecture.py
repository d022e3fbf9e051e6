"""
The house's rules that a reader relies on (docs/architecture.md): the core's files each readable in one sitting,
and the tests using the core's public names only (the pass through core/layout.py's `running`, never its stack).

    python -m pytest -q tests/test_architecture.py
"""

import ast
import pathlib
import re

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


ROUTE_HEADING = "## One norm, from a layer's backward to a CSV row"
NAME = re.compile(r"`([a-z_/]+\.py):([A-Za-z_][\w.]*)`")


def route_names(doc):
    """[(file under nanogns/, dotted name)] written as `file.py:name` in the route section of docs/architecture.md."""
    section = doc.split(ROUTE_HEADING, 1)[1].split("\n## ", 1)[0]
    return NAME.findall(section)


def defines(path, dotted):
    """True when the module at `path` defines `dotted` (a function or class, or Class.method), read statically."""
    scope = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = next(
            (
                node
                for node in scope
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part
            ),
            None,
        )
        if found is None:
            return False
        scope = found.body
    return True


def test_the_route_of_one_norm_names_real_functions():
    names = route_names((ROOT / "docs" / "architecture.md").read_text())
    assert len(names) >= 30, names  # the route is written as calls, not prose
    missing = [f"{file}:{name}" for file, name in names if not defines(ROOT / "nanogns" / file, name)]
    assert not missing, f"docs/architecture.md's route names what nanogns/ does not define: {missing}"


def test_the_route_check_finds_a_missing_name():
    doc = f"{ROUTE_HEADING}\n\n1. `core/buffers.py:accumulate_pe_sqnorm` then `core/buffers.py:add_pe_sqnorm_to`\n\n## Next\n"
    names = route_names(doc)
    assert names == [("core/buffers.py", "accumulate_pe_sqnorm"), ("core/buffers.py", "add_pe_sqnorm_to")]
    assert [defines(ROOT / "nanogns" / f, n) for f, n in names] == [True, False]
