"""The one place that decides what will happen to a patch, and why.

``Registry.activate`` asks it for the running process (flags from the environment,
versions of the installed distributions); ``ascend-rl doctor`` asks it for any stack
(versions read from an unpacked tree, the target resolved by reading source). Both get the
same answer for the same facts, so what doctor promises is what activation does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from .. import flags as _flags


class PatchFacts(Protocol):
    """What a decision reads of a patch (:class:`.core.Patch` has it). Spelled out here so that
    this module does not import :mod:`.core`, which imports this one: the framework's layers
    go one way, core -> decision."""

    target: str
    kind: str
    create: bool
    params: tuple[str, ...] | None
    fixed_upstream: str

    def flag_state(self) -> tuple[bool, str]: ...

    def version_state(self, roots: Sequence[str] | None) -> tuple[str, str | None, str]: ...

    def explicitly_enabled(self) -> bool: ...


@dataclass(frozen=True)
class Decision:
    """What will happen to one patch on one stack."""

    apply: bool  # flag on, version in range and (when checked) the target found
    flag_on: bool
    flag_why: str  # which flag (or condition) decided, e.g. "ASCEND_RL_SAM=on"
    version_state: str  # ok | outside | absent
    version: str | None
    version_why: str
    target_found: bool | None = None  # None: not checked (run time finds out at import)
    target_where: str = ""  # file:line when found, else why not
    gate_error: str = ""  # the patch's enabling condition raised

    @property
    def reason(self) -> str:
        """One line: why it applies or not (what ``status()`` and doctor show)."""
        if self.gate_error:
            return self.gate_error
        if not self.flag_on:
            return f"flag off ({self.flag_why})"
        if self.version_state != "ok":
            return self.version_why
        if self.target_found is False:
            return f"target missing: {self.target_where}"
        return self.flag_why

    def verdict(self, p: PatchFacts, sibling_in_range: bool = False) -> tuple[str, bool]:
        """(doctor's verdict text, whether it is a problem the user must fix).

        A problem is only what the user asked for and will not get. A patch written for
        another version of its target is "not for this version"; it is a problem only when
        the user switched its gate on explicitly and ``sibling_in_range`` is False: no
        other patch behind the same gate is meant for the installed versions, so the
        switch would do nothing here."""
        if self.version_state == "absent":
            return f"n/a: {self.version_why}", False
        if self.version_state == "outside":
            if p.fixed_upstream:
                return f"not needed: {self.version_why}", False
            if sibling_in_range:
                return (f"not for this version: {self.version_why} (the feature's patches for this "
                        f"version apply instead)", False)
            return f"not for this version: {self.version_why}", self.flag_on and p.explicitly_enabled()
        if self.target_found is False:
            return f"TARGET MISSING: {self.target_where}", self.flag_on
        if self.gate_error:
            return self.gate_error, True
        return ("will apply", False) if self.flag_on else ("off", False)


def decide(p: PatchFacts, roots: Sequence[str] | None = None, *, check_target: bool = False) -> Decision:
    """Decide ``p`` for the installed packages (``roots`` None) or an unpacked stack.

    Nothing is imported. A flag with a bad value raises :class:`flags.FlagError` (the
    plugin validates every flag first, so that is a bug in the caller); any other error
    of an enabling condition is reported in ``gate_error``."""
    gate_error = ""
    try:
        on, flag_why = p.flag_state()
    except _flags.FlagError:
        raise
    except Exception as exc:
        on, flag_why = False, "condition raised"
        gate_error = f"gate raised {type(exc).__name__}: {exc}"
    vstate, version, vwhy = p.version_state(roots)
    found, where = None, ""
    if check_target and vstate != "absent":
        found, where = _resolve(p, roots)
    apply = on and not gate_error and vstate == "ok" and found is not False
    return Decision(apply, on, flag_why, vstate, version, vwhy, found, where, gate_error)


def _resolve(p: PatchFacts, roots: Sequence[str] | None) -> tuple[bool, str]:
    """Is the target there (by reading source), and does it still take the parameters the
    patch relies on?"""
    from . import static
    r = static.resolve_static(p.target, roots)
    if not r.found and p.kind == "set" and p.create:
        # the attribute is created by the patch: only its owner has to exist
        module, qualname = p.target.split(":")
        owner = qualname.rsplit(".", 1)[0] if "." in qualname else None
        r = (static.resolve_static(f"{module}:{owner}", roots) if owner
             else static.StaticResult(static.module_exists(module, roots), f"module {module} not found",
                                      static.locate_module(module, roots)))
    if not r.found:
        return False, r.why
    if p.params is not None and r.params is not None and not any(x.startswith("**") for x in r.params):
        names = {x.lstrip("*") for x in r.params}
        gone = [x for x in p.params if x.lstrip("*") not in names]
        if gone:
            return False, f"{r.where()}: parameter(s) {', '.join(gone)} gone (has {', '.join(r.params)})"
    return True, r.where()
