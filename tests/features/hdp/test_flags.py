"""HDP flags: the seed's USE_HDP, the group policy, the cost model path, the plan dump, and the
one-line fallback to fixed CP for configurations HDP does not support."""

from __future__ import annotations

import json
import types

import pytest

from ascend_rl_plugins import flags
from ascend_rl_plugins.features import hdp as feature
from ascend_rl_plugins.features.hdp.layout import HdpLayout


def test_the_seed_variable_switches_hdp_on(flag_env):
    flag_env(USE_HDP="1")
    assert feature.ENABLE.value is True and feature.enabled()
    flag_env(USE_HDP=None, ASCEND_RL_HDP="0")
    assert feature.ENABLE.value is False and not feature.enabled()


def test_bad_values_are_refused_by_name(flag_env):
    flag_env(ASCEND_RL_HDP_GROUP_POLICY="greedy")
    with pytest.raises(flags.FlagError, match=r"ASCEND_RL_HDP_GROUP_POLICY='greedy'.*'contiguous', 'pow2'"):
        flags.validate_all()
    flag_env(ASCEND_RL_HDP_GROUP_POLICY="pow2", USE_HDP="maybe")
    with pytest.raises(flags.FlagError, match=r"USE_HDP \(alias of ASCEND_RL_HDP\)"):
        flags.validate_all()


def test_a_missing_or_broken_cost_model_is_refused_by_name(flag_env, tmp_path):
    flag_env(ASCEND_RL_HDP_COST_MODEL=str(tmp_path / "missing.json"))
    with pytest.raises(flags.FlagError, match=r"ASCEND_RL_HDP_COST_MODEL=.*missing.json.*no such file"):
        feature.check_cost_model_flag()
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    flag_env(ASCEND_RL_HDP_COST_MODEL=str(broken))
    with pytest.raises(flags.FlagError, match=r"ASCEND_RL_HDP_COST_MODEL=.*not a cost model"):
        feature.check_cost_model_flag()
    flag_env(ASCEND_RL_HDP_COST_MODEL=None)
    assert feature.check_cost_model_flag() == ""


def test_the_plan_dump_writes_one_json_line_per_micro_batch(flag_env, tmp_path):
    flag_env(ASCEND_RL_HDP_PLAN_DUMP=str(tmp_path / "plans"))
    layout = HdpLayout((30, 7, 9), ((0, 1, 2), (3,)), (0, 1, 1), cp_rank=3)
    feature._dump(layout)
    feature._dump(layout)
    lines = (tmp_path / "plans.rank0").read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0]) == {"cp_rank": 3, "lengths": [30, 7, 9], "groups": [[0, 1, 2], [3]],
                                    "group_of": [0, 1, 1], "group": [3], "position": 0}


@pytest.mark.parametrize("config, reason", [
    (dict(mtp_num_layers=1), "multi-token prediction"),
    (dict(num_moe_experts=8, moe_router_load_balancing_type="seq_aux_loss"), "sequence-level MoE auxiliary loss"),
    (dict(num_moe_experts=8, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"]), "sequence-level"),
])
def test_unsupported_configurations_fall_back_to_cp_with_one_line(flag_env, config, reason, caplog, monkeypatch):
    flag_env(ASCEND_RL_HDP="1")
    monkeypatch.setattr(feature, "_fallback", {})
    from ascend_rl_plugins.patching import fallback
    monkeypatch.setattr(fallback, "_said", set())  # each case is a fresh process's first fallback
    instance = types.SimpleNamespace(config=types.SimpleNamespace(**config))
    with caplog.at_level("WARNING", logger="ascend_rl_plugins"):
        feature._check_model(None, instance, (), {})
        feature._check_model(None, instance, (), {})
    assert not feature.enabled()
    lines = [r.getMessage() for r in caplog.records if "hdp" in r.getMessage()]
    assert len(lines) == 1 and "falling back to fixed context parallelism" in lines[0] and reason in lines[0], lines


def test_supported_configurations_keep_hdp(flag_env, monkeypatch):
    flag_env(ASCEND_RL_HDP="1")
    monkeypatch.setattr(feature, "_fallback", {})
    feature._check_model(None, types.SimpleNamespace(config=types.SimpleNamespace(
        num_moe_experts=8, moe_router_load_balancing_type="aux_loss", mtp_num_layers=None)), (), {})
    assert feature.enabled()
