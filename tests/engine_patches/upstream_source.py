"""Read upstream source trees of both stacks (never imported: vLLM-Ascend needs torch_npu).

The unpacked trees live in ``<cache>/stacks/<stack>/src/<package>``; a test that needs one
skips when it is absent. ``compile_functions`` compiles selected top-level definitions of an
upstream module into a namespace so the real upstream logic can run against doubles.
"""

from __future__ import annotations

import ast
import os

import pytest

STACKS = ("recipe", "current")


def source_root(stack: str, package: str) -> str:
    from ascend_rl_plugins.doctor import cache_dir
    root = os.path.join(cache_dir(), "stacks", stack, "src", package)
    if not os.path.isdir(root):
        pytest.skip(f"{package} source of the {stack} stack is not unpacked at {root}")
    return root


def module_path(stack: str, package: str, module: str) -> str:
    root = source_root(stack, package)
    rel = module.replace(".", os.sep)
    for candidate in (os.path.join(root, rel + ".py"), os.path.join(root, rel, "__init__.py")):
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(f"{module} not found under {root}")


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


def method(tree: ast.Module, class_name: str, name: str):
    cls = top_level(tree, class_name)
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise LookupError(f"{class_name}.{name}")


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
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            out.append(ast.unparse(sub.func))
    return out
