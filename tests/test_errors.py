"""
Every refusal of the package is a NanoGNSError (nanogns/errors.py), so that `except NanoGNSError` catches what a
caller may want to catch: each `raise` statement in nanogns/, read from the source, raises

- a NanoGNSError (each keeps the built-in class it replaced as a second base: StepNotMeasured is a ValueError), or
  builds one in a function it calls (`raise self._count_error(...)`);
- one of the exceptions errors.py lists by Python's own meaning (an optional dependency missing: ImportError, ...);
- or an exception caught where it is raised: in a `try` of the same function, or a private class of its module
  that the module catches (argparse's exit in analysis/commandline.py, replay.py's refusals of one module).

and the package's command lines return their exit codes, argparse's included (tests/test_analysis.py).

    python -m pytest -q tests/test_errors.py
"""

import ast
import builtins
import importlib
import os
import pickle

from conftest import REPO

from nanogns import errors

# what errors.py documents besides the NanoGNSError family (by Python's own meaning)
DOCUMENTED = {ImportError, AttributeError, KeyError, NotImplementedError}


def package_modules():
    """(module name, its path, its source) of every module of nanogns/."""
    root = os.path.join(REPO, "nanogns")
    for directory, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
                with open(path) as f:
                    yield module, os.path.relpath(path, REPO), f.read()


def resolve(node, namespace):
    """The object a Name or dotted Attribute names in a module's namespace (or builtins), or None."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id, getattr(builtins, node.id, None))
    if isinstance(node, ast.Attribute):
        owner = resolve(node.value, namespace)
        return getattr(owner, node.attr, None) if owner is not None else None
    return None


def parents_of(tree):
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def raised_classes(raise_node, namespace, tree, parents):
    """The exception classes a `raise` raises: the class called or named, or the classes returned by the function
    (of the module, or a method of the enclosing class) whose call it raises. [None] when unresolvable."""
    exc = raise_node.exc
    target = exc.func if isinstance(exc, ast.Call) else exc
    found = resolve(target, namespace)
    if isinstance(found, type):
        return [found]
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
    scope = tree
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        scope = raise_node
        while scope is not None and not isinstance(scope, ast.ClassDef):
            scope = parents.get(scope)
    builders = [n for n in ast.walk(scope or tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    returned = [
        resolve(r.value.func, namespace)
        for f in builders
        for r in ast.walk(f)
        if isinstance(r, ast.Return) and isinstance(r.value, ast.Call)
    ]
    return [c for c in returned if isinstance(c, type)] or [None]


def handled_types(handler, namespace):
    if handler.type is None:
        return [BaseException]
    nodes = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return [t for t in (resolve(n, namespace) for n in nodes) if isinstance(t, type)]


def caught_where_raised(raise_node, cls, namespace, parents):
    """Whether a try of the same function around the raise catches cls."""
    node, child = parents.get(raise_node), raise_node
    while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        if isinstance(node, ast.Try) and child in node.body:
            if any(issubclass(cls, t) for h in node.handlers for t in handled_types(h, namespace)):
                return True
        node, child = parents.get(node), node
    return False


def caught_in_module(cls, tree, namespace):
    return any(
        cls in handled_types(h, namespace) for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) and h.type
    )


def test_every_raise_in_the_package_is_a_nanogns_error_or_documented():
    problems, checked = [], 0
    for module, path, source in package_modules():
        namespace = vars(importlib.import_module(module))
        tree = ast.parse(source)
        parents = parents_of(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:  # a bare raise re-raises what was caught
                continue
            for cls in raised_classes(node, namespace, tree, parents):
                checked += 1
                where = f"{path}:{node.lineno}"
                if cls is None:
                    problems.append(f"{where}: raises {ast.unparse(node.exc)[:60]}, which this test cannot resolve")
                elif issubclass(cls, errors.NanoGNSError) or cls in DOCUMENTED:
                    continue
                elif caught_where_raised(node, cls, namespace, parents):
                    continue
                elif (
                    cls.__name__.startswith("_") and cls.__module__ == module and caught_in_module(cls, tree, namespace)
                ):
                    continue
                else:
                    problems.append(f"{where}: raises {cls.__name__}, not a NanoGNSError (nanogns/errors.py)")
    assert not problems, "\n".join(problems)
    assert checked > 120  # the walk found the package's raise statements (129 when written)


def test_the_documented_exceptions_are_the_ones_errors_py_lists_and_every_class_pickles():
    doc = errors.__doc__
    for cls in DOCUMENTED:
        assert f"\n    {cls.__name__} " in doc, f"errors.py does not document {cls.__name__}"
    family = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.NanoGNSError)]
    for cls in family:
        assert f" {cls.__name__} " in doc or cls is errors.NanoGNSError, f"errors.py's docstring lacks {cls.__name__}"
        if cls.__init__ is errors.NanoGNSError.__init__:  # built from a message alone
            error = cls("one line naming the problem and the fix")
            again = pickle.loads(pickle.dumps(error))
            assert type(again) is cls and str(again) == str(error)
    import nanogns

    assert {c.__name__ for c in family} <= set(nanogns.__all__)
