"""Typed ``ASCEND_RL_*`` environment flags.

Every feature declares its flags here (through :func:`define`); they are parsed once per
process and validated when the plugin loads, so a typo in a launch script fails in the
first second with the variable's name, the bad value and what is accepted, instead of an
hour later inside a training step. The seed recipe's own variable names are accepted as
aliases, with a one-time notice.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

log = logging.getLogger("ascend_rl_plugins")

PREFIX = "ASCEND_RL_"
OFF = "off"  # the value of an off|auto|on switch that turns its feature off
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class FlagError(ValueError):
    """A flag's environment value is not acceptable."""


@dataclass(frozen=True)
class Flag:
    """One environment flag: canonical name, type, default, aliases and meaning."""

    name: str
    kind: str  # bool | int | float | str | enum | list | path
    default: Any
    doc: str
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    feature: str = ""
    # Converts an alias's raw text into the canonical raw text (e.g. a seed variable that
    # held a path where the canonical flag holds "path | preset").
    alias_map: Callable[[str, str], str] | None = field(default=None, compare=False)
    # A list flag whose items must be names that are declared only once every feature is
    # loaded (ASCEND_RL_DISABLE: patch and feature names): ``item_names`` returns them, and
    # ``item_doc`` says what they are in the "accepted" text. Checked by validate_all with
    # ``misspellings=True`` (activation and doctor, after loading every feature), not by parse,
    # which may run before the names exist.
    item_names: Callable[[], Iterable[str]] | None = field(default=None, compare=False)
    item_doc: str = ""

    # -- parsing -------------------------------------------------------------
    @property
    def is_mode_switch(self) -> bool:
        """An ``off|...|on`` enum: a feature's switch with modes. It also takes the bool
        spellings (1/true/yes for 'on', 0/false/no for 'off'), as every switch does, so that
        ``=1`` means the same under the canonical name as under a recipe alias that was a bool."""
        return self.kind == "enum" and OFF in self.choices and "on" in self.choices

    def accepted(self) -> str:
        if self.kind == "bool":
            return "one of 1/0, true/false, yes/no, on/off"
        if self.kind == "enum":
            return "one of " + ", ".join(repr(c) for c in self.choices) + (
                " (1/true/yes mean 'on', 0/false/no 'off')" if self.is_mode_switch else "")
        if self.kind == "list":
            if self.item_doc:
                return f"a comma-separated list of {self.item_doc}"
            return "a comma-separated list" + (
                f" of {', '.join(repr(c) for c in self.choices)}" if self.choices else ""
            )
        rng = ""
        if self.minimum is not None or self.maximum is not None:
            lo = "-inf" if self.minimum is None else f"{self.minimum:g}"
            hi = "inf" if self.maximum is None else f"{self.maximum:g}"
            rng = f" in [{lo}, {hi}]"
        return {"int": "an integer", "float": "a number", "str": "a string",
                "path": "a file path"}[self.kind] + rng

    def error(self, raw: str, source: str | None = None, why: str = "") -> FlagError:
        """The one message for a bad value: the variable (and the flag it is an alias of), the
        value, why, what is accepted and what the flag does."""
        source = source or self.name
        via = "" if source == self.name else f" (alias of {self.name})"
        return FlagError(
            f"{source}{via}={raw!r} is not valid{': ' + why if why else ''}; "
            f"accepted: {self.accepted()}. {self.doc}"
        )

    def parse(self, raw: str, source: str | None = None) -> Any:
        source = source or self.name
        text = raw.strip()

        def bad(why: str = "") -> FlagError:
            return self.error(raw, source, why)

        if self.kind == "bool":
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise bad()
        if self.kind in ("int", "float"):
            try:
                value: Any = int(text, 0) if self.kind == "int" else float(text)
            except ValueError:
                raise bad() from None
            if self.minimum is not None and value < self.minimum:
                raise bad("below the minimum")
            if self.maximum is not None and value > self.maximum:
                raise bad("above the maximum")
            return value
        if self.kind == "enum":
            low = text.lower()
            if low not in self.choices and self.is_mode_switch:
                low = "on" if low in _TRUE else OFF if low in _FALSE else low
            if low not in self.choices:
                raise bad()
            return low
        if self.kind == "list":
            items = [p.strip() for p in text.split(",") if p.strip()]
            if self.choices:
                wrong = [p for p in items if p not in self.choices]
                if wrong:
                    raise bad(f"unknown item(s) {', '.join(map(repr, wrong))}")
            if self.minimum is not None:  # numeric list (e.g. a batch-size ladder)
                try:
                    nums = [int(p) for p in items]
                except ValueError:
                    raise bad("items must be integers") from None
                if any(n < self.minimum for n in nums):
                    raise bad("an item is below the minimum")
                return tuple(nums)
            return tuple(items)
        return text  # str / path

    # -- reading ---------------------------------------------------------------
    def lookup(self, env: Mapping[str, str]) -> tuple[str | None, str]:
        """The raw text for this flag and where it came from ('default' if unset)."""
        if self.name in env:
            return env[self.name], self.name
        for alias in self.aliases:
            if alias in env:
                raw = env[alias]
                if self.alias_map is not None:
                    raw = self.alias_map(alias, raw)
                return raw, alias
        return None, "default"

    def read(self, env: Mapping[str, str] | None = None) -> Any:
        """Parse from ``env`` (default: ``os.environ``) without caching."""
        raw, source = self.lookup(os.environ if env is None else env)
        return self.default if raw is None else self.parse(raw, source)

    def unknown_items_error(self, env: Mapping[str, str] | None = None) -> FlagError | None:
        """For a flag with ``item_names``: the error for items of its value that name nothing
        declared (with the closest name, when one is alike), or None. Call it once every feature
        is declared."""
        if self.item_names is None:
            return None
        raw, source = self.lookup(os.environ if env is None else env)
        if raw is None:
            return None
        known = list(self.item_names())
        wrong = [item for item in self.parse(raw, source) if item not in known]
        if not wrong:
            return None
        described = []
        for item in wrong:
            close = difflib.get_close_matches(item, known, n=1, cutoff=0.6)
            described.append(f"{item!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return self.error(raw, source, f"unknown item(s) {', '.join(described)}")

    @property
    def value(self) -> Any:
        """The value for this process (parsed once)."""
        return _REGISTRY.value(self)

    @property
    def explicitly_set(self) -> bool:
        return self.lookup(os.environ)[1] != "default"

    @property
    def switched_on(self) -> bool:
        """This flag read as a feature's switch. An enum whose choices include ``off`` (e.g.
        ``off|auto|on``) is on unless its value is ``off``; any other kind is on when truthy."""
        value = self.value
        if self.kind == "enum" and OFF in self.choices:
            return value != OFF
        return bool(value)


class _Registry:
    def __init__(self) -> None:
        self.flags: dict[str, Flag] = {}
        self._values: dict[str, Any] = {}
        self._sources: dict[str, str] = {}
        self._noticed: set[str] = set()

    def add(self, flag: Flag) -> Flag:
        old = self.flags.get(flag.name)
        if old is not None and old != flag:
            raise FlagError(f"flag {flag.name} is defined twice with different meanings")
        for other in self.flags.values():
            shared = set(other.aliases) & set(flag.aliases)
            if other.name != flag.name and shared:
                raise FlagError(f"alias {sorted(shared)[0]} is claimed by {other.name} and {flag.name}")
        self.flags[flag.name] = flag
        return flag

    def value(self, flag: Flag) -> Any:
        if flag.name not in self._values:
            raw, source = flag.lookup(os.environ)
            value = flag.default if raw is None else flag.parse(raw, source)
            if source not in ("default", flag.name) and source not in self._noticed:
                self._noticed.add(source)
                log.warning("ascend-rl: %s is the seed recipe's name for %s; it is honoured, "
                            "but prefer %s", source, flag.name, flag.name)
            self._values[flag.name] = value
            self._sources[flag.name] = source
        return self._values[flag.name]

    def source(self, flag: Flag) -> str:
        self.value(flag)
        return self._sources[flag.name]

    def validate_all(self, misspellings: bool = False) -> None:
        """Parse every flag now; raise one FlagError listing every bad variable (and, with
        ``misspellings``, every name that matches nothing declared: an unknown variable that
        misspells a declared flag, an ASCEND_RL_DISABLE item that names no patch or feature.
        Pass it only once every feature is declared: activation and doctor do)."""
        errors = []
        for flag in self.flags.values():
            try:
                self.value(flag)
            except FlagError as exc:
                errors.append(str(exc))
                continue
            if misspellings:
                unknown = flag.unknown_items_error()
                if unknown is not None:
                    errors.append(str(unknown))
        if misspellings:
            errors += [unknown_message(name) for name in near_misses()]
        if errors:
            raise FlagError("invalid ascend-rl flag(s):\n  " + "\n  ".join(errors))

    def unknown_canonical(self, env: Mapping[str, str] | None = None) -> list[str]:
        """``ASCEND_RL_*`` variables that no flag declares (likely typos)."""
        env = os.environ if env is None else env
        return sorted(k for k in env if k.startswith(PREFIX) and k not in self.flags)

    def closest(self, name: str, cutoff: float) -> str | None:
        """The declared flag whose name is most like ``name`` (compared without the common
        ``ASCEND_RL_`` prefix, which would make every pair look alike), or None."""
        tails = {f[len(PREFIX):]: f for f in self.flags}
        tail = name[len(PREFIX):] if name.startswith(PREFIX) else name
        match = difflib.get_close_matches(tail, list(tails), n=1, cutoff=cutoff)
        return tails[match[0]] if match else None

    def reset_cache(self) -> None:
        """Forget parsed values (tests change the environment between cases)."""
        self._values.clear()
        self._sources.clear()
        self._noticed.clear()


_REGISTRY = _Registry()


def define(name: str, kind: str, default: Any, doc: str, *, aliases: Iterable[str] = (),
           choices: Sequence[str] = (), minimum: float | None = None,
           maximum: float | None = None, feature: str = "",
           alias_map: Callable[[str, str], str] | None = None,
           item_names: Callable[[], Iterable[str]] | None = None, item_doc: str = "") -> Flag:
    """Declare a flag. Names must be ``ASCEND_RL_<FEATURE>[_<OPTION>]``."""
    if not name.startswith(PREFIX) or name != name.upper():
        raise FlagError(f"flag name {name!r} must be upper case and start with {PREFIX}")
    if kind not in ("bool", "int", "float", "str", "enum", "list", "path"):
        raise FlagError(f"flag {name}: unknown kind {kind!r}")
    if kind == "enum" and not choices:
        raise FlagError(f"flag {name}: an enum needs choices")
    return _REGISTRY.add(Flag(name, kind, default, doc, tuple(aliases),
                              tuple(c.lower() for c in choices) if kind == "enum" else tuple(choices),
                              minimum, maximum, feature, alias_map, item_names, item_doc))


def all_flags() -> list[Flag]:
    return sorted(_REGISTRY.flags.values(), key=lambda f: f.name)


def get(name: str) -> Flag:
    return _REGISTRY.flags[name]


def source_of(flag: Flag) -> str:
    return _REGISTRY.source(flag)


def validate_all(misspellings: bool = False) -> None:
    _REGISTRY.validate_all(misspellings)


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    return _REGISTRY.unknown_canonical(env)


# How alike (difflib ratio of the names without ASCEND_RL_) an unknown variable must be to
# a declared flag to count as a misspelling of it: SAMM/SAM is 0.86, HDP_COSTMODEL/
# HDP_COST_MODEL 0.96, while unrelated short names (FOO/HDP) stay far below.
NEAR_MISS = 0.8


def suggestion(name: str) -> str | None:
    """The declared flag an unknown ``ASCEND_RL_*`` name most likely meant (loosely alike)."""
    return _REGISTRY.closest(name, 0.6)


def near_misses(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Unknown ``ASCEND_RL_*`` variables that are misspellings of a declared flag, mapped to
    that flag. The user asked for something and would silently not get it: activation
    refuses them (:func:`validate_all` with ``misspellings=True``)."""
    out = {}
    for name in unknown_variables(env):
        meant = _REGISTRY.closest(name, NEAR_MISS)
        if meant is not None:
            out[name] = meant
    return out


def unknown_message(name: str) -> str:
    """One line about an unknown ``ASCEND_RL_*`` variable, with a suggestion when one fits."""
    meant = suggestion(name)
    hint = f"; did you mean {meant}?" if meant else " (see `ascend-rl env`)"
    return f"{name} is set but no ascend-rl flag has that name{hint}"


def reset_cache() -> None:
    _REGISTRY.reset_cache()


# Framework-wide flags (the framework's own, not a feature's).
STRICT = define("ASCEND_RL_STRICT", "bool", False,
                "Turn a missing target of an enabled patch into an error instead of a warning.",
                feature="framework")
AUTOLOAD = define("ASCEND_RL_AUTOLOAD", "bool", True,
                  "Activate the patches when ascend_rl_plugins is imported (0: only through "
                  "the vLLM/verl entry points or an explicit ascend_rl_plugins.activate()).",
                  feature="framework")


# The feature and patch names ASCEND_RL_DISABLE takes besides 'all'. The patch registry
# (patching.core, which imports this module) hands over its lister when it is created: the
# framework's layers go one way, so this module never imports the registry's.
_registered_names: Callable[[], Iterable[str]] = tuple


def list_registered_names_with(lister: Callable[[], Iterable[str]]) -> None:
    """Set where :func:`_disable_names` reads the declared feature and patch names from."""
    global _registered_names
    _registered_names = lister


def _disable_names() -> list[str]:
    """What ASCEND_RL_DISABLE takes: 'all', every declared feature and every patch name. Read
    from the patch registry when validated."""
    return ["all", *_registered_names()]


DISABLE = define("ASCEND_RL_DISABLE", "list", (),
                 "Comma-separated patch or feature names to leave unapplied even when their "
                 "flag is on ('all' disables every patch).", feature="framework",
                 item_names=_disable_names,
                 item_doc="patch or feature names as `ascend-rl doctor` lists them, or 'all'")
LOG_LEVEL = define("ASCEND_RL_LOG_LEVEL", "enum", "warning",
                   "Log level of the ascend_rl_plugins logger.",
                   choices=("debug", "info", "warning", "error"), feature="framework")
CACHE = define("ASCEND_RL_CACHE", "path", "",
               "Directory for the reference stacks, pip downloads and generated test models "
               "(default ~/.cache/ascend-rl); used by .ci/ scripts, doctor --stack NAME and the "
               "devtools.", feature="framework")
