"""moe_reshard's flags: values, the recipe's alias, bad values rejected with the variable and what is
accepted, and what ``on`` / ``auto`` do when the reshard cannot run."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_rl_plugins import flags
from ascend_rl_plugins.features import moe_reshard as feature
from tests.support.child import run_scenario


def test_default_is_off_and_every_mode_parses():
    assert feature.MODE.read({}) == "off"
    for mode in ("off", "auto", "on", "AUTO"):
        assert feature.MODE.read({"ASCEND_RL_MOE_RESHARD": mode}) == mode.lower()


@pytest.mark.parametrize("raw,mode", [("1", "on"), ("true", "on"), ("0", "off"), ("false", "off"), ("auto", "auto")])
def test_the_recipes_all_to_all_reshard_switch_is_an_alias(raw, mode):
    assert feature.MODE.read({"ALL_TO_ALL_RESHARD": raw}) == mode
    # the canonical name wins over the alias
    assert feature.MODE.read({"ALL_TO_ALL_RESHARD": raw, "ASCEND_RL_MOE_RESHARD": "off"}) == "off"


# the modes, and the bool spellings every off|auto|on mode takes (1/true/yes = on, 0/false/no/empty = off)
ACCEPTED = ("off", "auto", "on", "1", "true", "yes", "0", "false", "no", "")


@given(st.text(min_size=1, max_size=12).filter(lambda s: s.strip().lower() not in ACCEPTED))
def test_a_bad_mode_names_the_variable_and_the_accepted_values(raw):
    with pytest.raises(flags.FlagError) as err:
        feature.MODE.read({"ASCEND_RL_MOE_RESHARD": raw})
    assert "ASCEND_RL_MOE_RESHARD" in str(err.value) and "'auto'" in str(err.value)


def test_bucket_size_is_a_positive_number_of_mib():
    assert feature.BUCKET_MB.read({}) == 512
    assert feature.BUCKET_MB.read({"ASCEND_RL_MOE_RESHARD_BUCKET_MB": "64"}) == 64
    for bad in ("0", "-3", "lots"):
        with pytest.raises(flags.FlagError, match="ASCEND_RL_MOE_RESHARD_BUCKET_MB"):
            feature.BUCKET_MB.read({"ASCEND_RL_MOE_RESHARD_BUCKET_MB": bad})


def test_post_load_is_on_by_default_and_switchable():
    assert feature.POST_LOAD.read({}) is True
    assert feature.POST_LOAD.read({"ASCEND_RL_MOE_RESHARD_POST_LOAD": "0"}) is False


def test_use_alltoall_overlap_stays_the_checkpoint_reload_alias():
    """The recipe's USE_ALLTOALL_OVERLAP switched its grouped-GEMM checkpoint path; here that is
    dist_ckpt_expert_reload's flag (the converter is an explicit command, no switch needed)."""
    importlib.import_module("ascend_rl_plugins.features.dist_ckpt_expert_reload")  # declares its flag
    owner = [f.name for f in flags.all_flags() if "USE_ALLTOALL_OVERLAP" in f.aliases]
    assert owner == ["ASCEND_RL_DIST_CKPT_EXPERT_RELOAD"]


def fallback(reason: str) -> str:
    """Child-process side: what the hook does when the reshard cannot run, under this process's
    ASCEND_RL_MOE_RESHARD."""
    import logging

    from ascend_rl_plugins.features.moe_reshard import hooks_verl06
    seen: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("ascend_rl_plugins").addHandler(Keep())
    try:
        hooks_verl06.fall_back_to_stock(reason)
    except RuntimeError as exc:
        return f"raised: {exc}"
    return f"logged: {' | '.join(seen)}"


def test_on_turns_a_refused_plan_into_an_error_and_auto_into_one_log_line():
    env = {"ASCEND_RL_AUTOLOAD": "0"}
    on = run_scenario("tests.features.moe_reshard.test_flags", "fallback", "plan: x",
                      env=dict(env, ASCEND_RL_MOE_RESHARD="on"), timeout=120)
    assert on == "raised: ASCEND_RL_MOE_RESHARD=on but the expert reshard cannot run: plan: x"
    auto = run_scenario("tests.features.moe_reshard.test_flags", "fallback", "plan: x",
                        env=dict(env, ALL_TO_ALL_RESHARD="auto"), timeout=120)
    assert auto.startswith("logged: ") and auto.endswith(" | ascend-rl moe_reshard: falling back to stock weight sync: plan: x")
    assert "ALL_TO_ALL_RESHARD is the seed recipe's name for ASCEND_RL_MOE_RESHARD" in auto


def test_the_switch_gates_the_generator_patch_and_post_load_gates_update_weights():
    gen = next(p for p in feature.FEATURE.patches if p.name == "moe_reshard.per_tensor_generator")
    upd = [p for p in feature.FEATURE.patches if p.name.endswith("update_weights")]
    assert gen.enabled_by is feature.reshard_requested
    assert len(upd) == 2 and all(p.enabled_by is feature._update_hook_wanted for p in upd)
