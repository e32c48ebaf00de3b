"""A fresh process where verl's own mechanism loads ascend-rl (verl 0.6.1:
``VERL_USE_EXTERNAL_MODULES``; verl 0.9.1: the ``verl.plugins`` entry point) with
data_rebalance, dataproto_timing_merge and onpolicy_old_logprob switched on: their verl patches
are applied to what verl imports, on verl 0.9 only the one whose range covers it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.support.child import run_scenario

# rollout_engine_options (on by default) wraps validate_config too: both apply, in their orders
ON = {"ASCEND_RL_DATA_REBALANCE": "1", "ASCEND_RL_ONPOLICY_OLD_LOGPROB": "1", "ASCEND_RL_DATAPROTO_TIMING_MERGE": "1"}
VERL_06 = ["data_rebalance.generate_dispatch", "onpolicy_old_logprob.validate_config",
           "onpolicy_old_logprob.trainer_fit", "onpolicy_old_logprob.megatron_update",
           "onpolicy_old_logprob.megatron_policy_loss"]


def test_verl_loads_the_plugin_and_the_patches_apply():
    try:
        verl = version("verl")
    except PackageNotFoundError:
        pytest.skip("verl is not installed in this interpreter")
    if verl.startswith("0.6."):
        env = {**ON, "VERL_USE_EXTERNAL_MODULES": "ascend_rl_plugins", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    else:
        env = {**ON, "VERL_USE_EXTERNAL_MODULES": "", "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    r = run_scenario("tests.features.onpolicy_old_logprob.activation_scenario", "activate", env=env, timeout=600)
    assert r["verl"] == verl
    assert r["states"]["dataproto_timing_merge.concat"][0] == "applied", r
    if verl.startswith("0.6."):
        assert r["activated_by"] == ["import ascend_rl_plugins"], r
        assert all(r["states"][p][0] == "applied" for p in VERL_06), r
        assert r["main_ppo_copy_patched"], r
    else:
        assert "verl.plugins" in r["activated_by"], r
        assert all(r["states"][p][0] == "skipped" and "outside" in r["states"][p][1] for p in VERL_06), r
