"""Read the upstream source trees of the reference stacks (never imported: vLLM-Ascend needs
torch_npu).

Paths come from :mod:`tests.support.stacks` (``$ASCEND_RL_CACHE/stacks/<stack>/src/<package>``),
so a test that needs a tree skips, saying why, when its stack is missing or half-built.
``compile_functions`` compiles selected top-level definitions of an upstream module into a
namespace, so the real upstream logic can run against doubles.
"""

from __future__ import annotations

import ast
import os
from typing import Iterable

from tests.support import stacks

STACKS = stacks.STACKS


def source_root(stack: str, package: str) -> str:
    """``<stack>/src/<package>`` (the unpacked distribution), or skip."""
    return stacks.source(stack, package)


def module_path(stack: str, package: str, module: str) -> str:
    """The file of ``module`` inside the unpacked ``package`` of ``stack``."""
    root = source_root(stack, package)
    rel = module.replace(".", os.sep)
    for candidate in (os.path.join(root, rel + ".py"), os.path.join(root, rel, "__init__.py")):
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(f"{module} not found under {root}")


def python_files(root: str) -> Iterable[str]:
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read(), filename=path)


def top_level(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
    raise LookupError(name)


def has_top_level(tree: ast.Module, name: str) -> bool:
    try:
        top_level(tree, name)
    except LookupError:
        return False
    return True


def method(tree: ast.Module, class_name: str, name: str):
    cls = top_level(tree, class_name)
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise LookupError(f"{class_name}.{name}")


def params(node) -> list[str]:
    """Positional and keyword-only parameter names of a function node."""
    return [a.arg for a in node.args.args] + [a.arg for a in node.args.kwonlyargs]


def compile_functions(path: str, names, namespace: dict) -> dict:
    """Execute the named top-level definitions of ``path`` in ``namespace`` (annotations
    are not evaluated)."""
    tree = parse(path)
    body = [top_level(tree, n) for n in names]
    future = ast.parse("from __future__ import annotations").body
    module = ast.Module(body=future + body, type_ignores=[])
    exec(compile(module, path, "exec"), namespace)
    return namespace


def calls_in(node) -> list[str]:
    """Names of everything called inside ``node`` (``f(...)`` -> f, ``a.b(...)`` -> a.b)."""
    return [ast.unparse(sub.func) for sub in ast.walk(node) if isinstance(sub, ast.Call)]


def decision(patch, stack: str):
    """What activation and ``ascend-rl doctor`` decide for ``patch`` on ``stack`` (versions
    and target read from its unpacked tree; flags from this process's environment)."""
    from ascend_rl_plugins.patching.decision import decide
    return decide(patch, stacks.roots(stack), check_target=True)
