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

from .patching.core import REGISTRY, Patch, conflict
from .patching.decision import decide


def cache_dir() -> str:
    return os.environ.get("ASCEND_RL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ascend-rl")


class StackNotFound(ValueError):
    """A stack named on the command line is neither a directory nor a built stack. The message
    leaves out the command and option: each command that takes stacks (doctor --stack,
    conformance, docs --stacks) prefixes its own."""


def stack_roots(stack: str) -> tuple[str, list[str], str | None]:
    """(stack dir, source roots, python of its venv or None) for a name or a directory."""
    path = stack
    if not os.path.isdir(path):
        built = os.path.join(cache_dir(), "stacks")
        named = os.path.join(built, stack)
        if not os.path.isabs(stack) and os.path.isdir(named):
            path = named
        else:
            names = sorted(d for d in os.listdir(built) if os.path.isdir(os.path.join(built, d))) \
                if os.path.isdir(built) else []
            raise StackNotFound(
                f"{stack!r} is neither a directory nor a stack built under {built} "
                f"({'built there: ' + ', '.join(names) if names else 'none is built there'}); accepted: "
                f"a stack directory (an unpacked source tree or a venv), or the name of a stack built "
                f"with `bash .ci/stack.sh recipe|current`")
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


def evaluate(p: Patch, roots: Sequence[str] | None = None, sibling_in_range: bool = False) -> Row:
    """Doctor's row for ``p``: the shared decision, with the target resolved by reading source.
    ``sibling_in_range``: another patch behind the same switch is meant for this stack's
    versions (see :meth:`Decision.verdict`; :func:`diagnose` works it out)."""
    d = decide(p, roots, check_target=True)
    verdict, problem = d.verdict(p, sibling_in_range)
    return Row(p.feature.name, p.name, p.target, p.kind, p.dist, d.version, str(p.versions or "any"),
               d.flag_on, d.gate_error or d.flag_why, d.version_state, d.target_found, d.target_where,
               verdict, problem)


def find_conflicts(rows: list[Row]) -> list[str]:
    """Pairs of patches that would both be applied to one target and cannot be composed."""
    by_target: dict[str, list[Patch]] = {}
    for row in rows:
        if row.verdict == "will apply":
            p = REGISTRY.patches[row.patch]
            by_target.setdefault(p.target, []).append(p)
    problems = []
    for ps in by_target.values():
        for i, a in enumerate(ps):
            for b in ps[i + 1:]:
                why = conflict(a, b)
                if why:
                    problems.append(why)
    return problems


def served_packages(rows: Sequence[Row]) -> tuple[list[str], list[str]]:
    """(every distribution the patches target, those of them absent from the checked stack)."""
    served = sorted({r.dist for r in rows if r.dist})
    present = {r.dist for r in rows if r.dist and r.version_state != "absent"}
    return served, [d for d in served if d not in present]


def nothing_served_message(missing: Sequence[str], where: str) -> str:
    """The problem when none of the packages the plugin patches is installed: every patch is
    'n/a' and the report looks clean, yet nothing would apply (e.g. the plugin installed into
    the wrong venv)."""
    return (f"none of the packages ascend-rl patches is installed in {where}: {', '.join(missing)} "
            f"are all missing, so no patch can apply here. Install ascend-rl-plugins into the venv that "
            f"runs vLLM / verl / Megatron-Core, or point doctor at that stack with --stack DIR.")


def run_import_probe(python: str | None) -> dict[str, dict]:
    """Apply everything in a fresh interpreter (``python``, default this one) and return
    each patch's outcome there (see :mod:`ascend_rl_plugins.doctor_probe`)."""
    from rich.console import Console

    from . import doctor_probe
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu",
               ASCEND_RL_AUTOLOAD="0")
    # importing every patched module takes about a minute: say so on stderr (a spinner on a
    # terminal, one line otherwise), never on stdout, which --json keeps for the report
    what = f"ascend-rl doctor --import: applying every patch in a fresh {python or sys.executable} " \
           f"(imports vLLM, verl, Megatron-Core: about a minute)"
    err = Console(stderr=True)
    if err.is_terminal:
        with err.status(what):
            proc = subprocess.run([python or sys.executable, "-m", doctor_probe.__name__], env=env,
                                  capture_output=True, text=True, timeout=900)
    else:
        print(what + " ...", file=sys.stderr, flush=True)
        proc = subprocess.run([python or sys.executable, "-m", doctor_probe.__name__], env=env,
                              capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith(doctor_probe.MARK):
            return {s["patch"]: s for s in json.loads(line[len(doctor_probe.MARK):])}
    raise RuntimeError(f"the --import probe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


@dataclass
class FeatureNote:
    """A feature that cannot do its job on this stack (declared with does_not_apply), or, with
    ``advice`` set, what a switched-on feature asks to be told (declared with advise)."""
    feature: str
    why: str
    enabled: bool
    problem: bool
    advice: bool = False

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
        # a problem only when the user asked for it: a feature that is on by default and
        # does nothing on this stack is worth a note, not a failing exit status
        asked = on and f.flag is not None and f.flag.explicitly_set
        for why in f.inapplicable(roots):
            notes.append(FeatureNote(name, why, on, asked))
        if on:
            try:
                said = f.advice()
            except Exception as exc:  # a broken check must not take doctor down
                said = [f"(its doctor check failed: {type(exc).__name__}: {exc})"]
            notes.extend(FeatureNote(name, why, on, False, advice=True) for why in said)
    return notes


@dataclass
class ExtensionNote:
    """A feature that works on this stack through an upstream extension point (no patch)."""
    feature: str
    how: str

    def as_dict(self) -> dict:
        return asdict(self)


def extension_notes(roots: Sequence[str] | None = None) -> list[ExtensionNote]:
    return [ExtensionNote(name, how) for name in sorted(REGISTRY.features)
            for how in REGISTRY.features[name].enabled_through(roots)]


def _switch_of(p: Patch) -> tuple[str, int]:
    """Patches behind one switch (one feature, one gate) are siblings: versions of one job."""
    return p.feature.name, id(p.gate)


def diagnose(roots: Sequence[str] | None = None, python: str | None = None,
             with_import: bool = False) -> tuple[list[Row], list[str]]:
    patches = list(REGISTRY.patches.values())
    in_range = {_switch_of(p) for p in patches if p.version_state(roots)[0] == "ok"}
    rows = [evaluate(p, roots, _switch_of(p) in in_range) for p in patches]
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


# Below this many columns the tables keep only the columns a decision needs (the rest
# wraps every row onto several lines); ``--wide`` shows everything at WIDE columns.
NARROW_BELOW = 160
WIDE = 240


def console(stream=None, wide: bool = False):
    """A rich console as wide as the terminal (rich honours ``COLUMNS``; 80 when output is
    not a terminal and ``COLUMNS`` is unset), or :data:`WIDE` columns with ``--wide``."""
    from rich.console import Console
    return Console(file=stream or sys.stdout, width=WIDE if wide else None)


def is_narrow(out, wide: bool) -> bool:
    return not wide and out.width < NARROW_BELOW


def render(rows: list[Row], conflicts: list[str], title: str, stream=None,
           notes: Sequence[FeatureNote] = (), wide: bool = False,
           extensions: Sequence[ExtensionNote] = (), nothing_served: str = "") -> None:
    from rich.table import Table

    out = console(stream, wide)
    narrow = is_narrow(out, wide)
    table = Table(title=title, show_lines=False)
    # narrow: the patch name already starts with its feature, the switch shows as on/off and the
    # verdict as its head word(s); a problem's whole verdict follows the table, and --wide shows
    # target, range and resolution for every row
    columns = (("patch", "version", "on", "verdict") if narrow else
               ("feature", "patch", "target", "version", "supported", "flag", "target found", "verdict"))
    for col in columns:
        table.add_column(col, overflow="fold")
    show_runtime = any(r.runtime for r in rows)
    if show_runtime:
        table.add_column("in a fresh process", overflow="fold")
    for r in rows:
        style = "red" if r.problem else ("green" if r.verdict == "will apply" else None)
        found = "-" if r.resolves is None else ("yes" if r.resolves else "NO")
        cells = dict(feature=r.feature, patch=r.patch, target=r.target, version=r.version or "-",
                     supported=r.supported, flag=r.flag, on="on" if r.enabled else "off",
                     verdict=r.verdict.split(":", 1)[0] if narrow else r.verdict)
        cells["target found"] = found
        row = [cells[c] for c in columns]
        if show_runtime:
            row.append(r.runtime)
        table.add_row(*row, style=style)
    out.print(table)
    if narrow:
        for r in rows:
            if r.problem:
                out.print(f"[red]PROBLEM[/red] {r.patch}: {r.verdict}", highlight=False)
    for c in conflicts:
        out.print(f"[red]CONFLICT[/red] {c}")
    for n in notes:
        head = ("[yellow]note[/yellow]" if n.advice else
                "[red]FEATURE DOES NOT APPLY[/red] (it is switched on)" if n.problem
                else "feature does not apply here")
        out.print(f"{head}: {n.feature}: {n.why}", markup=True, highlight=False)
    for e in extensions:
        out.print(f"[green]feature applies[/green] (an upstream extension point, enable it in your config): "
                  f"{e.feature}: {e.how}", markup=True, highlight=False, overflow="fold")
    served, missing = served_packages(rows)
    if nothing_served:
        out.print(f"[red]PROBLEM[/red] {nothing_served}", highlight=False)
    elif missing:
        out.print(f"not installed here (their patches are n/a): {', '.join(missing)}", highlight=False)
    bad = sum(r.problem for r in rows) + len(conflicts) + sum(n.problem for n in notes) + bool(nothing_served)
    will = sum(r.verdict == "will apply" for r in rows)
    out.print(f"{len(rows)} patches: {will} will apply, {bad} problem(s).")
    out.print("Leave any patch or whole feature unapplied with ASCEND_RL_DISABLE=<patch or feature>[,...] "
              "(a patch name as listed, or its feature: the part before the dot); `ascend-rl doctor "
              "--removal` says when each patch can go." + (" Every column: --wide." if narrow else ""),
              highlight=False)


def removal_ledger(rows: Sequence[Row]) -> list[dict]:
    """For every patch: what makes it dead code, the upstream link, and whether the stack
    the rows were computed for still needs it."""
    out = []
    for r in sorted(rows, key=lambda r: r.patch):
        p = REGISTRY.patches[r.patch]
        if r.version_state == "absent":
            here = f"n/a ({p.dist} absent)"
        elif r.version_state == "outside":
            here = f"not needed on {r.version}" + (f" (fixed upstream: {p.fixed_upstream})" if p.fixed_upstream else "")
        else:
            here = f"needed on {r.version}"
        out.append({"patch": p.name, "remove_when": p.remove_when, "upstream": p.upstream or "",
                    "replaces": p.replaces, "this_stack": here})
    return out


def render_removal(ledger: Sequence[dict], title: str, stream=None, wide: bool = False) -> None:
    from rich.table import Table

    out = console(stream, wide)
    narrow = is_narrow(out, wide)
    table = Table(title=f"{title}: removal ledger")
    columns = ("patch", "this stack", "remove when") if narrow else \
        ("patch", "remove when", "upstream issue/PR", "this stack")
    # the patch name is what a reader scans for: unbroken where the terminal leaves room for it
    longest = max((len(e["patch"]) for e in ledger), default=0)
    for col in columns:
        table.add_column(col, overflow="fold",
                         min_width=min(longest, out.width * 2 // 5) if col == "patch" else None)
    for e in ledger:
        cells = {"patch": e["patch"], "remove when": e["remove_when"], "upstream issue/PR": e["upstream"] or "-",
                 "this stack": e["this_stack"]}
        table.add_row(*(cells[c] for c in columns))
    out.print(table)
    if narrow:
        out.print("Upstream issues/PRs: --wide (or --json).", highlight=False)


def conformance_cell(p: Patch, roots: Sequence[str]) -> str:
    """What happens to ``p`` on the stack at ``roots``, in a few words (conformance tables)."""
    r = evaluate(p, roots)
    if r.version_state == "absent":
        return f"n/a ({p.dist} absent)"
    if r.version_state == "outside":
        return ("fixed upstream" if p.fixed_upstream else "outside range") + f" ({r.version})"
    return f"resolves ({r.version})" if r.resolves else f"**missing** ({r.version})"


def markdown_table(stacks: dict[str, Sequence[str]]) -> str:
    """Conformance table: for every patch, what happens on each named stack."""
    names = list(stacks)
    lines = ["| feature | patch | target | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for p in sorted(REGISTRY.patches.values(), key=lambda p: (p.feature.name, p.name)):
        cells = [conformance_cell(p, stacks[n]) for n in names]
        lines.append(f"| {p.feature.name} | `{p.name}` | `{p.target}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
