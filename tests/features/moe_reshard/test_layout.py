"""moe_reshard layout algebra against the real upstream code it models.

* training coordinates vs Megatron-Core's own ``RankGenerator`` (the class parallel_state uses;
  pure, no process group needed) for random tp/pp/ep/etp/cp layouts, dense and expert grids;
* rollout placement vs vLLM's ``determine_expert_map`` (linear, round_robin, uneven counts);
* ``rollout_view`` vs vLLM's ``FusedMoE._load_w13`` / ``_load_w2`` (the real narrowing code,
  called on a real parameter slice);
* Megatron <-> HF expert mapping round trips for SequentialMLP, TEGroupedMLP names and legacy
  GroupedMLP storage, ETP 1 and 2, and GroupedMLP views share the parameter's storage.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ascend_rl_plugins.features.moe_reshard.layout import PROJS, LayoutError, MoEShape, RolloutLayout, \
    TrainingLayout, hf_expert_name, hf_to_megatron, megatron_names, megatron_to_hf, parse_hf_expert_name, \
    rollout_view


def test_layout_and_planner_do_not_import_torch():
    from tests.support.child import run_scenario
    # a fresh interpreter: the module list of this pytest process is polluted by other tests
    assert run_scenario("tests.features.moe_reshard.planner_scenario",
                        "torch_after_importing_layout_and_planner") is False


def _rank_generator():
    pytest.importorskip("torch")
    ps = pytest.importorskip("megatron.core.parallel_state")
    return ps.RankGenerator


@st.composite
def _training(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    world = tp * pp * cp * dp
    per_stage = world // pp
    etp = draw(st.sampled_from([d for d in (1, 2, 4) if per_stage % d == 0]))
    ep = draw(st.sampled_from([d for d in (1, 2, 3, 4, 8) if (per_stage // etp) % d == 0]))
    return TrainingLayout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp).with_world(world)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_training())
def test_coordinates_match_megatron_rank_generator(t):
    RankGenerator = _rank_generator()
    world = t.world_size()
    order = t.order
    dense = RankGenerator(tp=t.tp, ep=1, dp=t.dp, pp=t.pp, cp=t.cp, order=order)
    expert = RankGenerator(tp=t.etp, ep=t.ep, dp=world // (t.etp * t.ep * t.pp), pp=t.pp, cp=1, order=order)
    for gen, axis, key in [(dense, "tp", "tp"), (dense, "pp", "pp"), (dense, "dp", "dp"), (dense, "cp", "cp"),
                           (expert, "tp", "etp"), (expert, "ep", "ep"), (expert, "dp", "edp")]:
        for group in gen.get_ranks(axis):
            for position, rank in enumerate(group):
                assert t.coords(rank)[key] == position, (t, axis, group, rank)


def _determine_expert_map():
    pytest.importorskip("vllm")
    try:
        from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map   # vLLM 0.23
    except ImportError:
        from vllm.model_executor.layers.fused_moe.layer import determine_expert_map                # vLLM 0.13
    return determine_expert_map


@pytest.mark.parametrize("experts,tp,dp", [(8, 1, 4), (8, 2, 2), (10, 1, 4), (128, 4, 6), (6, 2, 2)])
def test_rollout_placements_match_vllm_determine_expert_map(experts, tp, dp):
    determine = _determine_expert_map()
    ep = tp * dp
    for strategy, layout in (("linear", RolloutLayout.linear(tp, dp, experts)),
                             ("round_robin", RolloutLayout.round_robin(tp, dp, experts))):
        for rank in range(ep):
            _, expert_map, *_ = determine(ep_size=ep, ep_rank=rank, global_num_experts=experts,
                                          expert_placement_strategy=strategy)
            by_slot = sorted((int(local), g) for g, local in enumerate(expert_map.tolist()) if local >= 0)
            assert layout.hosted(MoEShape(1, experts, 8, 8), rank) == tuple(g for _, g in by_slot), (strategy, rank)
    # the default (expert_maps=None) is vLLM's linear placement too
    implicit = RolloutLayout(tp, dp, expert_parallel=True)
    shape = MoEShape(1, experts, 8, 8)
    assert [implicit.hosted(shape, r) for r in range(ep)] == list(RolloutLayout.linear(tp, dp, experts).expert_maps)


@pytest.mark.parametrize("tp,dp", [(2, 1), (2, 2), (4, 1), (1, 4)])
def test_rollout_view_matches_vllm_fused_moe_loader(tp, dp):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    hidden, inter = 8, 16
    flat = tp * dp
    rollout = RolloutLayout(tp, dp)
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    down = torch.randn(hidden, inter, generator=g)
    for rank in range(flat):
        # what FusedMoEParallelConfig.make gives without EP: the flattened tp*dp rank and size
        fake = _loader_self(FusedMoE, flat)
        w13 = torch.zeros(2 * inter // flat, hidden)
        w2 = torch.zeros(hidden, inter // flat)
        FusedMoE._load_w13(fake, w13, 0, "w1", gate, rank)
        FusedMoE._load_w13(fake, w13, 0, "w3", up, rank)
        FusedMoE._load_w2(fake, w2, 1, down, rank)
        n = inter // flat
        assert torch.equal(w13[:n], rollout_view(gate, "gate_proj", rollout, rank))
        assert torch.equal(w13[n:], rollout_view(up, "up_proj", rollout, rank))
        assert torch.equal(w2, rollout_view(down, "down_proj", rollout, rank))
    # under EP the loader keeps whole experts
    assert rollout_view(gate, "gate_proj", RolloutLayout(tp, dp, True), 0) is gate


def _loader_self(fused_moe, flat_tp: int):
    """The state FusedMoE's weight-loading helpers read (no engine needed), with FusedMoE's own
    helper methods bound to it (vLLM 0.23 narrows through ``_get_hidden_dim`` and
    ``_narrow_expert_data_for_padding``)."""
    import functools
    import inspect
    fake = types.SimpleNamespace(moe_config=types.SimpleNamespace(
        is_act_and_mul=True, moe_parallel_config=types.SimpleNamespace(tp_size=flat_tp)))
    for name in ("_get_hidden_dim", "_narrow_expert_data_for_padding"):
        raw = inspect.getattr_static(fused_moe, name, None)
        if raw is None:
            continue
        fn = getattr(fused_moe, name)
        setattr(fake, name, fn if isinstance(raw, staticmethod) else functools.partial(fn, fake))
    return fake


def _hf(torch, shape: MoEShape, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in shape.expert_layers:
        for e in range(shape.num_experts):
            for p in PROJS:
                size = (shape.hidden, shape.ffn_hidden) if p == "down_proj" else (shape.ffn_hidden, shape.hidden)
                out[hf_expert_name(layer, e, p)] = torch.randn(size, generator=g)
    return out


@pytest.mark.parametrize("impl", ["sequential", "te_grouped", "grouped"])
@pytest.mark.parametrize("tp,ep,etp,pp", [(1, 1, 1, 1), (2, 2, 1, 1), (2, 2, 2, 2), (1, 4, 2, 1)])
def test_megatron_hf_mapping_round_trips(impl, tp, ep, etp, pp):
    torch = pytest.importorskip("torch")
    shape = MoEShape(num_layers=4, num_experts=8, hidden=6, ffn_hidden=8, moe_layers=(0, 1, 3))
    world = max(tp, etp * ep) * pp
    training = TrainingLayout(tp=tp, ep=ep, etp=etp, pp=pp, expert_impl=impl).with_world(world)
    hf = _hf(torch, shape)
    covered = {}
    for rank in range(world):
        local = hf_to_megatron(hf, shape, training, rank)
        stage = training.coords(rank)["pp"]
        layers = [l for l in shape.expert_layers if training.stage_of_layer(l, shape.num_layers) == stage]
        assert sorted(local) == sorted(n for l in layers for n in megatron_names(shape, training, l))
        for name, tensor in local.items():
            for hf_name, sl, view in megatron_to_hf(name, tensor, shape, training, rank):
                dim = 1 if sl.proj == "down_proj" else 0
                assert torch.equal(view, hf[hf_name].narrow(dim, sl.lo, sl.rows)), (rank, name, hf_name)
                if impl == "grouped":
                    assert view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
                covered.setdefault(hf_name, set()).update(range(sl.lo, sl.hi))
    # every row of every HF expert tensor is held by some rank
    assert set(covered) == set(hf) and all(rows == set(range(shape.ffn_hidden)) for rows in covered.values())


def test_grouped_storage_is_megatrons_memory_layout():
    """GroupedMLP weight1 is [H, E_loc*2I] whose memory is [E_loc, H, 2I] with [gate | up]
    columns per expert; weight2 [E_loc*I, H] is [E_loc, I, H] (Megatron-Core 0.12 / 0.16)."""
    torch = pytest.importorskip("torch")
    shape = MoEShape(num_layers=1, num_experts=2, hidden=3, ffn_hidden=4)
    training = TrainingLayout(tp=1, expert_impl="grouped").with_world(1)
    hf = _hf(torch, shape, seed=3)
    local = hf_to_megatron(hf, shape, training, 0)
    w1, w2 = local["decoder.layers.0.mlp.experts.weight1"], local["decoder.layers.0.mlp.experts.weight2"]
    assert w1.shape == (3, 2 * 2 * 4) and w2.shape == (2 * 4, 3)
    per = w1.view(2, 3, 8)
    assert torch.equal(per[1, :, :4], hf[hf_expert_name(0, 1, "gate_proj")].t())
    assert torch.equal(per[1, :, 4:], hf[hf_expert_name(0, 1, "up_proj")].t())
    assert torch.equal(w2.view(2, 4, 3)[1], hf[hf_expert_name(0, 1, "down_proj")].t())


def test_names_and_errors():
    assert parse_hf_expert_name(hf_expert_name(3, 7, "up_proj")) == (3, 7, "up_proj")
    with pytest.raises(LayoutError):
        hf_expert_name(0, 0, "w1")
    with pytest.raises(LayoutError, match="give layer_stages"):
        TrainingLayout(tp=1, pp=4).with_world(4).stage_of_layer(0, 94)
    uneven = TrainingLayout(tp=1, pp=2, layer_stages=(0, 0, 1)).with_world(2)
    assert [uneven.stage_of_layer(l, 3) for l in range(3)] == [0, 0, 1]
    vpp = TrainingLayout(tp=1, pp=2, vpp=2).with_world(2)
    assert [vpp.stage_of_layer(l, 8) for l in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(LayoutError, match="not divisible by rollout tp"):
        RolloutLayout(3, 1).check(MoEShape(1, 4, 8, 16))
    with pytest.raises(LayoutError, match="host 3 of 4"):
        RolloutLayout.from_expert_maps(1, 2, [[0, 1], [2, 2]]).check(MoEShape(1, 4, 8, 16))
