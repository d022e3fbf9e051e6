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


# -----------------------------------------------------------------------------
# the kinds, as the docs list them


def class_label(cls):
    """`nn.Linear` for torch's classes, `transformers.pytorch_utils.Conv1D` for a "module:Class" string."""
    if isinstance(cls, str):
        return "`" + cls.replace(":", ".") + "`"
    return f"`nn.{cls.__name__}`" if cls.__module__.startswith("torch.nn") else f"`{cls.__module__}.{cls.__name__}`"


def kinds_table():
    """The table of kinds docs/integrations.md holds between KINDS_START and KINDS_END, made from the registry."""
    from nanogns.core.registry import REQUIRED_VARIANTS
    from nanogns.kinds import KINDS

    lines = [
        "| kind | converted by class | also found | flag | analysis group | variants beyond nn, shim, gns, fused |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS.values():
        found = [way for way, yes in (("by a probe", kind.probe), ("by its structure", kind.matches)) if yes]
        extra = [f"`{v}`" for v in kind.variants if v not in REQUIRED_VARIANTS]
        lines.append(
            f"| {kind.name} | {', '.join(map(class_label, kind.replaces)) or '-'} | {', '.join(found) or '-'} "
            f"| `{kind.config_key}` | {kind.group} | {', '.join(extra) or '-'} |"
        )
    return "\n".join(lines)


KINDS_START = (
    "<!-- kinds: made from nanogns/kinds/__init__.py's KINDS; tests/test_architecture.py prints it when stale -->"
)
KINDS_END = "<!-- /kinds -->"


def test_the_docs_list_of_kinds_is_the_registry_s():
    doc = (ROOT / "docs" / "integrations.md").read_text()
    assert doc.count(KINDS_START) == 1 and doc.count(KINDS_END) == 1
    written = doc.split(KINDS_START, 1)[1].split(KINDS_END, 1)[0].strip()
    expected = kinds_table()
    assert written == expected, f"docs/integrations.md's table of kinds is stale; write:\n{expected}"


def test_no_doc_lists_a_kind_among_the_replayed_modules():
    """A kind's modules are converted by their class, never replayed per example (GroupNorm was, before it became a
    kind): no sentence of the docs about replaying per example lists a kind in its parentheses."""
    from nanogns.kinds import KINDS

    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for paragraph in path.read_text().split("\n\n"):
            for sentence in " ".join(paragraph.split()).split(". "):
                if re.search(r"[Rr]eplayed\W+per example", sentence):
                    for group in re.findall(r"\(([^()]*)\)", sentence):
                        found += [
                            f"{path.name}: {name} in ({group})" for name in KINDS if re.search(rf"\b{name}\b", group)
                        ]
    assert not found, f"kinds listed as replayed: {found}"


CLOSED_SET = re.compile(r"`(CONFIG_KEYS|GROUPS|REQUIRED_VARIANTS)` = ((?:`[\w+]+`(?:, )?)+)")


def test_the_closed_sets_a_kind_must_join_are_documented_where_a_kind_is_added():
    from nanogns.core import registry

    section = (ROOT / "docs" / "architecture.md").read_text().split("## Adding a layer kind", 1)[1].split("\n## ", 1)[0]
    written = {name: tuple(re.findall(r"`([\w+]+)`", values)) for name, values in CLOSED_SET.findall(section)}
    assert written == {name: getattr(registry, name) for name in ("CONFIG_KEYS", "GROUPS", "REQUIRED_VARIANTS")}
