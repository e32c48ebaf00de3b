"""HDP runtime on 4 gloo processes (float64): RoPE + sub-ring attention + verl packing.

Run on every rank by ``run_group(..., "run", 4, double_root)`` (tests/features/hdp/
test_runtime_parity.py); with the MindSpeed double's root it ends with mindspeed_scenario.run.

What is real: Megatron-Core's ``parallel_state`` with CP = 4 (gloo groups), Megatron-Core's THD
RoPE -- 0.12.1 ``rope_utils._apply_rotary_pos_emb_thd`` (patched by ``hdp.rope_thd``), 0.16.1
``rope_utils.apply_rotary_pos_emb`` with ``cp_group`` (patched by ``hdp.rope_cp_group``) -- and
``_apply_rotary_pos_emb_bshd`` for the reference; verl's ``preprocess_packed_seqs`` /
``postprocess_packed_seqs`` (the installed verl, patched by ``hdp.verl_preprocess`` /
``hdp.verl_postprocess``). This package's own: the sub-ring attention and the packing /
unpacking the wrappers run. The attention block is built here from those functions (the
test harness's GPTModel supports cp = 1 only): q/k/v projections, RoPE, causal attention,
output projection, a tanh loss over the real tokens of every row.

The reference is one process's view without any CP: each row whole, plain causal softmax.
"""

from __future__ import annotations

import importlib
import math

HEADS, HEAD_DIM, HIDDEN = 2, 8, 12
ROWS = (37, 12, 20, 9, 25, 6)      # real lengths of the micro-batch's rows
LEFT_PAD = (0, 3, 1, 0, 5, 2)       # verl-style left padding before each row's tokens
SEQ_LEN = 48

PLANS = {
    "all_cp": (((0, 1, 2, 3),), (0, 0, 0, 0, 0, 0)),
    "pure_dp": (((0,), (1,), (2,), (3,)), (0, 1, 2, 3, 3, 2)),
    "odd_and_single": (((0, 1, 2), (3,)), (0, 1, 0, 1, 0, 1)),
    "pair_and_singles": (((0, 1), (2,), (3,)), (0, 1, 2, 0, 1, 2)),
}


def _data(torch):
    g = torch.Generator().manual_seed(7)
    f64 = torch.float64
    mask = torch.zeros(len(ROWS), SEQ_LEN, dtype=torch.bool)
    for i, (n, left) in enumerate(zip(ROWS, LEFT_PAD)):
        mask[i, left:left + n] = True
    x = torch.randn(len(ROWS), SEQ_LEN, HIDDEN, generator=g, dtype=f64)
    weights = {name: torch.randn(shape, generator=g, dtype=f64) / math.sqrt(shape[0]) for name, shape in
               (("wq", (HIDDEN, HEADS * HEAD_DIM)), ("wk", (HIDDEN, HEADS * HEAD_DIM)),
                ("wv", (HIDDEN, HEADS * HEAD_DIM)), ("wo", (HEADS * HEAD_DIM, HIDDEN)))}
    target = torch.randn(len(ROWS), SEQ_LEN, HIDDEN, generator=g, dtype=f64)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=f64) / HEAD_DIM))
    angles = torch.outer(torch.arange(64, dtype=f64), inv)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [max_s, 1, 1, d], Megatron's layout
    return x, mask, weights, target, freqs


def _leaves(torch, x, weights):
    xs = x.clone().requires_grad_(True)
    ws = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    return xs, ws


def _loss(torch, y, mask, target):
    return (torch.tanh(y) * target * mask[..., None]).sum()


def reference(torch, x, mask, weights, target, freqs) -> dict:
    """No CP: each row whole, plain causal softmax; RoPE with Megatron's bshd function."""
    from megatron.core.models.common.embeddings import rope_utils

    xs, ws = _leaves(torch, x, weights)
    y = torch.zeros_like(xs)
    outs = []
    for i in range(len(ROWS)):
        xi = xs[i][mask[i]]
        n = xi.shape[0]
        q, k, v = ((xi @ ws[w]).view(n, HEADS, HEAD_DIM) for w in ("wq", "wk", "wv"))
        q = rope_utils._apply_rotary_pos_emb_bshd(q.unsqueeze(1), freqs[:n]).squeeze(1)
        k = rope_utils._apply_rotary_pos_emb_bshd(k.unsqueeze(1), freqs[:n]).squeeze(1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, HEADS * HEAD_DIM) @ ws["wo"]
        outs.append((i, out))
    index = [(i, torch.nonzero(mask[i]).squeeze(1)) for i in range(len(ROWS))]
    for (i, out), (_, cols) in zip(outs, index):
        y = y.index_put((torch.full_like(cols, i), cols), out)
    loss = _loss(torch, y, mask, target)
    loss.backward()
    return {"loss": loss.detach(), "x": xs.grad, **{k: v.grad for k, v in ws.items()}}


def _rope(torch, t, cu, freqs):
    """Megatron-Core's THD RoPE as the attention layer calls it on this stack."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    if "cp_group" in rope_utils.apply_rotary_pos_emb.__code__.co_varnames:  # 0.16
        from megatron.core.transformer.transformer_config import TransformerConfig
        config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                   apply_rope_fusion=False)
        return rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu,
                                               cp_group=parallel_state.get_context_parallel_group())
    return rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs)


def hdp_step(torch, x, mask, weights, target, freqs, groups, group_of) -> dict:
    """This rank's forward/backward under a plan, through the verl wrappers (patched upstream
    functions), Megatron's RoPE and the sub-ring attention; gradients summed over ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from verl.models.mcore import util as verl_util

    from ascend_rl_plugins.features.hdp import groups as hdp_groups
    from ascend_rl_plugins.features.hdp.layout import layout_of
    from ascend_rl_plugins.features.hdp.ring_attention import sub_ring_attention
    from ascend_rl_plugins.features.hdp.verl_packing import attach_plan

    class Plan:  # a micro-batch plan as the planner's MicroBatchPlan carries it
        pass
    plan = Plan()
    plan.sequences, plan.groups, plan.group_of = tuple(range(len(ROWS))), groups, group_of
    xs, ws = _leaves(torch, x, weights)
    m = mask.clone()
    attach_plan(m, plan)
    packed, params = verl_util.preprocess_packed_seqs(xs, m, pre_process=True)
    layout = layout_of(params.cu_seqlens_q_padded)
    local = packed[0]
    n = local.shape[0]
    q, k, v = ((local @ ws[w]).view(n, HEADS, HEAD_DIM) for w in ("wq", "wk", "wv"))
    q = _rope(torch, q, params.cu_seqlens_q_padded, freqs)
    k = _rope(torch, k, params.cu_seqlens_kv_padded, freqs)
    cp_ranks = dist.get_process_group_ranks(parallel_state.get_context_parallel_group())
    members = hdp_groups.global_ranks(layout.group, cp_ranks)
    attn = sub_ring_attention(q, k, v, layout, members, hdp_groups.sub_group(members), 1 / math.sqrt(HEAD_DIM))
    out = attn.reshape(n, HEADS * HEAD_DIM) @ ws["wo"]
    y = verl_util.postprocess_packed_seqs(out.unsqueeze(0), params, m, len(ROWS), SEQ_LEN, post_process=True)
    loss = _loss(torch, y, mask, target)
    loss.backward()
    grads = {"x": xs.grad, **{k: v.grad for k, v in ws.items()}}
    for g in grads.values():
        dist.all_reduce(g)
    return {"loss": loss.detach(), **grads}


def _max_diff(torch, a: dict, b: dict) -> dict:
    return {k: float((a[k] - b[k]).abs().max()) for k in b}


def _rope_identity(torch, freqs) -> dict:
    """Patched RoPE with the all-CP layout attached vs stock RoPE without: bit for bit."""
    from ascend_rl_plugins.features.hdp.layout import HdpLayout, attach

    g = torch.Generator().manual_seed(3)
    padded = [((n + 7) // 8) * 8 for n in ROWS]
    cu_plain = torch.tensor([0] + list(torch.cumsum(torch.tensor(padded), 0)), dtype=torch.int32)
    t = torch.randn(sum(padded) // 4, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    stock = _rope(torch, t, cu_plain, freqs)
    import torch.distributed as dist
    cu = cu_plain.clone()
    attach([cu], HdpLayout(ROWS, ((0, 1, 2, 3),), (0,) * len(ROWS), dist.get_rank()))
    out = {"rope_all_cp_equal": bool(torch.equal(stock, _rope(torch, t, cu, freqs)))}
    from megatron.core.models.common.embeddings import rope_utils
    if "cp_group" not in rope_utils.apply_rotary_pos_emb.__code__.co_varnames:  # 0.12: fusion requested
        from megatron.core.transformer.transformer_config import TransformerConfig
        config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                   apply_rope_fusion=False)
        config.apply_rope_fusion = True  # the config check refuses it where no fused kernel is installed
        layout = HdpLayout(ROWS, ((0, 1), (2,), (3,)), (0,) * len(ROWS), dist.get_rank())
        if layout.rows:
            cu = torch.tensor(layout.cu_seqlens_padded(), dtype=torch.int32)
            attach([cu], layout)
            t = torch.randn(layout.local_tokens(dist.get_rank()), HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
            out["fused_request_runs_unfused"] = bool(torch.equal(
                rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu),
                rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs)))
    return out


def _verl_identity(torch) -> dict:
    """verl's pre/post-processing, patched with an all-CP plan vs stock: bit for bit (values and
    the gradient reaching this rank's packed output)."""
    from verl.models.mcore import util as verl_util

    from ascend_rl_plugins.features.hdp.verl_packing import attach_plan
    g = torch.Generator().manual_seed(11)
    mask = torch.zeros(len(ROWS), SEQ_LEN, dtype=torch.bool)
    for i, (n, left) in enumerate(zip(ROWS, LEFT_PAD)):
        mask[i, left:left + n] = True
    ids = torch.randint(1, 1000, (len(ROWS), SEQ_LEN), generator=g)

    def run():
        m = mask.clone()
        plan = type("Plan", (), {})()
        plan.sequences, plan.groups, plan.group_of = tuple(range(len(ROWS))), ((0, 1, 2, 3),), (0,) * len(ROWS)
        attach_plan(m, plan)
        packed, params = verl_util.preprocess_packed_seqs(ids, m, pre_process=True)
        gen = torch.Generator().manual_seed(5)
        logits = torch.randn(1, packed.shape[1], 7, generator=gen, dtype=torch.float32).requires_grad_(True)
        full = verl_util.postprocess_packed_seqs(logits, params, m, len(ROWS), SEQ_LEN, post_process=True)
        weight = torch.randn(full.shape, generator=gen, dtype=torch.float32)
        (full * weight).sum().backward()
        return packed, params, full.detach(), logits.grad

    stock = run()
    return {"stock": stock}


MB_LENGTHS = (60, 5, 9, 33, 7, 14, 3, 41, 8, 12)   # one mini-batch for micro-batch formation
MB_SEQ_LEN = 64


def _mini_batch(torch):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(21)
    mask = torch.zeros(len(MB_LENGTHS), MB_SEQ_LEN, dtype=torch.bool)
    for i, n in enumerate(MB_LENGTHS):
        mask[i, MB_SEQ_LEN - n:] = True if i % 2 else False
        if not i % 2:
            mask[i, :n] = True
    ids = torch.randint(1, 1000, (len(MB_LENGTHS), MB_SEQ_LEN), generator=g)
    return TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(MB_LENGTHS)])


def _recompute_keeps_its_micro_batch(torch, x, mask, freqs) -> dict:
    """Activation recompute after a later micro-batch was pre-processed: the recomputed RoPE of
    micro-batch A uses A's plan (the seed's process-global groups would give it B's)."""
    from torch.utils.checkpoint import checkpoint
    from verl.models.mcore import util as verl_util

    from ascend_rl_plugins.features.hdp.verl_packing import attach_plan

    def prepared(plan_name):
        m = mask.clone()
        plan = type("Plan", (), {})()
        plan.sequences = tuple(range(len(ROWS)))
        plan.groups, plan.group_of = PLANS[plan_name]
        attach_plan(m, plan)
        packed, params = verl_util.preprocess_packed_seqs(x, m, pre_process=True)
        return packed[0].reshape(-1, HEADS, HIDDEN // HEADS).detach(), params

    def rope_sum(t, cu):  # RoPE over the first HIDDEN // HEADS rotary channels
        return (_rope(torch, t, cu, freqs[..., :HIDDEN // HEADS]) ** 2).sin().sum()

    grads = {}
    for use_checkpoint in (False, True):
        qa, pa = prepared("odd_and_single")
        qa.requires_grad_(True)
        la = checkpoint(rope_sum, qa, pa.cu_seqlens_q_padded, use_reentrant=False) if use_checkpoint \
            else rope_sum(qa, pa.cu_seqlens_q_padded)
        prepared("pure_dp")  # the next micro-batch is pre-processed before A's backward
        la.backward()
        grads[use_checkpoint] = qa.grad
    return {"recompute_equal": bool(torch.equal(grads[False], grads[True]))}


def _micro_batch_formation(torch, stock_partitions) -> dict:
    """Patched rearrange_micro_batches: the planner's micro-batches, each carrying its plan, at
    least verl's count, and preprocess_packed_seqs groups a micro-batch as its plan says even
    when the plan attribute is gone (the tensor copied to a device)."""
    from megatron.core import parallel_state as mpu
    from verl.models.mcore import util as verl_util
    from verl.utils import seqlen_balancing

    from ascend_rl_plugins.features.hdp.layout import layout_of
    from ascend_rl_plugins.features.hdp.verl_packing import PLAN_ATTRIBUTE

    batch = _mini_batch(torch)
    micro_batches, parts = seqlen_balancing.rearrange_micro_batches(
        batch, max_token_len=2 * MB_SEQ_LEN, dp_group=mpu.get_data_parallel_group())
    out = {"k_verl": len(stock_partitions), "k_hdp": len(parts),
           "rows": sorted(i for p in parts for i in p), "plans": [], "same_groups_after_copy": [],
           "cap_ok": []}
    for mb, rows in zip(micro_batches, parts):
        plan = getattr(mb["attention_mask"], PLAN_ATTRIBUTE, None)
        out["plans"].append(None if plan is None else [list(g) for g in plan.groups])
        copied = mb["attention_mask"].clone()  # what .to(device) gives: no attribute
        _, params = verl_util.preprocess_packed_seqs(mb["input_ids"], copied, pre_process=True)
        layout = layout_of(params.cu_seqlens_q_padded)
        out["same_groups_after_copy"].append(plan is not None and layout.groups == tuple(tuple(sorted(g)) for g in plan.groups)
                                             and list(layout.lengths) == [MB_LENGTHS[i] for i in rows])
        out["cap_ok"].append(max(layout.local_tokens(r) for r in range(4)) <= max(2 * MB_SEQ_LEN // 4, 16))
    return out


def _planner_path_round_trip(torch) -> dict:
    """No plan attached and none remembered: the wrappers plan the micro-batch from its lengths;
    pre- then post-processing a float tensor gives it back exactly (zeros off the mask)."""
    from verl.models.mcore import util as verl_util

    from ascend_rl_plugins.features.hdp.layout import layout_of
    g = torch.Generator().manual_seed(5)
    lengths, seq_len = (61, 4, 6, 3, 2, 5), 64
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 1:1 + n] = True
    x = torch.randn(len(lengths), seq_len, 3, generator=g, dtype=torch.float64)
    packed, params = verl_util.preprocess_packed_seqs(x, mask, pre_process=True)
    layout = layout_of(params.cu_seqlens_q_padded)
    back = verl_util.postprocess_packed_seqs(packed, params, mask, len(lengths), seq_len, post_process=True)
    return {"groups": [list(g) for g in layout.groups], "group_of": list(layout.group_of),
            "exact": bool(torch.equal(back, x * mask[..., None]))}


# per data-parallel rank (CP = 2, max_token_len 128): verl counts 1 micro-batch for both (128 real
# tokens); padded for CP the first replica's rows need 2 (a rank may hold 64 tokens), so the
# second replica must re-plan for 2 as well
DP_LENGTHS = {0: (63, 63, 2), 1: (5, 6, 7, 8, 9, 10)}


def _dp_synced_formation(torch) -> dict:
    """CP = 2, DP = 2, the two DP replicas holding very different rows: the planner's
    micro-batch count is agreed over the DP group (verl needs the same count on every DP rank)."""
    from megatron.core import parallel_state as mpu
    from tensordict import TensorDict
    from verl.utils import seqlen_balancing

    from ascend_rl_plugins.features.hdp.verl_packing import PLAN_ATTRIBUTE

    dp_rank = mpu.get_data_parallel_rank()
    lengths = DP_LENGTHS[dp_rank]
    mask = torch.zeros(len(lengths), MB_SEQ_LEN, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    batch = TensorDict({"input_ids": torch.ones(len(lengths), MB_SEQ_LEN, dtype=torch.long), "attention_mask": mask},
                       batch_size=[len(lengths)])
    stock = getattr(seqlen_balancing.rearrange_micro_batches, "__wrapped__", None)
    _, verl_parts = stock(batch, max_token_len=2 * MB_SEQ_LEN, dp_group=mpu.get_data_parallel_group())
    micro_batches, parts = seqlen_balancing.rearrange_micro_batches(
        batch, max_token_len=2 * MB_SEQ_LEN, dp_group=mpu.get_data_parallel_group())
    plans = [getattr(mb["attention_mask"], PLAN_ATTRIBUTE, None) for mb in micro_batches]
    return {"dp_rank": dp_rank, "k_verl": len(verl_parts), "k": len(parts), "rows": sorted(i for p in parts for i in p),
            "plans": [None if p is None else [list(g) for g in p.groups] for p in plans]}


def _guarded_schedule() -> dict:
    """The schedule verl gets from Megatron-Core's ``get_forward_backward_func`` (no pipeline
    here) is the guard's wrapper around the stock function (Megatron-Core 0.16's schedule
    allocates on CUDA, so it is not run on this CPU)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    from ascend_rl_plugins.features import hdp

    fn = get_forward_backward_func()
    inner = getattr(fn, "__wrapped__", None)
    state = {p.name: p.outcome.state for p in hdp.FEATURE.patches}["hdp.guard_no_pipelining"]
    return {"state": state, "wrapped": inner is not None and fn is not inner,
            "inner": getattr(inner, "__name__", ""), "module_global": fn is schedules.forward_backward_no_pipelining}


def _model_support(torch) -> dict:
    """Real ``GPTModel`` construction: a dense model keeps HDP; an MoE model with the
    sequence-level auxiliary loss switches it off for the process (``hdp.model_support``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ascend_rl_plugins.features import hdp

    def build(**extra):
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                                   use_cpu_initialization=True, **extra)
        spec = get_gpt_layer_local_spec(num_experts=extra.get("num_moe_experts"))
        GPTModel(config=config, transformer_layer_spec=spec, vocab_size=32, max_sequence_length=64)

    hdp._fallback.clear()
    build()
    out = {"dense_keeps_hdp": hdp.enabled()}
    build(num_moe_experts=2, moe_router_topk=2, moe_router_load_balancing_type="seq_aux_loss", add_bias_linear=False,
          moe_aux_loss_coeff=0.01)
    out.update(seq_aux_loss_keeps_hdp=hdp.enabled(), reason=hdp._fallback.get("reason", ""))
    hdp._fallback.clear()
    return out


def run(mindspeed_double_root: str = "") -> dict:
    import torch

    from ascend_rl_plugins.features import hdp
    from ascend_rl_plugins.patching.core import REGISTRY
    from tests.support.megatron import Layout, parallel_groups

    torch.set_num_threads(1)
    if mindspeed_double_root:  # before the first activation: versions are read once per process
        import sys
        sys.path.insert(0, mindspeed_double_root)
    out: dict = {}
    with parallel_groups(Layout(cp=4)):
        x, mask, weights, target, freqs = _data(torch)
        ref = reference(torch, x, mask, weights, target, freqs)
        out["reference_loss"] = float(ref["loss"])

        # without the feature: stock upstream functions (whatever loaded the plugin is undone)
        importlib.import_module("verl.models.mcore.util")  # verl 0.9 may load plugins on import
        REGISTRY.revert_all()
        out["stock_states"] = sorted({p.outcome.state for p in REGISTRY.patches.values()})
        stock_verl = _verl_identity(torch)["stock"]
        from verl.utils import seqlen_balancing
        from megatron.core import parallel_state as mpu
        # CPU shim: verl 0.9.1 has no CPU platform (its fallback is 'cuda'); the DP-synced count
        # is all-reduced on a CPU tensor over gloo instead. No numerics involved.
        seqlen_balancing.get_device_name = lambda: "cpu"
        _, stock_partitions = seqlen_balancing.rearrange_micro_batches(
            _mini_batch(torch), max_token_len=2 * MB_SEQ_LEN, dp_group=mpu.get_data_parallel_group())
        try:
            diffs = _max_diff(torch, hdp_step(torch, x, mask, weights, target, freqs, *PLANS["odd_and_single"]), ref)
            out["unpatched_mixed"] = max(diffs.values())
        except Exception as exc:  # the stock functions cannot run the plan: recorded for the test
            out["unpatched_mixed"] = f"{type(exc).__name__}: {exc}"[:300]

        REGISTRY.activate(only=hdp.FEATURE.patches)
        out["patch_states"] = {p.name: p.outcome.state for p in hdp.FEATURE.patches}
        out["schedule"] = _guarded_schedule()
        out.update(_rope_identity(torch, freqs))
        patched_verl = _verl_identity(torch)["stock"]
        out["verl_all_cp_equal"] = {
            "packed": bool(torch.equal(stock_verl[0], patched_verl[0])),
            "cu_seqlens": bool(torch.equal(stock_verl[1].cu_seqlens_q_padded, patched_verl[1].cu_seqlens_q_padded)),
            "max_seqlen": stock_verl[1].max_seqlen_q == patched_verl[1].max_seqlen_q,
            "output": bool(torch.equal(stock_verl[2], patched_verl[2])),
            "output_grad": bool(torch.equal(stock_verl[3], patched_verl[3])),
        }
        out["micro_batches"] = _micro_batch_formation(torch, stock_partitions)
        out["planner_path"] = _planner_path_round_trip(torch)
        out.update(_recompute_keeps_its_micro_batch(torch, x, mask, freqs))
        out["plans"] = {}
        for name, (groups, group_of) in PLANS.items():
            got = hdp_step(torch, x, mask, weights, target, freqs, groups, group_of)
            out["plans"][name] = _max_diff(torch, got, ref)
        # each RoPE patch is needed: without it a split row gets the wrong rotary positions
        for p in hdp.FEATURE.patches:
            if p.name.startswith("hdp.rope"):
                REGISTRY.revert(p)
        try:
            got = hdp_step(torch, x, mask, weights, target, freqs, *PLANS["odd_and_single"])
            out["without_rope_patch"] = max(_max_diff(torch, got, ref).values())
        except Exception as exc:  # a wrong split can also fail outright: recorded for the test
            out["without_rope_patch"] = f"{type(exc).__name__}: {exc}"[:300]
    with parallel_groups(Layout(cp=2)):
        out["dp_synced"] = _dp_synced_formation(torch)
    with parallel_groups(Layout()):
        out["model_support"] = _model_support(torch)
        for p in hdp.FEATURE.patches:
            REGISTRY.revert(p)
    if mindspeed_double_root:  # same group, no second start-up of 4 interpreters
        from tests.features.hdp import mindspeed_scenario
        out["mindspeed"] = mindspeed_scenario.run(mindspeed_double_root)
    return out
