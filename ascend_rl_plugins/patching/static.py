"""Resolve ``module.path:Qualified.name`` targets without importing anything.

vllm_ascend, mindspeed and torch_npu cannot be imported on a machine without CANN, and
importing vLLM just to ask "does this method still exist?" costs seconds. So ``doctor``
and the conformance tests find the module's file (in the installed environment or in an
unpacked source tree) and look the qualified name up in its syntax tree, following
``from x import y`` re-exports and base classes a few levels deep.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from .targets import split_target

MAX_DEPTH = 6


@dataclass
class StaticResult:
    found: bool
    why: str = ""
    file: str | None = None
    lineno: int | None = None
    kind: str = ""  # function | async function | class | assignment | import | compiled
    params: tuple[str, ...] | None = None
    via: list[str] = field(default_factory=list)  # re-export / inheritance hops taken

    def where(self) -> str:
        if not self.file:
            return ""
        return f"{self.file}:{self.lineno}" if self.lineno else self.file


def locate_module(module: str, roots: Sequence[str] | None = None) -> str | None:
    """The source file of ``module`` (``.py``, a package ``__init__.py`` or an extension),
    searched in ``roots`` or, when None, where the installed top-level package lives.
    Parent packages are never executed."""
    parts = module.split(".")
    if roots is None:
        try:
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if spec.submodule_search_locations is None:  # a plain top-level module
            return spec.origin if len(parts) == 1 else None
        dirs = list(spec.submodule_search_locations)
        if len(parts) == 1:
            init = os.path.join(dirs[0], "__init__.py") if dirs else None
            return init if init and os.path.exists(init) else (dirs[0] if dirs else None)
        rest = parts[1:]
    else:
        dirs = [os.path.abspath(r) for r in roots]
        rest = parts
    for i, part in enumerate(rest):
        last = i == len(rest) - 1
        next_dirs = []
        for d in dirs:
            pkg = os.path.join(d, part)
            if os.path.isdir(pkg):
                if last:
                    init = os.path.join(pkg, "__init__.py")
                    return init if os.path.exists(init) else pkg
                next_dirs.append(pkg)
            elif last:
                py = pkg + ".py"
                if os.path.exists(py):
                    return py
                try:
                    names = os.listdir(d)
                except OSError:
                    continue
                for name in names:  # compiled extension: part.cpython-311-x86_64-linux-gnu.so
                    if name.startswith(part + ".") and name.endswith((".so", ".pyd")):
                        return os.path.join(d, name)
        if not next_dirs:
            return None
        dirs = next_dirs
    return None


@lru_cache(maxsize=512)
def _parse(path: str) -> ast.Module | None:
    try:
        with open(path, "rb") as fh:
            return ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _flat_body(body: list[ast.stmt]):
    """Statements of a module or class body, looking inside if/try/with blocks."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try, ast.With)) or type(node).__name__ == "TryStar":
            yield from _flat_body(node.body)
            for extra in ("orelse", "finalbody"):
                yield from _flat_body(getattr(node, extra, []) or [])
            for handler in getattr(node, "handlers", []) or []:
                yield from _flat_body(handler.body)
        else:
            yield node


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return tuple(names)


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


class _Resolver:
    def __init__(self, roots: Sequence[str] | None):
        self.roots = roots

    def module_tree(self, module: str) -> tuple[str | None, ast.Module | None]:
        path = locate_module(module, self.roots)
        if path is None or not path.endswith(".py"):
            return path, None
        return path, _parse(path)

    def lookup(self, module: str, names: list[str], depth: int, via: list[str]) -> StaticResult:
        if depth > MAX_DEPTH:
            return StaticResult(False, f"gave up following re-exports/bases at {module}", via=via)
        path, tree = self.module_tree(module)
        if path is None and self.roots is not None and module.split(".")[0] in sys.stdlib_module_names:
            # a stack tree holds no standard library: read the running interpreter's
            return _Resolver(None).lookup(module, names, depth, via)
        if path is None:
            return StaticResult(False, f"module {module} not found", via=via)
        if tree is None:
            if path.endswith((".so", ".pyd")):
                return StaticResult(True, "compiled module; member not checkable", path, kind="compiled", via=via)
            if os.path.isdir(path):
                # namespace package: a name inside it may be a submodule
                sub = self.lookup(f"{module}.{names[0]}", names[1:], depth + 1, via) if names else None
                if sub is not None and sub.found:
                    return sub
                return StaticResult(False, f"{names[0]} not found in namespace package {module}", path, via=via)
            return StaticResult(False, f"could not parse {path}", path, via=via)
        is_pkg = os.path.basename(path) == "__init__.py"
        return self.in_body(module, is_pkg, path, tree.body, names, depth, via)

    def in_body(self, module: str, is_pkg: bool, path: str, body, names: list[str], depth: int,
                via: list[str], owner: str | None = None) -> StaticResult:
        head, rest = names[0], names[1:]
        found_node = None
        for node in _flat_body(body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == head:
                found_node = node  # the last definition wins, as at run time
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == head for t in node.targets):
                found_node = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == head:
                found_node = node
            elif isinstance(node, ast.ImportFrom) and owner is None:
                for alias in node.names:
                    if (alias.asname or alias.name) == head:
                        found_node = node
            elif isinstance(node, ast.Import) and owner is None:
                for alias in node.names:
                    if alias.asname == head or (alias.asname is None and alias.name.split(".")[0] == head):
                        found_node = node
        if found_node is None:
            if owner is not None:
                return StaticResult(False, f"{owner} has no member {head!r}", path, via=via)
            if is_pkg:  # maybe a submodule
                sub = self.lookup(f"{module}.{head}", rest, depth + 1, via) if rest else None
                if sub is not None and sub.found:
                    return sub
                sub_path = locate_module(f"{module}.{head}", self.roots)
                if sub_path is not None and not rest:
                    return StaticResult(True, "", sub_path, 1, "module", via=via)
            return StaticResult(False, f"{module} has no top-level name {head!r}", path, via=via)
        node = found_node
        if isinstance(node, ast.ImportFrom):
            alias = next(a for a in node.names if (a.asname or a.name) == head)
            src = _resolve_relative(module, is_pkg, node.level, node.module) if node.level else node.module
            hop = via + [f"{module}:{head} -> from {src} import {alias.name}"]
            res = self.lookup(src, [alias.name] + rest, depth + 1, hop)
            if not res.found and alias.name != "*":
                sub = self.lookup(f"{src}.{alias.name}", rest, depth + 1, hop) if rest else None
                if sub is not None and sub.found:
                    return sub
            return res
        if isinstance(node, ast.Import):
            alias = next(a for a in node.names if a.asname == head or (a.asname is None and a.name.split(".")[0] == head))
            target_mod = alias.name if alias.asname else alias.name.split(".")[0]
            if not rest:
                return StaticResult(True, "", path, node.lineno, "import", via=via)
            return self.lookup(target_mod, rest, depth + 1, via + [f"{module}:{head} -> import {alias.name}"])
        if not rest:
            kind = {ast.FunctionDef: "function", ast.AsyncFunctionDef: "async function",
                    ast.ClassDef: "class"}.get(type(node), "assignment")
            params = _params(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            return StaticResult(True, "", path, node.lineno, kind, params, via=via)
        if isinstance(node, ast.ClassDef):
            res = self.in_body(module, is_pkg, path, node.body, rest, depth, via, owner=f"{module}:{node.name}")
            if res.found:
                return res
            for base in node.bases:  # inherited member
                dotted = _dotted(base)
                if dotted is None:
                    continue
                hop = via + [f"{module}:{node.name} inherits {dotted}"]
                bres = self.resolve_in_module_scope(module, is_pkg, path, dotted.split(".") + rest, depth + 1, hop)
                if bres.found:
                    return bres
            return res
        return StaticResult(False, f"{head!r} in {module} is not a class; cannot look up {'.'.join(rest)}", path, via=via)

    def resolve_in_module_scope(self, module, is_pkg, path, names, depth, via) -> StaticResult:
        tree = _parse(path)
        if tree is None:
            return StaticResult(False, f"could not parse {path}", via=via)
        return self.in_body(module, is_pkg, path, tree.body, names, depth, via)


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value)
        return None if inner is None else f"{inner}.{expr.attr}"
    if isinstance(expr, ast.Subscript):  # Generic[T]
        return _dotted(expr.value)
    return None


def resolve_static(target: str, roots: Sequence[str] | None = None) -> StaticResult:
    """Look ``target`` up by reading source. ``roots``: directories holding top-level
    packages (an unpacked wheel/sdist, a site-packages); None: the installed packages."""
    module, qualname = split_target(target)
    return _Resolver(roots).lookup(module, qualname.split("."), 0, [])


def module_exists(module: str, roots: Sequence[str] | None = None) -> bool:
    return locate_module(module, roots) is not None
