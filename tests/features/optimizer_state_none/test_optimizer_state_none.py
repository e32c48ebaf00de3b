"""optimizer_state_none: a distributed-optimizer checkpoint saves and loads back, bit for bit,
when an optimizer state entry is None.

Real (scenario.py, 2 gloo processes): Megatron-Core's DistributedOptimizer of a GroupedMLP MoE
model (EP2, dense part DP2) after a real step, its sharded state dict, dist_checkpointing save
and load, in the format verl uses on the running stack (0.12.1: fully_sharded_model_space, the
recipe's path; 0.16.1: dp_reshardable, verl 0.9.1's default). Double: the inner optimizer stores
its state as MindSpeed's swap AdamW does (``max_exp_avg_sq = None`` without AMSGrad); the
MindSpeed source it mirrors is checked below.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

import pytest

from ascend_rl_plugins.features import optimizer_state_none as feature
from tests.support.child import run_group
from tests.support.stacks import mindspeed_source

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0"}
PATCHES = [p.name for p in feature.FEATURE.patches]


def _require_megatron() -> str:
    try:
        version("torch")
        return version("megatron-core")
    except PackageNotFoundError:
        pytest.skip("torch and megatron-core are not installed in this interpreter (.ci/stack.sh installs them)")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    _require_megatron()
    out = tmp_path_factory.mktemp("optimizer-ckpt")
    return run_group("tests.features.optimizer_state_none.scenario", "round_trip", 2, str(out),
                     env=ENV, timeout=600)


def test_the_none_state_is_real_and_stock_megatron_cannot_checkpoint_it(ranks):
    for r in ranks:
        assert r["stepped"] and r["inner"] == ["SwapAdamWDouble"], r
        assert r["none_states"] == ["max_exp_avg_sq"], r
        assert {"exp_avg", "exp_avg_sq"} <= set(r["tensor_states"]), r
        # the recipe's crash: .dtype (0.12.1's closure) / .shape (0.16.1's dp_reshardable) of None
        assert re.match(r"AttributeError: 'NoneType' object has no attribute '(dtype|shape)'", r["stock_save"]), r


def test_with_the_feature_a_save_load_round_trip_restores_every_state_bit_for_bit(ranks):
    for r in ranks:
        assert r["patch_states"] == {name: "applied" for name in PATCHES}, r
        assert "round_trip_error" not in r, r
        assert r["perturbed"], r  # the load had something to restore
        assert r["differences"] == [], r  # main params, exp_avg, exp_avg_sq, step; None stays None


def test_loading_needs_the_load_side_patch(ranks):
    for r in ranks:
        assert "round_trip_error" not in r, r
        assert r["load_without_set_states"] == "AttributeError: 'NoneType' object has no attribute 'copy_'", r


def test_none_entries_are_dropped_and_the_main_parameter_kept():
    param, moment = object(), object()
    tensors = {"param": param, "exp_avg": moment, "max_exp_avg_sq": None}
    assert feature.without_none_states(tensors) == {"param": param, "exp_avg": moment}
    kept = {"param": None, "exp_avg": moment}
    assert feature.without_none_states(kept) is kept  # a None main parameter is Megatron's to report


def test_the_double_mirrors_mindspeeds_swap_optimizer():
    """What the double (megatron_checkpoint_shims.swap_adamw_double) reproduces, read in MindSpeed's
    source: the swap optimizer keeps ``max_exp_avg_sq = None`` without AMSGrad, its AdamW counts
    steps in the param group, and MindSpeed installs its AdamW as Apex's FusedAdam."""
    root = mindspeed_source()
    swap = open(f"{root}/mindspeed/core/optimizer/swap_optimizer/swap_optimizer.py", encoding="utf-8").read()
    assert re.search(r"state\['max_exp_avg_sq'\]\s*=\s*torch\.zeros_like\(.*\)\s*if amsgrad else None", swap)
    assert re.search(r"if key == 'max_exp_avg_sq' and not amsgrad:\s*\n\s*device_state\[key\] = None", swap)
    assert "group['step'] += 1" in swap
    basic = open(f"{root}/mindspeed/features_manager/megatron_basic/requirements_basic.py", encoding="utf-8").read()
    assert re.search(r"register_patch\('apex\.optimizers\.FusedAdam', AdamW", basic)
    # the swap optimizer subclasses Megatron's DistributedOptimizer without overriding the hooks
    assert "class SwapDistributedOptimizer(MegatronDistributedOptimizer)" in swap
    assert "def _get_main_param_and_optimizer_states" not in swap
    assert "def _set_main_param_and_optimizer_states" not in swap


def test_the_flag_is_validated(flag_env):
    from ascend_rl_plugins import flags
    flag_env(ASCEND_RL_OPTIMIZER_STATE_NONE="maybe")
    with pytest.raises(flags.FlagError, match="ASCEND_RL_OPTIMIZER_STATE_NONE='maybe'.*accepted: one of 1/0"):
        flags.validate_all()
    flag_env(ASCEND_RL_OPTIMIZER_STATE_NONE="0")
    assert feature.ENABLE.value is False
