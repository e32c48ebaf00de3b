"""``ascend-rl doctor``: which patches will apply to the installed stack, and why not.

Runs before a 64-NPU job is launched, on any machine: targets are resolved by reading the
source (no import), against the installed packages or an unpacked stack directory.
``--import`` additionally applies everything in a fresh process and reports the outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

from .patching import static as _static
from .patching.core import REGISTRY, Patch


def cache_dir() -> str:
    return os.environ.get("ASCEND_RL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ascend-rl")


def stack_roots(stack: str) -> tuple[str, list[str], str | None]:
    """(stack dir, source roots, python of its venv or None) for a name or a directory."""
    path = stack
    if not os.path.isdir(path):
        named = os.path.join(cache_dir(), "stacks", stack)
        if os.path.isdir(named):
            path = named
        else:
            raise SystemExit(f"ascend-rl doctor: --stack {stack!r} is neither a directory nor a built "
                             f"stack under {os.path.join(cache_dir(), 'stacks')} (build one with "
                             f"`bash .ci/stack.sh recipe|current`)")
    roots = [os.path.realpath(path)]
    src = os.path.join(path, "src")
    if os.path.isdir(src):
        roots += [os.path.realpath(os.path.join(src, d)) for d in sorted(os.listdir(src))]
    py = os.path.join(path, "venv", "bin", "python")
    return path, roots, py if os.path.exists(py) else None


@dataclass
class Row:
    feature: str
    patch: str
    target: str
    kind: str
    dist: str
    version: str | None
    supported: str
    enabled: bool
    flag: str
    version_state: str  # ok | outside | absent
    resolves: bool | None
    where: str
    verdict: str
    problem: bool
    runtime: str = ""  # with --import: applied / skipped / failed ... in a fresh process

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate(p: Patch, roots: Sequence[str] | None = None) -> Row:
    try:
        enabled, flag_why = p.flag_state()
    except Exception as exc:  # a broken condition is reported, not fatal to the report
        enabled, flag_why = False, f"condition raised {type(exc).__name__}: {exc}"
    vstate, version, vwhy = p.version_state(roots)
    res = None
    where = ""
    if vstate != "absent":
        r = _static.resolve_static(p.target, roots)
        if not r.found and p.kind == "set" and p.create:
            # the attribute is created by the patch: only its owner has to exist
            module, qualname = p.target.split(":")
            owner = qualname.rsplit(".", 1)[0] if "." in qualname else None
            r = (_static.resolve_static(f"{module}:{owner}", roots) if owner
                 else _static.StaticResult(_static.module_exists(module, roots), f"module {module} not found",
                                           _static.locate_module(module, roots)))
        res = r.found
        where = r.where() if r.found else r.why
        if r.found and p.params is not None and r.params is not None and not any(x.startswith("**") for x in r.params):
            names = {x.lstrip("*") for x in r.params}
            gone = [x for x in p.params if x.lstrip("*") not in names]
            if gone:
                res = False
                where = f"{r.where()}: parameter(s) {', '.join(gone)} gone (has {', '.join(r.params)})"
    if vstate == "absent":
        verdict, problem = f"n/a: {vwhy}", False
    elif vstate == "outside":
        if p.fixed_upstream:
            verdict, problem = f"not needed: {vwhy}", False
        else:
            verdict, problem = f"not for this version: {vwhy}", enabled and p.explicitly_enabled()
    elif not res:
        verdict, problem = f"TARGET MISSING: {where}", enabled
    elif enabled:
        verdict, problem = "will apply", False
    else:
        verdict, problem = "off", False
    return Row(p.feature.name, p.name, p.target, p.kind, p.dist, version, str(p.versions or "any"),
               enabled, flag_why, vstate, res, where, verdict, problem)


def find_conflicts(rows: list[Row]) -> list[str]:
    by_target: dict[str, list[Patch]] = {}
    for row in rows:
        if row.verdict == "will apply":
            p = REGISTRY.patches[row.patch]
            by_target.setdefault(p.target, []).append(p)
    problems = []
    for target, ps in by_target.items():
        replacing = [p.name for p in ps if not p.is_wrapper]
        if len(replacing) > 1:
            problems.append(f"{target}: {' and '.join(replacing)} both replace it")
        wrappers = [p for p in ps if p.is_wrapper]
        orders = [p.order for p in wrappers]
        if len(wrappers) > 1 and (None in orders or len(set(orders)) != len(orders)):
            problems.append(f"{target}: {' and '.join(p.name for p in wrappers)} wrap it without "
                            f"distinct declared orders")
    return problems


_IMPORT_PROBE = r"""
import importlib, json, os, sys
os.environ.setdefault("ASCEND_RL_AUTOLOAD", "0")
import ascend_rl_plugins as arp
from ascend_rl_plugins.patching.core import REGISTRY
arp.activate("doctor --import")
errors = {}
for p in REGISTRY.patches.values():
    if p.outcome.state == "pending":
        try:
            importlib.import_module(p.module)
        except BaseException as exc:
            errors[p.name] = f"import of {p.module} failed: {type(exc).__name__}: {str(exc)[:200]}"
out = []
for s in arp.status():
    if s["state"] == "pending" and s["patch"] in errors:
        s["reason"] = errors[s["patch"]]
    out.append(s)
print("@@ASCEND_RL_STATUS@@" + json.dumps(out))
"""


def run_import_probe(python: str | None) -> dict[str, dict]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu",
               ASCEND_RL_AUTOLOAD="0")
    env.pop("_ASCEND_RL_CLI", None)
    proc = subprocess.run([python or sys.executable, "-c", _IMPORT_PROBE], env=env,
                          capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("@@ASCEND_RL_STATUS@@"):
            return {s["patch"]: s for s in json.loads(line[len("@@ASCEND_RL_STATUS@@"):])}
    raise RuntimeError(f"the --import probe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


@dataclass
class FeatureNote:
    """A feature that cannot do its job on this stack (declared with does_not_apply)."""
    feature: str
    why: str
    enabled: bool
    problem: bool

    def as_dict(self) -> dict:
        return asdict(self)


def feature_notes(roots: Sequence[str] | None = None) -> list[FeatureNote]:
    notes = []
    for name in sorted(REGISTRY.features):
        f = REGISTRY.features[name]
        try:
            on = f.switched_on()
        except Exception:  # a bad flag value is reported by validate_all, not here
            on = False
        for why in f.inapplicable(roots):
            notes.append(FeatureNote(name, why, on, on))
    return notes


def diagnose(roots: Sequence[str] | None = None, python: str | None = None,
             with_import: bool = False) -> tuple[list[Row], list[str]]:
    rows = [evaluate(p, roots) for p in REGISTRY.patches.values()]
    conflicts = find_conflicts(rows)
    if with_import:
        runtime = run_import_probe(python)
        for row in rows:
            s = runtime.get(row.patch)
            if s is None:
                row.runtime = "unknown to that interpreter"
                continue
            row.runtime = s["state"] + (f": {s['reason']}" if s["reason"] else "")
            if row.enabled and row.version_state == "ok" and s["state"] in ("failed",):
                row.problem = True
            if row.verdict == "will apply" and s["state"] == "skipped":
                row.problem = True
    return rows, conflicts


def render(rows: list[Row], conflicts: list[str], title: str, stream=None,
           notes: Sequence[FeatureNote] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream or sys.stdout, width=200)
    table = Table(title=title, show_lines=False)
    for col in ("feature", "patch", "target", "version", "supported", "flag", "target found", "verdict"):
        table.add_column(col, overflow="fold")
    show_runtime = any(r.runtime for r in rows)
    if show_runtime:
        table.add_column("in a fresh process", overflow="fold")
    for r in rows:
        style = "red" if r.problem else ("green" if r.verdict == "will apply" else None)
        found = "-" if r.resolves is None else ("yes" if r.resolves else "NO")
        cells = [r.feature, r.patch.split(".", 1)[-1], r.target, r.version or "-", r.supported,
                 r.flag, found, r.verdict]
        if show_runtime:
            cells.append(r.runtime)
        table.add_row(*cells, style=style)
    console.print(table)
    for c in conflicts:
        console.print(f"[red]CONFLICT[/red] {c}")
    for n in notes:
        head = ("[red]FEATURE DOES NOT APPLY[/red] (it is switched on)" if n.problem
                else "feature does not apply here")
        console.print(f"{head}: {n.feature}: {n.why}", markup=True, highlight=False)
    bad = sum(r.problem for r in rows) + len(conflicts) + sum(n.problem for n in notes)
    will = sum(r.verdict == "will apply" for r in rows)
    console.print(f"{len(rows)} patches: {will} will apply, {bad} problem(s).")


def markdown_table(stacks: dict[str, Sequence[str]]) -> str:
    """Conformance table: for every patch, what happens on each named stack."""
    names = list(stacks)
    lines = ["| feature | patch | target | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for p in sorted(REGISTRY.patches.values(), key=lambda p: (p.feature.name, p.name)):
        cells = []
        for n in names:
            r = evaluate(p, stacks[n])
            if r.version_state == "absent":
                cells.append(f"n/a ({p.dist} absent)")
            elif r.version_state == "outside":
                cells.append(("fixed upstream" if p.fixed_upstream else "outside range") + f" ({r.version})")
            else:
                cells.append(f"resolves ({r.version})" if r.resolves else f"**missing** ({r.version})")
        lines.append(f"| {p.feature.name} | `{p.name}` | `{p.target}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_features() -> str:
    """Feature table: name, flags, what it replaces, stacks, how it is verified here."""
    from . import flags as _flags
    lines = ["| feature | flags | what it replaces | stacks where it applies | how it is verified here |",
             "|---|---|---|---|---|"]
    for name in sorted(REGISTRY.features):
        f = REGISTRY.features[name]
        names = [fl.name for fl in _flags.all_flags() if fl.feature == name]
        if f.flag is not None and f.flag.name not in names:
            names.insert(0, f.flag.name)
        lines.append(f"| {name} | {', '.join(f'`{n}`' for n in names) or '-'} | {f.replaces or '-'} | "
                     f"{f.stacks or '-'} | {f.verified or '-'} |")
    return "\n".join(lines)
