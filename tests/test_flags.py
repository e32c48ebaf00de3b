"""Flags: typed parsing, clear errors naming the variable, seed-name aliases, validation at load."""

import logging

import pytest
from hypothesis import given, strategies as st

from ascend_rl_plugins import flags

pytestmark = pytest.mark.forked


@pytest.fixture(autouse=True)
def fresh_cache():
    flags.reset_cache()
    yield
    flags.reset_cache()


def test_bool_int_float_enum_list_parse():
    assert flags.define("ASCEND_RL_T_BOOL", "bool", False, "b").read({"ASCEND_RL_T_BOOL": "Yes"}) is True
    assert flags.define("ASCEND_RL_T_INT", "int", 1, "i", minimum=0).read({"ASCEND_RL_T_INT": "0x10"}) == 16
    assert flags.define("ASCEND_RL_T_FLOAT", "float", 1.0, "f").read({"ASCEND_RL_T_FLOAT": "2.5"}) == 2.5
    e = flags.define("ASCEND_RL_T_ENUM", "enum", "a", "e", choices=("a", "b"))
    assert e.read({"ASCEND_RL_T_ENUM": "B"}) == "b"
    ladder = flags.define("ASCEND_RL_T_LADDER", "list", (), "l", minimum=1)
    assert ladder.read({"ASCEND_RL_T_LADDER": "8, 16,32"}) == (8, 16, 32)
    assert ladder.read({}) == ()


@pytest.mark.parametrize("kind,raw,extra,needle", [
    ("bool", "maybe", {}, "one of 1/0, true/false"),
    ("int", "3.5", {}, "an integer"),
    ("int", "-1", {"minimum": 0}, "below the minimum"),
    ("float", "fast", {}, "a number"),
    ("enum", "c", {"choices": ("a", "b")}, "one of 'a', 'b'"),
    ("list", "x,zz", {"choices": ("x", "y")}, "unknown item(s) 'zz'"),
])
def test_errors_name_the_variable_the_value_and_what_is_accepted(kind, raw, extra, needle):
    f = flags.define("ASCEND_RL_T_BAD", kind, None, "What it does.", **extra)
    with pytest.raises(flags.FlagError) as err:
        f.read({"ASCEND_RL_T_BAD": raw})
    msg = str(err.value)
    assert "ASCEND_RL_T_BAD" in msg and repr(raw) in msg and needle in msg and "What it does." in msg


def test_seed_alias_is_honoured_with_one_notice_and_canonical_wins(monkeypatch, caplog):
    f = flags.define("ASCEND_RL_T_THRE", "int", 32, "threshold", aliases=("SEED_THRE",))
    monkeypatch.setenv("SEED_THRE", "8")
    with caplog.at_level(logging.WARNING, logger="ascend_rl_plugins"):
        assert f.value == 8
        assert f.value == 8
    assert caplog.text.count("SEED_THRE is the seed recipe's name for ASCEND_RL_T_THRE") == 1
    assert flags.source_of(f) == "SEED_THRE"
    monkeypatch.setenv("ASCEND_RL_T_THRE", "4")
    flags.reset_cache()
    assert f.value == 4


def test_alias_error_says_which_variable_was_wrong(monkeypatch):
    f = flags.define("ASCEND_RL_T_ALIASED", "bool", False, "x", aliases=("OLD_NAME",))
    with pytest.raises(flags.FlagError, match=r"OLD_NAME \(alias of ASCEND_RL_T_ALIASED\)='nah'"):
        f.read({"OLD_NAME": "nah"})


def test_validate_all_collects_every_bad_flag(monkeypatch):
    flags.define("ASCEND_RL_T_A", "int", 0, "a")
    flags.define("ASCEND_RL_T_B", "bool", False, "b")
    monkeypatch.setenv("ASCEND_RL_T_A", "x")
    monkeypatch.setenv("ASCEND_RL_T_B", "y")
    with pytest.raises(flags.FlagError) as err:
        flags.validate_all()
    assert "ASCEND_RL_T_A" in str(err.value) and "ASCEND_RL_T_B" in str(err.value)


def test_plugin_load_fails_fast_on_a_bad_flag(monkeypatch):
    from ascend_rl_plugins import plugin
    monkeypatch.setenv("ASCEND_RL_STRICT", "sometimes")
    with pytest.raises(flags.FlagError, match="ASCEND_RL_STRICT='sometimes'"):
        plugin.activate("test")
    assert plugin.activated_by() == []  # a failed activation can be retried after fixing it


def test_unknown_ascend_rl_variables_are_reported():
    assert flags.unknown_variables({"ASCEND_RL_NO_SUCH": "1", "ASCEND_RL_STRICT": "1", "PATH": "/"}) == \
        ["ASCEND_RL_NO_SUCH"]


def test_names_must_be_canonical():
    with pytest.raises(flags.FlagError, match="must be upper case and start with ASCEND_RL_"):
        flags.define("MY_FLAG", "bool", False, "x")
    flags.define("ASCEND_RL_T_ONE", "bool", False, "x", aliases=("SHARED",))
    with pytest.raises(flags.FlagError, match="alias SHARED is claimed by"):
        flags.define("ASCEND_RL_T_TWO", "bool", False, "y", aliases=("SHARED",))


@given(st.integers(min_value=-10**9, max_value=10**9))
def test_int_round_trip(n):
    f = flags.Flag("ASCEND_RL_T_PROP", "int", 0, "p")
    assert f.parse(str(n)) == n


def test_an_off_auto_on_enum_switches_its_feature_off_only_at_off(monkeypatch):
    """A feature whose switch is a mode (``off|auto|on``) is off at ``off`` and on otherwise;
    an enum without an ``off`` choice and a bool keep their plain truth value."""
    from ascend_rl_plugins.patching import Feature, Verified
    mode = flags.define("ASCEND_RL_T_MODE", "enum", "off", "m", choices=("off", "auto", "on"))
    feature = Feature("t_mode_switch", "a mode-switched feature", flag=mode, verified=Verified(cpu_runtime="t"))
    assert not mode.switched_on and not feature.switched_on()
    for value in ("auto", "on"):
        monkeypatch.setenv("ASCEND_RL_T_MODE", value)
        flags.reset_cache()
        assert mode.switched_on and feature.switched_on()
    monkeypatch.setenv("ASCEND_RL_T_MODE", "off")
    flags.reset_cache()
    assert not feature.switched_on()
    plain = flags.define("ASCEND_RL_T_POLICY", "enum", "first", "p", choices=("first", "all"))
    assert plain.switched_on
    assert not flags.define("ASCEND_RL_T_SWITCH", "bool", False, "s").switched_on


def test_a_disable_item_that_names_no_patch_or_feature_is_refused_at_plugin_load(monkeypatch):
    """ASCEND_RL_DISABLE=gc-off names nothing: ignoring it would leave gc_off's patches applied
    while the user believes them off. Activation refuses it, with the closest name and what is
    accepted; real names (a feature, a patch, 'all') pass."""
    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.patching.core import REGISTRY
    monkeypatch.setenv("ASCEND_RL_DISABLE", "gc_off,gc-off")
    with pytest.raises(flags.FlagError) as err:
        plugin.activate("test")
    msg = str(err.value)
    assert "ASCEND_RL_DISABLE='gc_off,gc-off'" in msg and "'gc-off' (did you mean 'gc_off'?)" in msg, msg
    assert "accepted: a comma-separated list of patch or feature names" in msg, msg
    assert plugin.activated_by() == []
    patch = next(name for name in REGISTRY.patches if name.startswith("gc_off."))
    monkeypatch.setenv("ASCEND_RL_DISABLE", f"gc_off,{patch},all")
    flags.reset_cache()
    flags.validate_all(misspellings=True)


@pytest.mark.parametrize("raw", ["1", "0", "true", "false", "yes", "no", "on", "off", "auto", "Auto"])
def test_an_off_auto_on_mode_takes_the_same_values_under_its_name_and_its_alias(raw):
    """ASCEND_RL_MOE_RESHARD=1 was refused while its recipe alias ALL_TO_ALL_RESHARD=1 meant 'on':
    an off|...|on mode takes the bool spellings under either name, with the same meaning."""
    from ascend_rl_plugins.features import moe_reshard
    canonical = moe_reshard.MODE.read({"ASCEND_RL_MOE_RESHARD": raw})
    assert canonical == moe_reshard.MODE.read({"ALL_TO_ALL_RESHARD": raw})
    assert canonical == {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(
        raw, raw.lower())
    assert "1/true/yes mean 'on'" in moe_reshard.MODE.accepted()
    for name in ("ASCEND_RL_MOE_RESHARD", "ALL_TO_ALL_RESHARD"):
        with pytest.raises(flags.FlagError, match="accepted: one of 'off', 'auto', 'on'"):
            moe_reshard.MODE.read({name: "sometimes"})
