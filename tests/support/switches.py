"""Every feature switched on at once, as a user who wants them all would set the environment.

Features are tested one at a time elsewhere; what a user meets first when combining them
(two patches on one target without a declared order, a doctor verdict that counts another
version's sibling patch as a problem) only shows with all of them on together.
"""

from __future__ import annotations

from ascend_rl_plugins import flags


# Switches that are not a bool or an off|auto|on mode: the value a user would set.
NON_BOOLEAN_SWITCHES = {
    "ASCEND_RL_FLASHRL": "bf16",  # a config file or a preset; empty = off
    "ASCEND_RL_KV_ADMISSION_RESERVE": "1024",  # tokens of room kept; 0 = off
}


def on_value(flag: flags.Flag) -> str | None:
    """The text that switches ``flag`` on explicitly, or None when it is not a switch
    (a path, a number: nothing to switch)."""
    if flag.name in NON_BOOLEAN_SWITCHES:
        return NON_BOOLEAN_SWITCHES[flag.name]
    if flag.kind == "bool":
        return "1"
    if flag.kind == "enum" and flags.OFF in flag.choices:
        return "on" if "on" in flag.choices else next(c for c in flag.choices if c != flags.OFF)
    return None


def every_switch_on() -> dict[str, str]:
    """Environment that switches on explicitly every feature's flag and every other flag a
    patch is gated by (``enabled_by``), whatever their defaults."""
    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.patching.core import REGISTRY
    plugin.load_features()
    gates = [f.flag for f in REGISTRY.features.values() if f.flag is not None]
    gates += [p.enabled_by for p in REGISTRY.patches.values() if isinstance(p.enabled_by, flags.Flag)]
    env = {}
    for gate in gates:
        value = on_value(gate)
        if value is not None:
            env[gate.name] = value
    return env
