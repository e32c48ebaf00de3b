"""Compare the MindSpeed double (tests/doubles/mindspeed_double) with MindSpeed's source.

MindSpeed is read, never imported (it needs torch_npu and CANN): ``signature`` finds a
function or method in a ``mindspeed`` source tree by parsing it, so the same call reads the
reference copy (``tests.support.stacks.mindspeed_source()``) and the double.
"""

from __future__ import annotations

import ast
import os

DOUBLE_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mindspeed_double")


def parse_module(root: str, module: str) -> ast.Module:
    """``mindspeed.x.y`` under ``root`` (the directory holding the ``mindspeed`` package)."""
    rel = module.replace(".", os.sep)
    for path in (os.path.join(root, rel + ".py"), os.path.join(root, rel, "__init__.py")):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                return ast.parse(fh.read(), filename=path)
    raise FileNotFoundError(f"{module} not under {root}")


def definition(root: str, module: str, qualname: str):
    """The ``ast`` node of ``qualname`` (``f`` or ``Class.method``) in ``module``."""
    body = parse_module(root, module).body
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise LookupError(f"{module}:{qualname} not found under {root}")
        body = node.body
    return node


def signature(root: str, module: str, qualname: str) -> list[str]:
    """Parameter names (with * / ** marks) and defaults, as written."""
    args = definition(root, module, qualname).args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [a.arg + ("=" + ast.unparse(d) if d is not None else "") for a, d in zip(positional, defaults)]
    if args.vararg:
        out.append("*" + args.vararg.arg)
    out += [a.arg + ("=" + ast.unparse(d) if d is not None else "")
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append("**" + args.kwarg.arg)
    return out


def mismatches(reference_root: str, names: list[tuple[str, str]]) -> list[str]:
    """``module:qualname`` entries whose signature differs between MindSpeed and the double."""
    bad = []
    for module, qualname in names:
        real, double = signature(reference_root, module, qualname), signature(DOUBLE_ROOT, module, qualname)
        if real != double:
            bad.append(f"{module}:{qualname}: MindSpeed {real} != double {double}")
    return bad
