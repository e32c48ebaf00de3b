"""dist_ckpt_expert_reload: verl's load_mcore_dist_weights restores every parameter of a
GroupedMLP MoE model, the factory-merged expert weights included.

Real (scenario.py, 2 gloo processes): a Megatron-Core GPTModel with legacy GroupedMLP experts,
EP2 and expert-tensor-parallel 2, its checkpoint written by dist_checkpointing.save, and verl's
own load_mcore_dist_weights (0.6.1 on the recipe stack, 0.9.1 on the current one) loading it
over perturbed weights: stock, with the feature (through a from-import copy of the function
taken before activation, as verl's workers hold one), and Megatron-Core's load called directly.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from ascend_rl_plugins.features import dist_ckpt_expert_reload as feature
from tests.support.child import run_group

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0"}
LAYOUTS = {"ep2": {"ep": 2, "etp": 1}, "etp2": {"ep": 1, "etp": 2}}
EXPERT_WEIGHTS = [f"decoder.layers.{i}.mlp.experts.weight{w}" for i in (0, 1) for w in (1, 2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    try:
        version("torch"), version("megatron-core"), version("verl")
    except PackageNotFoundError:
        pytest.skip("torch, megatron-core and verl must be installed in this interpreter (.ci/stack.sh)")
    out = tmp_path_factory.mktemp("dist-ckpt")
    return run_group("tests.features.dist_ckpt_expert_reload.scenario", "reload", 2, str(out), list(LAYOUTS),
                     env=ENV, timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stock_verl_leaves_the_grouped_expert_weights_unloaded(ranks, layout):
    for rank in ranks:
        r = rank[layout]
        assert r["experts"] == "GroupedMLP" and r["sizes"] == LAYOUTS[layout], r
        assert len(r["perturbed"]) > len(EXPERT_WEIGHTS), r  # every parameter was perturbed
        assert r["stale_stock"] == EXPERT_WEIGHTS, r  # loaded in place: everything but the factories'


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_with_the_feature_every_parameter_equals_the_saved_one(ranks, layout):
    for rank in ranks:
        r = rank[layout]
        assert r["patch_states"] == {p.name: "applied" for p in feature.FEATURE.patches}, r
        assert r["copy_rebound"], r  # a from-import copy (verl's workers hold two) reaches the wrapper
        assert r["stale_patched"] == [], r


def test_other_callers_of_dist_checkpointing_load_are_untouched(ranks):
    """Outside load_mcore_dist_weights the Megatron-Core wrapper passes through: callers that
    use the returned state dict (verl's checkpoint managers) see Megatron's own behaviour."""
    for rank in ranks:
        assert rank["ep2"]["stale_direct_load"] == EXPERT_WEIGHTS, rank["ep2"]


def test_a_loaded_tensor_that_does_not_fit_its_parameter_is_a_clear_error():
    torch = pytest.importorskip("torch")
    from ascend_rl_plugins.features.dist_ckpt_expert_reload.copyback import ExpertReloadError, copy_back
    target = torch.zeros(2, 3)
    view_target = torch.zeros(4)
    targets = {("a",): ("decoder.experts.weight1", target), ("b",): ("k", view_target[:2])}
    loaded = {"a": torch.ones(3, 2), "b": view_target[:2]}
    with pytest.raises(ExpertReloadError, match=r"ASCEND_RL_DIST_CKPT_EXPERT_RELOAD=0.*decoder\.experts\.weight1 "
                                                r".*loaded torch\.float32\[3, 2\], parameter torch\.float32\[2, 3\]"):
        copy_back(targets, loaded)
    assert torch.count_nonzero(target) == 0  # nothing copied when one entry is wrong
    loaded["a"] = torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises(ExpertReloadError, match=r"torch\.float64\[2, 3\]"):
        copy_back(targets, loaded)
    loaded["a"] = torch.ones(2, 3)
    assert copy_back(targets, loaded) == ["decoder.experts.weight1"]  # the in-place view is not copied
    assert torch.equal(target, torch.ones(2, 3))


def test_the_recipe_variable_is_an_alias(flag_env):
    from ascend_rl_plugins import flags
    flag_env(USE_ALLTOALL_OVERLAP="0")
    assert feature.ENABLE.value is False
    flag_env(USE_ALLTOALL_OVERLAP="1", ASCEND_RL_DIST_CKPT_EXPERT_RELOAD=None)
    assert feature.ENABLE.value is True
    flag_env(ASCEND_RL_DIST_CKPT_EXPERT_RELOAD="sometimes")
    with pytest.raises(flags.FlagError, match="ASCEND_RL_DIST_CKPT_EXPERT_RELOAD='sometimes'.*accepted: one of 1/0"):
        flags.validate_all()
