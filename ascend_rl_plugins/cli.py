"""The ``ascend-rl`` command: ``doctor``, ``env``, ``conformance`` and feature commands."""

from __future__ import annotations

import argparse
import json
import os
import sys


WIDE_COLUMNS = 240  # doctor.WIDE (not imported here: building the parser stays light)

# Import name -> what to pip install, where they differ.
PIP_NAMES: dict[str, str] = {}


def needs(parser: argparse.ArgumentParser, *modules: str) -> None:
    """Declare the optional packages a (sub)command imports: :func:`main` checks them before
    running it and says which are missing and how to install them, instead of a
    ModuleNotFoundError traceback from deep inside the command."""
    parser.set_defaults(needs=(parser.prog, modules))


def uses_flags(parser: argparse.ArgumentParser) -> None:
    """Declare that a (sub)command reports or acts on the ``ASCEND_RL_*`` flags: :func:`main`
    validates them first, as activation would (bad values, misspelled names, ASCEND_RL_DISABLE
    items that name nothing), and stops with the message and exit status 2 instead of
    reporting a configuration the plugin would refuse."""
    parser.set_defaults(uses_flags=parser.prog)


def _flags_refused(prog: str) -> bool:
    """Validate every flag for ``prog`` (see :func:`uses_flags`); True when it printed why not."""
    from . import flags
    try:
        flags.validate_all(misspellings=True)  # what activation would refuse
    except flags.FlagError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return True
    return False


def _error(prog: str, message: str) -> int:
    """One line on stderr, argparse's shape (``PROG: error: ...``), exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def missing_modules(modules) -> list[str]:
    """Those of ``modules`` that cannot be imported here (found without importing them)."""
    import importlib.util
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def _missing_message(prog: str, missing) -> str:
    install = " ".join(PIP_NAMES.get(m, m) for m in missing)
    return (f"{prog}: error: this command needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed in {sys.executable}; "
            f"install with: pip install {install}")


def _load() -> None:
    from . import plugin
    plugin.load_features()


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    python = args.python
    roots = None
    title = f"ascend-rl doctor: installed packages of {sys.executable}"
    where = sys.executable
    if args.stack:
        try:
            path, roots, venv_py = doctor.stack_roots(args.stack)
        except doctor.StackNotFound as exc:
            return _error("ascend-rl doctor", f"--stack {exc}")
        python = python or venv_py
        title = f"ascend-rl doctor: stack {path}"
        where = f"the stack {path}"
    rows, conflicts = doctor.diagnose(roots, python, args.do_import)
    served, missing = doctor.served_packages(rows)
    # nothing the plugin patches is here: every row is 'n/a', which must not read as healthy
    nothing_served = doctor.nothing_served_message(missing, where) if served and missing == served else ""
    notes = doctor.feature_notes(roots)
    extensions = doctor.extension_notes(roots)
    if args.removal:
        ledger = doctor.removal_ledger(rows)
        if args.json:
            print(json.dumps({"title": title, "removal": ledger}, indent=2))
        else:
            doctor.render_removal(ledger, title, wide=args.wide)
        return 0
    if args.json:
        from . import plugin
        print(json.dumps({"title": title, "patches": [r.as_dict() for r in rows],
                          "conflicts": conflicts, "features_not_applicable": [n.as_dict() for n in notes if not n.advice],
                          "feature_advice": [n.as_dict() for n in notes if n.advice],
                          "features_through_extension_points": [e.as_dict() for e in extensions],
                          "packages_not_installed": missing, "nothing_served": nothing_served,
                          # the CLI inspects, never applies: both stay empty (tests hold it to that)
                          "activated_in_this_process": plugin.activated_by(),
                          "applied_in_this_process": [s["patch"] for s in plugin.status()
                                                      if s["state"] in ("applied", "pending")]},
                         indent=2))
    else:
        doctor.render(rows, conflicts, title, notes=notes, wide=args.wide, extensions=extensions,
                      nothing_served=nothing_served)
    if nothing_served and args.json:
        print(f"ascend-rl doctor: {nothing_served}", file=sys.stderr)
    return 1 if any(r.problem for r in rows) or conflicts or any(n.problem for n in notes) or nothing_served else 0


def cmd_env(args: argparse.Namespace) -> int:
    from . import flags

    rows = []
    bad = 0
    for f in flags.all_flags():
        raw, source = f.lookup(os.environ)
        try:
            value = f.value
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            unknown_items = f.unknown_items_error()  # e.g. an ASCEND_RL_DISABLE item naming nothing
            if unknown_items is not None:
                raise unknown_items
        except flags.FlagError as exc:
            shown, bad = f"INVALID: {exc}", bad + 1
        rows.append({"flag": f.name, "value": shown, "source": source, "default": str(f.default),
                     "accepted": f.accepted(), "aliases": ", ".join(f.aliases), "meaning": f.doc,
                     "feature": f.feature})
    unknown = flags.unknown_variables()
    bad += len(flags.near_misses())  # activation refuses a misspelled flag name
    if args.json:
        print(json.dumps({"flags": rows, "unknown": unknown}, indent=2))
    else:
        from rich.table import Table

        from .doctor import console as make_console, is_narrow
        console = make_console(wide=args.wide)
        narrow = is_narrow(console, args.wide)
        table = Table(title="ascend-rl flags")
        columns = ("flag", "value", "source") if narrow else ("flag", "value", "source", "aliases", "meaning")
        for col in columns:
            table.add_column(col, overflow="fold")
        for r in rows:
            cells = {"flag": r["flag"], "value": r["value"], "source": r["source"], "aliases": r["aliases"],
                     "meaning": f"{r['meaning']} Accepted: {r['accepted']}."}
            table.add_row(*(cells[c] for c in columns),
                          style="red" if r["value"].startswith("INVALID") else None)
        console.print(table)
        if narrow:
            console.print("Meanings, accepted values and the recipe's names: --wide (or --json).", highlight=False)
        for name in unknown:
            console.print(f"[yellow]unknown[/yellow] {flags.unknown_message(name)}", highlight=False)
    return 2 if bad else 0


def _stacks(names: list[str]) -> dict[str, list[str]]:
    """Source roots of each named stack; raises doctor.StackNotFound for one that is not."""
    from . import doctor
    return {os.path.basename(n.rstrip("/")): doctor.stack_roots(n)[1] for n in names}


def cmd_conformance(args: argparse.Namespace) -> int:
    from . import doctor
    try:
        stacks = _stacks(args.stacks)
    except doctor.StackNotFound as exc:
        return _error("ascend-rl conformance", f"stack {exc}")
    print(doctor.markdown_table(stacks))
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    from . import docs, doctor
    repo = os.path.abspath(args.repo)
    missing = docs.missing_readmes(repo)
    front = os.path.join(repo, "README.md")
    if front in missing:
        return _error("ascend-rl docs", f"--repo {repo} is not a checkout of ascend-rl-plugins (it has no "
                                        f"README.md), so nothing was checked or written; the generated tables "
                                        f"are blocks of a source checkout's READMEs: pass --repo CHECKOUT, or "
                                        f"run the ascend-rl of an editable install (pip install -e CHECKOUT)")
    if missing:
        return _error("ascend-rl docs", "missing README(s): " + ", ".join(missing) + "; every feature "
                                        "keeps a README.md with its generated blocks (copy the markers "
                                        "from another feature's)")
    try:
        stacks = _stacks(args.stacks) if args.stacks else None
    except doctor.StackNotFound as exc:
        return _error("ascend-rl docs", f"--stacks {exc}")
    out = docs.stale(repo, stacks, write=args.write)
    for path in out:
        print(("rewrote " if args.write else "stale: ") + os.path.relpath(path, repo))
    if out and not args.write:
        print("regenerate with: ascend-rl docs --write" + (" --stacks " + " ".join(args.stacks) if args.stacks else ""))
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ascend-rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="which patches will apply to this stack, and why not")
    d.add_argument("--stack", help="a stack directory (or 'recipe'/'current' built by .ci/stack.sh) "
                                   "to check instead of the installed packages")
    d.add_argument("--import", dest="do_import", action="store_true",
                   help="also apply everything in a fresh process and report the outcome")
    d.add_argument("--python", help="interpreter for --import (default: the stack's venv or this one)")
    d.add_argument("--removal", action="store_true",
                   help="the removal ledger: when each patch becomes dead code, the upstream "
                        "issue/PR, and whether this stack still needs it")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--wide", action="store_true",
                   help=f"every column, {WIDE_COLUMNS} characters wide (default: the terminal's width, COLUMNS)")
    d.set_defaults(func=cmd_doctor)
    uses_flags(d)
    e = sub.add_parser("env", help="every flag: value, source and meaning")
    e.add_argument("--json", action="store_true")
    e.add_argument("--wide", action="store_true",
                   help=f"every column, {WIDE_COLUMNS} characters wide (default: the terminal's width, COLUMNS)")
    e.set_defaults(func=cmd_env)
    c = sub.add_parser("conformance", help="markdown table of every patch against named stacks")
    c.add_argument("stacks", nargs="*", default=["recipe", "current"], help="stack names or directories")
    c.set_defaults(func=cmd_conformance)
    g = sub.add_parser("docs", help="check (or --write) the READMEs' generated tables: feature status, "
                                    "flags, per-stack conformance")
    g.add_argument("--write", action="store_true", help="rewrite stale blocks instead of failing")
    g.add_argument("--stacks", nargs="*", default=None,
                   help="also the conformance blocks, against these stacks (names or directories)")
    g.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="the repository whose README.md is the front page (default: this checkout)")
    g.set_defaults(func=cmd_docs)
    # feature commands (e.g. `ascend-rl flashrl ...`): a feature module exposes register_cli
    from . import features
    for _, register in features.modules_with("register_cli"):
        register(sub)
    from . import selftest
    selftest.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    _load()
    parser = build_parser()
    args = parser.parse_args(argv)
    prog, modules = getattr(args, "needs", (parser.prog, ()))
    missing = missing_modules(modules)
    if missing:
        print(_missing_message(prog, missing), file=sys.stderr)
        return 2
    if getattr(args, "uses_flags", None) and _flags_refused(args.uses_flags):
        return 2
    try:
        return args.func(args) or 0
    except ModuleNotFoundError as exc:
        # an optional package the command did not declare: still one line, not a traceback
        if not exc.name or exc.name.split(".")[0] == __package__ or \
                os.environ.get("ASCEND_RL_LOG_LEVEL", "").strip().lower() == "debug":
            raise
        print(_missing_message(prog, [exc.name.split(".")[0]]), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
