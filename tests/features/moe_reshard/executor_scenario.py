"""Gloo scenario (run on every rank by tests.support.child.run_group): real Megatron-Core MoE
models (SequentialMLP and legacy GroupedMLP, ETP 1 and 2) resharded by ``reshard_experts`` to
several vLLM rollout layouts, compared bit for bit with a single-process HF reference built
from the canonical weights; plus the layout algebra's rank coordinates against Megatron-Core's
own ``parallel_state`` groups."""

from __future__ import annotations

import os

from ascend_rl_plugins.features.moe_reshard.layout import PROJS, MoEShape, RolloutLayout, TrainingLayout, \
    hf_expert_name, rollout_view
from ascend_rl_plugins.features.moe_reshard.planner import plan

ARCH = dict(layers=2, hidden=64, moe_ffn_hidden=32, heads=4, query_groups=2, kv_channels=16, vocab=64, seq_len=8)


def _rollouts(world: int, experts: int) -> dict[str, RolloutLayout]:
    """Rollout layouts that fit ``world`` ranks: EP linear / round-robin / redundant+uneven maps,
    flattened-TP without EP."""
    out = {
        "ep_linear_tp1": RolloutLayout.linear(1, world, experts),
        "ep_round_robin_tp2": RolloutLayout.round_robin(2, world // 2, experts),
        "tp_no_ep": RolloutLayout(world, 1),
        "tp2_dp_no_ep": RolloutLayout(2, world // 2),
    }
    # redundant and uneven: rank 0 hosts three experts (one of them twice), the last rank one
    maps = [list(m) for m in RolloutLayout.linear(1, world, experts).expert_maps]
    moved = maps[-1].pop()
    maps[0] = maps[0] + [moved, maps[1][0], maps[0][0]]
    out["ep_redundant_uneven"] = RolloutLayout.from_expert_maps(1, world, maps)
    return out


def _reference(canonical: dict, arch: dict, experts: int) -> dict:
    """HF expert tensors of the canonical (1-process) model: fc1 = [gate; up], fc2 = down."""
    out = {}
    i = arch["moe_ffn_hidden"]
    for layer in range(arch["layers"]):
        for e in range(experts):
            p = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}."
            fc1, fc2 = canonical[p + "linear_fc1.weight"], canonical[p + "linear_fc2.weight"]
            out[hf_expert_name(layer, e, "gate_proj")] = fc1[:i]
            out[hf_expert_name(layer, e, "up_proj")] = fc1[i:]
            out[hf_expert_name(layer, e, "down_proj")] = fc2
    return out


def _expected(reference: dict, shape: MoEShape, rollout: RolloutLayout, rank: int) -> list[str]:
    names = []
    for s, copies in rollout.needed(shape, rank):
        names += [hf_expert_name(s.layer, s.expert, s.proj)] * copies
    return names


def _check_coords(layout, ps) -> list[str]:
    """The layout algebra's coordinates of this rank vs Megatron-Core's parallel_state."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    t = TrainingLayout(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp or layout.tp,
                       cp=layout.cp).with_world(world)
    c = t.coords(rank)
    real = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "cp": ps.get_context_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank(),
            "edp": ps.get_expert_data_parallel_rank()}
    return [f"{layout}: {k} ours {c[k]} megatron {v}" for k, v in real.items() if c[k] != v]


def _synthetic(rank: int, world: int, bucket_bytes: int) -> list[dict]:
    """Layouts the CPU harness cannot build (pipeline stages, uneven stages, virtual stages,
    TEGroupedMLP names): this rank's expert tensors cut from random HF tensors by
    ``layout.hf_to_megatron`` (checked against Megatron's storage in test_layout.py), resharded
    over the same gloo group."""
    import torch

    from ascend_rl_plugins.features.moe_reshard.executor import reshard_experts
    from ascend_rl_plugins.features.moe_reshard.layout import hf_to_megatron
    experts = 8
    shape = MoEShape(num_layers=4, num_experts=experts, hidden=16, ffn_hidden=8, moe_layers=(0, 2, 3), dtype_bytes=2)
    g = torch.Generator().manual_seed(5)
    hf = {}
    for layer in shape.expert_layers:
        for e in range(experts):
            for proj in PROJS:
                size = (shape.hidden, shape.ffn_hidden) if proj == "down_proj" else (shape.ffn_hidden, shape.hidden)
                hf[hf_expert_name(layer, e, proj)] = torch.randn(size, generator=g).bfloat16()
    trainings = [TrainingLayout(tp=1, pp=2, ep=2, etp=1, expert_impl="grouped", layer_stages=(0, 0, 0, 1)),
                 TrainingLayout(tp=2, pp=2, ep=1, etp=2, vpp=2, expert_impl="te_grouped")]
    if world == 8:
        trainings = [TrainingLayout(tp=2, pp=2, ep=2, etp=2, expert_impl="grouped", layer_stages=(0, 1, 1, 1))]
    cases = []
    for training in trainings:
        t = training.with_world(world)
        local = hf_to_megatron(hf, shape, t, rank)
        for tag, rollout in _rollouts(world, experts).items():
            got, mismatches = [], []
            for name, tensor in reshard_experts(local, shape=shape, training=t, rollout=rollout,
                                                bucket_bytes=bucket_bytes):
                got.append(name)
                want = rollout_view(hf[name], name.split(".")[-2], rollout, rank)
                if tensor.dtype != want.dtype or tensor.shape != want.shape or not torch.equal(tensor, want):
                    mismatches.append(name)
            p = plan(shape, t, rollout, bucket_bytes=bucket_bytes)
            expected = _expected(hf, shape, rollout, rank)
            layers = [int(n.split(".")[2]) for n in got]
            cases.append({"training": f"synthetic {t.expert_impl} tp{t.tp} pp{t.pp} vpp{t.vpp} ep{t.ep} etp{t.etp}",
                          "rollout": tag, "yielded": len(got), "expected": len(expected),
                          "same_multiset": sorted(got) == sorted(expected), "mismatches": mismatches[:5],
                          "layer_order": layers == sorted(layers), "rounds": len(p.rounds), "digest": p.digest(),
                          "received": p.bytes_received(rank), "minimum": p.minimum_bytes(rank),
                          "projs": sorted({n.split(".")[-2] for n in got}) == sorted(PROJS)})
    return cases


def run(world_tag: str, trainings: list, bucket_bytes: int) -> dict:
    """``trainings``: ``[[moe, tp, ep, etp, experts], ...]``; each is built as a real model and
    resharded to every rollout layout of :func:`_rollouts`."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ascend_rl_plugins.features.moe_reshard.executor import reshard_experts
    from tests.support.megatron import Layout, canonical_weights, megatron_model, parallel_groups

    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "coord_mismatches": [], "cases": []}
    # coordinates: a few layouts, pp and cp included (parallel_state only, no model)
    extra = [Layout(tp=2, pp=2, ep=2, etp=1), Layout(tp=1, pp=2, ep=2, etp=2), Layout(tp=2, cp=2, ep=2, etp=1)] \
        if world == 8 else [Layout(tp=1, pp=2, ep=2, etp=1), Layout(tp=2, ep=2, etp=1)]
    for layout in extra:
        with parallel_groups(layout):
            result["coord_mismatches"] += _check_coords(layout, ps)

    for moe, tp, ep, etp, experts in trainings:
        arch = dict(ARCH, experts=experts)
        with megatron_model(tp=tp, ep=ep, etp=etp, moe=moe, **arch) as h:
            result["coord_mismatches"] += _check_coords(h.layout, ps)
            local = {n: p for n, p in h.model.named_parameters() if ".mlp.experts." in n}
            reference = _reference(canonical_weights(h.arch, 0), arch, experts)
            shape = MoEShape(num_layers=arch["layers"], num_experts=experts, hidden=arch["hidden"],
                             ffn_hidden=arch["moe_ffn_hidden"], dtype_bytes=4)
            training = TrainingLayout(tp=tp, ep=ep, etp=etp, expert_impl=moe)
            for tag, rollout in _rollouts(world, experts).items():
                p = plan(shape, training, rollout, bucket_bytes=bucket_bytes)
                got_names, mismatches, layers = [], [], []
                for name, tensor in reshard_experts(local, shape=shape, training=training, rollout=rollout,
                                                    bucket_bytes=bucket_bytes):
                    got_names.append(name)
                    layer = int(name.split(".")[2])
                    layers.append(layer)
                    proj = name.split(".")[-2]
                    want = rollout_view(reference[name], proj, rollout, rank)
                    if tensor.shape != want.shape or tensor.dtype != want.dtype or not torch.equal(tensor, want):
                        mismatches.append(name)
                expected = _expected(reference, shape, rollout, rank)
                result["cases"].append({
                    "training": f"{moe} tp{tp} ep{ep} etp{etp} E{experts}", "rollout": tag,
                    "yielded": len(got_names), "expected": len(expected),
                    "same_multiset": sorted(got_names) == sorted(expected),
                    "mismatches": mismatches[:5], "layer_order": layers == sorted(layers),
                    "rounds": len(p.rounds), "digest": p.digest(),
                    "received": p.bytes_received(rank), "minimum": p.minimum_bytes(rank),
                    "projs": sorted({n.split(".")[-2] for n in got_names}) == sorted(PROJS),
                })
    result["cases"] += _synthetic(rank, world, bucket_bytes // 8)
    return result


def world4() -> dict:
    # with world8 below: SequentialMLP and GroupedMLP each at ETP 1 and ETP 2
    return run("4", [["sequential", 2, 2, 1, 8], ["grouped", 1, 2, 2, 8]],
               bucket_bytes=int(os.environ.get("ARP_TEST_BUCKET", "20000")))


def world8() -> dict:
    return run("8", [["sequential", 2, 4, 2, 8], ["grouped", 2, 4, 1, 8]],
               bucket_bytes=int(os.environ.get("ARP_TEST_BUCKET", "20000")))
