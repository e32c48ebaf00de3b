"""Patch targets are written ``module.path:Qualified.name``; this is the one parser.

Kept apart from ``static`` (which imports ``ast``) so that declaring patches at plugin
import stays cheap."""

from __future__ import annotations


def split_target(target: str) -> tuple[str, str]:
    """``'pkg.mod:Class.method'`` -> ``('pkg.mod', 'Class.method')``; ValueError otherwise."""
    if target.count(":") != 1:
        raise ValueError(f"target {target!r} must look like 'module.path:Qualified.name'")
    module, qualname = target.split(":")
    if not module or not qualname or any(not p.isidentifier() for p in module.split(".") + qualname.split(".")):
        raise ValueError(f"target {target!r} must look like 'module.path:Qualified.name'")
    return module, qualname
