"""The package's layering, read from its source: a feature uses the framework and the
libraries below the features (``quant``, ``patching``, the root modules), never another
feature's modules, and no two modules import each other, directly or around a circle.

A feature that imports another ties their flags, patches and tests together (switching one
off no longer removes it; moving one breaks the other), and a circle makes the order in
which modules happen to be imported decide whether a name exists yet. Both creep in
through imports written inside functions, which an import at run time never trips over
until that function runs: so the graph is built from the source with ``ast``, every
``import`` statement counted wherever it stands (module level, functions, ``TYPE_CHECKING``
blocks), relative ones resolved against the importing module's package."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

import pytest

from tests.support.child import REPO

pytestmark = pytest.mark.stack_independent   # reads source files only: nothing a reference stack provides

PACKAGE = "ascend_rl_plugins"
FEATURES = f"{PACKAGE}.features"


@dataclass(frozen=True)
class ImportEdge:
    """``importer`` imports ``imported`` at ``where`` (file:line): both are modules of the package."""

    importer: str
    imported: str
    where: str

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.where})"


def package_modules() -> dict[str, str]:
    """Dotted module name -> file path, for every ``.py`` file of the package (a package's
    ``__init__.py`` under the package's own name)."""
    modules = {}
    root = os.path.join(REPO, PACKAGE)
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, REPO).split(os.sep)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            parts = rel if name == "__init__.py" else rel + [name[:-3]]
            modules[".".join(parts)] = os.path.join(folder, name)
    return modules


def _package_of(module: str, path: str) -> str:
    """The package a relative import in ``module`` is resolved against."""
    return module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]


def _resolve_relative(module: str, path: str, level: int, name: str | None) -> str:
    base = _package_of(module, path)
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{name}" if name else base


def imports_of(module: str, path: str, modules: dict[str, str]) -> list[ImportEdge]:
    """Every package module ``module`` imports. ``from X import n`` counts as an import of
    ``X.n`` when that is a module (a submodule imported by name), else of ``X``; an import
    of something outside the package (torch, vllm, the standard library) is no edge, and
    neither is an import of the module's own enclosing package (``from . import X`` in a
    feature's submodule): Python imports every enclosing package before the submodule
    anyway, so that dependency exists for every submodule whatever it imports, and a
    feature's ``__init__`` importing its own submodules lazily is how features load theirs."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    where_prefix = os.path.relpath(path, REPO)
    edges = []

    def add(target: str, node: ast.AST) -> None:
        # "import a.b.c" names a.b.c; a name that is no module of the package (an attribute
        # reached through a package) falls back to the longest prefix that is one
        while target and target not in modules:
            target = target.rpartition(".")[0]
        edge = ImportEdge(module, target, f"{where_prefix}:{node.lineno}")
        if target and target != module and not module.startswith(target + ".") and edge not in edges:
            edges.append(edge)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            source = (_resolve_relative(module, path, node.level, node.module) if node.level
                      else node.module or "")
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in modules else source, node)
    return edges


def import_graph() -> list[ImportEdge]:
    modules = package_modules()
    edges = []
    for module, path in modules.items():
        edges.extend(imports_of(module, path, modules))
    return edges


def feature_of(module: str) -> str | None:
    """The feature a module belongs to (``features.<name>...``), None for the rest."""
    if not module.startswith(FEATURES + "."):
        return None
    return module[len(FEATURES) + 1:].split(".")[0]


def cycles(edges: list[ImportEdge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative: the graph is deep enough to make recursion a worry), each sorted."""
    successors: dict[str, list[str]] = {}
    for e in edges:
        successors.setdefault(e.importer, []).append(e.imported)
        successors.setdefault(e.imported, [])
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for start in sorted(successors):
        if start in index:
            continue
        work = [(start, iter(successors[start]))]
        index[start] = lowlink[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = lowlink[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(successors[child])))
                    advanced = True
                    break
                if child in on_stack:
                    lowlink[node] = min(lowlink[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    """The checks below are only as good as the graph: it must hold the imports that are
    easiest to miss (relative, inside a function) and resolve them to the right module."""
    edges = {(e.importer, e.imported) for e in import_graph()}
    # plugin.py imports the features inside a function, relatively
    assert (f"{PACKAGE}.plugin", FEATURES) in edges
    # patching/core.py: "from .. import flags" (module level, two dots), "from . import
    # versions" (inside methods)
    assert (f"{PACKAGE}.patching.core", f"{PACKAGE}.flags") in edges
    assert (f"{PACKAGE}.patching.core", f"{PACKAGE}.patching.versions") in edges


def test_no_feature_imports_another_feature():
    crossing = [e for e in import_graph()
                if feature_of(e.importer) and feature_of(e.imported)
                and feature_of(e.importer) != feature_of(e.imported)]
    assert not crossing, ("a feature imports another feature's modules (move the shared piece "
                          "below the features, or declare the dependency with requires=):\n  "
                          + "\n  ".join(map(str, crossing)))


def test_no_import_circle():
    edges = import_graph()
    found = cycles(edges)

    def describe(component: list[str]) -> str:
        members = set(component)
        inner = [str(e) for e in edges if e.importer in members and e.imported in members]
        return " <-> ".join(component) + "\n    " + "\n    ".join(inner)

    assert not found, ("modules import each other (put what both need in a module both import, "
                       "or import in one direction only):\n  " + "\n  ".join(map(describe, found)))
