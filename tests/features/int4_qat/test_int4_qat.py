"""int4_qat: straight-through INT4 fake quantization in real Megatron-Core layers.

Real (scenario.py, 2 gloo processes, bf16 GPTModel from the CPU harness): TP2 dense linears
(ColumnParallelLinear / RowParallelLinear), EP2 SequentialMLP experts, EP2 GroupedMLP experts
(scope all; GroupedMLP again with scope experts). With QAT the logits, loss and every gradient
equal, bit for bit, those of the same model whose weights were replaced by
``quant.int4.fake_quantize`` of them (so the forward uses the rollout's quantizer in the
rollout's [out, in] grouping, and the gradient reaches the master weight unchanged); exported
weights quantize to codes/scales that dequantize to the trainer's forward weights bit for bit.
"""

from __future__ import annotations

import pytest

from ascend_rl_plugins.features import int4_qat as feature
from tests.support.child import run_group
from tests.support.stacks import mindspeed_source, require_installed

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0", "NUMBA_NUM_THREADS": "1"}
GROUP = 32   # divides every input dimension per partition of the harness model (hidden 64, TP2 shards of 32)


@pytest.fixture(scope="module")
def ranks():
    require_installed("torch", "numba", "megatron-core")
    return run_group("tests.features.int4_qat.scenario", "all_layouts", 2, GROUP, env=ENV, timeout=900)


def _cases(ranks):
    for rank in ranks:
        yield from rank["cases"]


def test_every_patch_applied_and_every_layout_ran(ranks):
    seen = set()
    for r in _cases(ranks):
        assert r["patch_states"] == {p.name: "applied" for p in feature.FEATURE.patches if p.dist == "megatron-core"}, r
        seen.add((r["layout"], r["scope"], r["preset"]))
    assert seen == {("tp2_dense", "all", "ct"), ("ep2_sequential", "all", "ct"), ("ep2_grouped", "all", "ct"),
                    ("ep2_grouped", "experts", "ct"), ("ep2_sequential", "experts", "slime")}


def test_what_is_quantized_follows_the_scope(ranks):
    for r in _cases(ranks):
        names = r["quantized_names"]
        assert names, r
        assert not any("embedding" in n or "output_layer" in n or "router" in n or "norm" in n for n in names), names
        if r["scope"] == "experts":
            assert all(".mlp.experts." in n for n in names), names
        elif r["layout"] != "tp2_dense":
            assert any("linear_qkv" in n for n in names) and any(".mlp.experts." in n for n in names), names


def test_qat_forward_equals_the_fake_quantized_model_bit_for_bit(ranks):
    for r in _cases(ranks):
        assert r["differs_from_plain"], r          # the fake quantization is in the forward
        assert r["logits_equal"] and r["loss_equal"], r


def test_each_forward_patch_is_needed_for_its_layers(ranks):
    for r in _cases(ranks):
        needed = {name for name, yes in r["needed"].items() if yes}
        if r["layout"] == "ep2_grouped":
            want = {"int4_qat.grouped_mlp_forward"}
            if r["scope"] == "all":
                want |= {"int4_qat.column_parallel_forward", "int4_qat.row_parallel_forward"}
        else:   # dense linears and SequentialMLP experts are Column/RowParallelLinear
            want = {"int4_qat.column_parallel_forward", "int4_qat.row_parallel_forward"}
        assert needed == want, r["needed"]


def test_gradients_pass_straight_through_to_the_master_weights(ranks):
    for r in _cases(ranks):
        assert r["grad_names"] > 0 and r["master_grads_are_leaf_grads"], r
        assert r["grad_mismatch"] == [], r
        assert r["grads_differ_from_plain"], r
        assert r["masters_changed"] == [], r          # the forward never writes the master weights


def test_exported_weights_quantize_to_the_trainers_forward_weights(ranks):
    for r in _cases(ranks):
        assert r["export_mismatch"] == [], r
        assert r["shard_mismatch"] == [], r


def test_a_group_size_that_splits_a_tensor_parallel_shard_is_refused_at_config_time(ranks):
    for r in (rank["bad_group"] for rank in ranks):
        assert r["error"] and r["error"].startswith("Int4QatError: ASCEND_RL_INT4_QAT_GROUP_SIZE=64"), r
        assert "num_attention_heads * kv_channels / tensor_model_parallel_size" in r["error"], r
        assert "= 64 / 2" in r["error"], r


def test_fused_weight_gradient_accumulation_reaches_the_master_main_grad(ranks):
    """The NPU/GPU path (gradient_accumulation_fusion; the fused CUDA kernel replaced by a CPU
    double of its contract, scenario.FusedWgradDouble): Megatron's own backward writes the weight
    gradient into main_grad of the tensor it multiplied by -- the straight-through tensor, which
    carries the master's buffer -- and the grad_added_to_main_grad mark reaches the master."""
    for r in (rank["fused_wgrad"] for rank in ranks):
        assert len(r["linears"]) == 9, r          # 2 layers x (qkv, proj, fc1, fc2) + output layer
        assert r["nonzero"] == r["linears"], r
        assert r["main_grad_mismatch"] == [], r
        assert r["qat_unmarked"] == [] and r["ref_unmarked"] == [], r


def test_flags_and_their_seed_aliases(flag_env):
    from ascend_rl_plugins import flags
    flag_env(OPEN_TRAINING_INT4_FAKE_QAT_FLAG="1", OPEN_TRAINING_INT4_GROUP_SIZE="32")
    assert feature.ENABLE.value is True and feature.group_size() == 32
    assert feature.preset() == "slime"             # slime's variable: slime's formula unless told
    flag_env(ASCEND_RL_INT4_QAT="1", ASCEND_RL_INT4_QAT_GROUP_SIZE="64")
    assert feature.preset() == "ct" and feature.group_size() == 64
    flag_env(OPEN_TRAINING_INT4_FAKE_QAT_FLAG="1", ASCEND_RL_INT4_QAT_PRESET="ct")
    assert feature.preset() == "ct"
    flag_env(ASCEND_RL_INT4_QAT_GROUP_SIZE="48")
    with pytest.raises(flags.FlagError,
                       match=r"ASCEND_RL_INT4_QAT_GROUP_SIZE='48'.*accepted: one of '32', '64', '128'"):
        flags.validate_all()
    flag_env(ASCEND_RL_INT4_QAT_GROUP_SIZE=None, OPEN_TRAINING_INT4_GROUP_SIZE="100")
    with pytest.raises(flags.FlagError,
                       match=r"OPEN_TRAINING_INT4_GROUP_SIZE \(alias of ASCEND_RL_INT4_QAT_GROUP_SIZE\)"):
        flags.validate_all()
    flag_env(ASCEND_RL_INT4_QAT_SCOPE="dense")
    with pytest.raises(flags.FlagError, match=r"ASCEND_RL_INT4_QAT_SCOPE='dense'.*'experts', 'all'"):
        flags.validate_all()


def test_mindspeeds_grouped_gemm_experts_are_covered_by_the_same_wrapper():
    """Static (MindSpeed cannot be installed here): under --moe-grouped-gemm MindSpeed replaces
    GroupedMLP by MindSpeedGmmExperts(GmmExpertsImpl, GroupedMLP), whose forward is
    GmmExpertsImpl's; it reads the weights as GroupedMLP does -- attributes weight1 / weight2 in
    GroupedMLP's memory layout -- so int4_qat.mindspeed_gmm_experts_forward swaps them the same way."""
    import re
    root = mindspeed_source()
    gmm = open(f"{root}/mindspeed/features_manager/moe/gmm.py", encoding="utf-8").read()
    assert re.search(r"register_patch\(\s*'megatron\.core\.transformer\.moe\.experts\.GroupedMLP',\s*"
                     r"MindSpeedGmmExperts\)", gmm)
    adaptor = open(f"{root}/mindspeed/core/transformer/moe/moe_feature/adaptor.py", encoding="utf-8").read()
    assert "class MindSpeedGmmExperts(GmmExpertsImpl, MegatronGroupedMLP)" in adaptor
    experts = open(f"{root}/mindspeed/core/transformer/moe/moe_feature/gmm/experts.py", encoding="utf-8").read()
    assert "def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs=None)" in experts
    assert "w1 = self.weight1.view(self.num_local_experts, self.config.hidden_size, -1)" in experts
    assert "w2 = self.weight2.view(self.num_local_experts, -1, self.config.hidden_size)" in experts
    from tests.doubles import mindspeed_double_check as ms
    assert ms.signature(root, "mindspeed.core.transformer.moe.moe_feature.gmm.experts", "GmmExpertsImpl.forward") == [
        "self", "permuted_local_hidden_states", "tokens_per_expert", "permuted_probs=None"]
    patch = next(p for p in feature.FEATURE.patches if p.name == "int4_qat.mindspeed_gmm_experts_forward")
    assert patch.target == "mindspeed.core.transformer.moe.moe_feature.gmm.experts:GmmExpertsImpl.forward"


def test_config_problems_name_every_dimension_that_splits_a_group(flag_env):
    from types import SimpleNamespace
    flag_env(ASCEND_RL_INT4_QAT="1")
    cfg = SimpleNamespace(tensor_model_parallel_size=2, expert_tensor_parallel_size=4, num_moe_experts=8,
                          moe_ffn_hidden_size=768, ffn_hidden_size=4096, hidden_size=2048, num_attention_heads=32,
                          kv_channels=128, moe_shared_expert_intermediate_size=192)
    assert feature.config_problems(cfg, 128, "experts") == [
        "moe_ffn_hidden_size / expert_tensor_parallel_size (expert fc2 input) = 768 / 4"]   # 192 per shard
    assert feature.config_problems(cfg, 64, "experts") == []
    problems = feature.config_problems(cfg, 128, "all")
    assert "moe_shared_expert_intermediate_size / tensor_model_parallel_size (shared expert fc2 input) = 192 / 2" \
        in problems and len(problems) == 2, problems
    assert feature.config_problems(SimpleNamespace(**{**vars(cfg), "num_moe_experts": None}), 128, "experts") == []


def test_transformer_engine_linears_in_scope_are_found(flag_env):
    """The scan behind the refusal (TransformerEngine cannot be installed here: classes named and
    placed like Megatron's TE wrappers stand in for them)."""
    torch = pytest.importorskip("torch")

    def te(name):
        return type(name, (torch.nn.Module,), {"__module__": "megatron.core.extensions.transformer_engine"})
    model = torch.nn.Module()
    model.attn = te("TELayerNormColumnParallelLinear")()
    model.experts = torch.nn.Module()
    model.experts.linear_fc1 = te("TEGroupedLinear")()
    model.experts.linear_fc1.is_expert = True
    model.norm = te("TENorm")()
    model.output_layer = te("TEColumnParallelLinear")()
    setattr(model.output_layer, feature.EXCLUDE_ATTR, True)
    flag_env(ASCEND_RL_INT4_QAT_SCOPE="experts")
    assert feature.te_layers_in_scope(model) == ["experts.linear_fc1 (TEGroupedLinear)"]
    flag_env(ASCEND_RL_INT4_QAT_SCOPE="all")
    assert feature.te_layers_in_scope(model) == ["attn (TELayerNormColumnParallelLinear)",
                                                 "experts.linear_fc1 (TEGroupedLinear)"]
