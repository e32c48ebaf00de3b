"""Generated blocks of the READMEs: written from the declarations, checked by the tests.

Tables that restate code (flags, the feature status, per-stack conformance) are never
hand-edited: ``ascend-rl docs --write`` regenerates every block between
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers, and ``ascend-rl docs`` (the check
the test suite runs) fails when one is stale.

Blocks:
- ``status`` (front README): one row per feature, from its :class:`Feature` declaration.
- ``flags`` (a feature's README; in ``patching/README.md`` the framework's own flags):
  from :func:`ascend_rl_plugins.flags.define`.
- ``conformance`` (a feature's README): each of its patches against the reference stacks;
  written only when the stacks are given (it reads their sources).
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Sequence

from . import flags as _flags
from .patching.core import REGISTRY

PACKAGE = os.path.dirname(os.path.abspath(__file__))
_BLOCK = re.compile(r"(<!-- (?P<name>[a-z]+):begin -->\n)(?P<body>.*?)(<!-- (?P=name):end -->)", re.S)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def flag_table(feature: str) -> str:
    """The flags a feature (or ``framework``) declares."""
    rows = [f for f in _flags.all_flags() if f.feature == feature]
    if not rows:
        return "(no flags)"
    lines = ["| flag | accepted | default | the recipe's name | meaning |", "|---|---|---|---|---|"]
    for f in rows:
        default = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
        default = "(empty)" if default in ("", ()) else default
        aliases = ", ".join(f"`{a}`" for a in f.aliases) or "-"
        lines.append(f"| `{f.name}` | {_cell(f.accepted())} | `{default}` | {aliases} | {_cell(f.doc)} |")
    return "\n".join(lines)


def status_table(link_prefix: str = "ascend_rl_plugins/features/") -> str:
    """Front-page table: what each feature is, how to switch it on, where it was verified."""
    lines = ["| feature | what it does | switched on by | stacks | verified here (CPU / doubles / static) "
             "| ran on an NPU |", "|---|---|---|---|---|---|"]
    for name in sorted(REGISTRY.features):
        f = REGISTRY.features[name]
        if f.switched_on_by:
            flag = _cell(f.switched_on_by)
        elif f.flag is not None:
            flag = f"`{f.flag.name}`"
        else:  # no switch: its patches are on by default, or it has none (a library / command)
            flag = "always on" if f.patches else "nothing to switch (no patches)"
        v = f.verified
        lines.append(f"| [{name}]({link_prefix}{name}/README.md) | {_cell(f.summary)} | {flag} | "
                     f"{_cell(f.stacks or '-')} | {v.kinds()} | {_cell(v.npu) if v.npu else 'no'} |")
    return "\n".join(lines)


def conformance_table(feature: str, stacks: Mapping[str, Sequence[str]]) -> str:
    """Each patch of ``feature`` against the named stacks (source roots)."""
    from .doctor import conformance_cell
    names = list(stacks)
    lines = ["| patch | target | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    patches = sorted((p for p in REGISTRY.patches.values() if p.feature.name == feature), key=lambda p: p.name)
    for p in patches:
        cells = [conformance_cell(p, stacks[n]) for n in names]
        lines.append(f"| `{p.name}` | `{p.target}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) if patches else "(no patches)"


def readme_files(repo: str) -> dict[str, str | None]:
    """README path -> the feature whose flags/conformance it shows (None: front page)."""
    files: dict[str, str | None] = {os.path.join(repo, "README.md"): None,
                                    os.path.join(PACKAGE, "patching", "README.md"): "framework"}
    for name in sorted(REGISTRY.features):
        files[os.path.join(PACKAGE, "features", name, "README.md")] = name
    return files


def render(text: str, feature: str | None, stacks: Mapping[str, Sequence[str]] | None) -> str:
    """``text`` with every generated block it holds regenerated (conformance blocks are left
    alone when ``stacks`` is None)."""
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name == "status":
            body = status_table()
        elif name == "flags" and feature is not None:
            body = flag_table(feature)
        elif name == "conformance" and feature is not None and stacks is not None:
            body = conformance_table(feature, stacks)
        else:
            return m.group(0)
        return f"{m.group(1)}{body}\n{m.group(4)}"
    return _BLOCK.sub(fill, text)


def missing_readmes(repo: str) -> list[str]:
    """The READMEs :func:`stale` reads that do not exist: with ``repo/README.md`` among them,
    ``repo`` is no checkout of this project (an installed package has no front README to
    regenerate), and nothing can be checked or written."""
    return [path for path in readme_files(repo) if not os.path.exists(path)]


def stale(repo: str, stacks: Mapping[str, Sequence[str]] | None = None, write: bool = False) -> list[str]:
    """READMEs whose generated blocks differ from the declarations (rewritten when ``write``).
    A missing README is listed as ``PATH (missing)`` and never written: check
    :func:`missing_readmes` first (``ascend-rl docs`` refuses to run with any missing)."""
    out = []
    for path, feature in readme_files(repo).items():
        if not os.path.exists(path):
            out.append(f"{path} (missing)")
            continue
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new = render(text, feature, stacks)
        if new != text:
            out.append(path)
            if write:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(new)
    return out
