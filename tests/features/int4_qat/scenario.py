"""int4_qat on real Megatron-Core GPTModels, run on every rank of a 2-process gloo group by
test_int4_qat.py (never imported by the pytest process).

Real: Megatron-Core's GPTModel (bf16 parameters, the dtype the rollout receives) from the
CPU harness, with TP2 dense linears (ColumnParallelLinear / RowParallelLinear), EP2
``SequentialMLP`` experts (MLPs of those linears) and EP2 ``GroupedMLP`` experts; the
ascend-rl patches applied through ``ascend_rl_plugins.activate()``; the one INT4 quantizer
(``quant.int4``).

For each layout the same canonical weights W go through:
  plain -- the model with W, patches off;
  qat   -- the model with W, QAT on (scope and group size from the env);
  ref   -- the model with fake_quantize'd W (``fake_quant_canonical``), patches off.
qat must equal ref bit for bit (logits, loss, every gradient: the gradient with respect to
the master weight is the gradient with respect to the fake-quantized weight), and differ from
plain (the patch did something).
"""

from __future__ import annotations

import os

FORWARD = ("int4_qat.column_parallel_forward", "int4_qat.row_parallel_forward", "int4_qat.grouped_mlp_forward")
PATCHES = FORWARD + ("int4_qat.gpt_output_layer", "int4_qat.config_check")

LAYOUTS = {   # name -> megatron_model kwargs
    "tp2_dense": dict(tp=2),
    "ep2_sequential": dict(ep=2, moe="sequential"),
    "ep2_grouped": dict(ep=2, moe="grouped"),
}


def _run(h, tokens):
    """logits, loss and local gradients of one forward/backward (gradients reset first)."""
    for p in h.model.parameters():
        p.grad = None
    logits = h.forward(h.local_batch(tokens)).detach().clone()
    loss = h.loss(tokens)
    loss.backward()
    h.finalize_grads()
    grads = {n: g.detach().clone() for n, g in h.grads().items()}
    return logits, loss.detach().clone(), grads


def _apply(on: bool):
    """The forward patches on / off (the construction-time ones stay applied: the plugin is
    active before the model is built, as with its entry points)."""
    from ascend_rl_plugins.patching.core import REGISTRY
    for name in FORWARD:
        if on and REGISTRY.patches[name].outcome.state != "applied":
            REGISTRY.apply(REGISTRY.patches[name])
        elif not on:
            REGISTRY.revert(REGISTRY.patches[name])


def _activate(scope: str, group: int, preset: str = "ct") -> None:
    """QAT flags set, the patch targets imported, the plugin activated, the forward patches on.

    The target modules are imported first: REGISTRY.apply of a patch whose module is not
    imported yet fires the armed import hook inside apply and wraps the target twice
    (reported to the framework owner); the plugin's own entry points never take that path."""
    import importlib

    import ascend_rl_plugins
    from ascend_rl_plugins.features.int4_qat import FEATURE
    _set_flags(scope, group, preset)
    for patch in FEATURE.patches:
        if patch.dist == "megatron-core":
            importlib.import_module(patch.module)
    ascend_rl_plugins.activate()
    _apply(True)


def _set_flags(scope: str, group: int, preset: str = "ct"):
    from ascend_rl_plugins import flags
    os.environ["ASCEND_RL_INT4_QAT"] = "1"
    os.environ["ASCEND_RL_INT4_QAT_SCOPE"] = scope
    os.environ["ASCEND_RL_INT4_QAT_GROUP_SIZE"] = str(group)
    os.environ["ASCEND_RL_INT4_QAT_PRESET"] = preset
    flags.reset_cache()


def _same(a, b) -> bool:
    import torch
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def layout(name: str, scope: str, group: int, preset: str = "ct") -> dict:
    """plain / qat / ref on one layout; a dict of booleans and mismatching names for the test."""
    import torch
    from ascend_rl_plugins.features.int4_qat import fake_quant, linear_in_scope, spec
    from ascend_rl_plugins.features.int4_qat import spec as qat_spec
    from ascend_rl_plugins.patching.core import REGISTRY
    from tests.support.megatron import canonical_weights, megatron_model

    _activate(scope, group, preset)
    out: dict = {"layout": name, "scope": scope, "group": group, "preset": qat_spec().preset}
    with megatron_model(dtype="bfloat16", **LAYOUTS[name]) as h:
        tokens = h.tokens(batch=4, seed=3)
        weights = canonical_weights(h.arch, seed=0)
        qspec = spec()
        fq = fake_quant.fake_quant_canonical(weights, qspec, scope)
        out["quantized_names"] = sorted(n for n in weights if not _same(weights[n], fq[n]))

        _apply(False)
        h.load(weights)
        plain = _run(h, tokens)
        _apply(True)
        out["patch_states"] = {p: REGISTRY.patches[p].outcome.state for p in PATCHES}
        qat = _run(h, tokens)
        # each forward patch is needed: without it alone the forward is no longer the QAT one
        out["needed"] = {}
        for patch in FORWARD:
            REGISTRY.revert(REGISTRY.patches[patch])
            with torch.no_grad():
                out["needed"][patch] = not _same(h.forward(h.local_batch(tokens)), qat[0])
            REGISTRY.apply(REGISTRY.patches[patch])
        # the masters are untouched by the forward (what the optimizer and the export see)
        local = h.local_view(weights)
        out["masters_changed"] = [n for n, p in h.model.named_parameters()   # (torch norms stay fp32)
                                  if not torch.equal(p.detach(), local[n].to(p.dtype))]
        out["master_grads_are_leaf_grads"] = all(p.grad is not None for n, p in h.model.named_parameters()
                                                 if n in qat[2])
        # the trainer's own sharded fake-quant tensors equal the shards of the canonical ones
        shard_mismatch = []
        fq_local = h.local_view(fq)
        with torch.no_grad():
            for mod_name, module in h.model.named_modules():
                kind = type(module).__name__
                if kind == "GroupedMLP":
                    rep = fake_quant.grouped_replacements(module, qspec)
                elif kind in ("ColumnParallelLinear", "RowParallelLinear") and linear_in_scope(module):
                    rep = fake_quant.linear_replacements(module, qspec)
                else:
                    continue
                for pname, t in rep.items():
                    full = f"{mod_name}.{pname}"
                    # this rank's fake-quant tensors (Megatron layout, shard) == shards of the canonical ones
                    if not _same(t.detach(), fq_local[full]):
                        shard_mismatch.append(full)
        out["shard_mismatch"] = shard_mismatch
        _apply(False)
        h.load(fq)
        ref = _run(h, tokens)

        out["logits_equal"] = _same(qat[0], ref[0])
        out["loss_equal"] = _same(qat[1], ref[1])
        out["grad_mismatch"] = sorted(n for n in ref[2] if n not in qat[2] or not _same(qat[2][n], ref[2][n]))
        out["grad_names"] = len(ref[2])
        out["differs_from_plain"] = not _same(qat[0], plain[0])
        out["plain_vs_qat_max_abs_logit"] = float((qat[0].float() - plain[0].float()).abs().max())
        # each parameter that QAT quantizes has a gradient that differs from the plain model's
        # (the gradient is taken at the fake-quantized point), the others' too through the forward
        out["grads_differ_from_plain"] = any(not _same(qat[2][n], plain[2][n]) for n in qat[2])

        # the rollout's view: quantize the exported (master) weights with the same quantizer;
        # dequantized, they are the trainer's forward weights bit for bit
        from ascend_rl_plugins.quant import int4
        export_mismatch = []
        for n in out["quantized_names"]:
            codes, scale = int4.quantize(weights[n], qspec)
            packed, pscale = int4.quantize_pack(weights[n], qspec)
            deq = int4.dequantize(codes, scale, qspec).to(weights[n].dtype)
            if not (_same(deq, fq[n]) and _same(int4.unpack(packed, weights[n].shape[-1]), codes)
                    and _same(pscale, scale)):
                export_mismatch.append(n)
        out["export_mismatch"] = export_mismatch
    return out


def all_layouts(group: int) -> dict:
    """The three layouts, scope all, then the GroupedMLP layout with scope experts; then a
    group size that does not fit a TP shard."""
    return {"cases": [layout("tp2_dense", "all", group), layout("ep2_sequential", "all", group),
                      layout("ep2_grouped", "all", group), layout("ep2_grouped", "experts", group),
                      layout("ep2_sequential", "experts", group, preset="slime")],
            "bad_group": bad_group(), "fused_wgrad": fused_wgrad(group)}


def bad_group() -> dict:
    """A TP2 dense model whose attention output input per partition (4 heads * 16 / 2 = 32) is
    not a multiple of 64 refuses to configure."""
    from tests.support.megatron import megatron_model
    _set_flags("all", 64)
    try:
        with megatron_model(tp=2, dtype="bfloat16"):
            return {"error": None}
    except Exception as exc:  # the expected refusal: recorded for the test
        return {"error": f"{type(exc).__name__}: {exc}"}


class FusedWgradDouble:
    """Double of the CUDA extension ``fused_weight_gradient_mlp_cuda`` (Megatron's fused
    weight-gradient accumulation, ``gradient_accumulation_fusion``; MindSpeed provides the NPU
    one): ``main_grad += grad_output^T @ input`` into the buffer it is given."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.float().t() @ total_input.float())

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        main_grad.add_((grad_output.t() @ total_input).to(main_grad.dtype))


def fused_wgrad(group: int) -> dict:
    """TP2 dense, scope all, with Megatron's fused weight-gradient accumulation into fp32
    ``main_grad`` buffers (as Megatron DDP sets them up: ``main_grad`` + ``grad_added_to_main_grad``):
    QAT's main_grad equals the fake-quantized model's bit for bit, and every quantized master is
    marked ``grad_added_to_main_grad`` (so DDP's hook does not add the dummy gradient again)."""
    import torch
    from ascend_rl_plugins.features.int4_qat import fake_quant, spec
    from megatron.core.tensor_parallel import layers as mc_layers
    from tests.support.megatron import canonical_weights, megatron_model

    _activate("all", group)
    saved = mc_layers.__dict__.get("fused_weight_gradient_mlp_cuda")
    mc_layers.fused_weight_gradient_mlp_cuda = FusedWgradDouble
    try:
        with megatron_model(dtype="bfloat16", tp=2) as h:
            tokens = h.tokens(batch=4, seed=3)
            weights = canonical_weights(h.arch, seed=0)
            fq = fake_quant.fake_quant_canonical(weights, spec(), "all")
            linears = {f"{n}.weight": m for n, m in h.model.named_modules()
                       if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear")}

            def run():
                for m in linears.values():
                    m.gradient_accumulation_fusion = True
                for p in h.model.parameters():
                    p.grad = None
                    p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
                    p.grad_added_to_main_grad = False
                h.loss(tokens).backward()
                params = dict(h.model.named_parameters())
                return ({n: params[n].main_grad.clone() for n in linears},
                        {n: bool(params[n].grad_added_to_main_grad) for n in linears})

            h.load(weights)
            qat_grads, qat_marks = run()
            _apply(False)
            h.load(fq)
            ref_grads, ref_marks = run()
            return {"linears": sorted(linears),
                    "main_grad_mismatch": sorted(n for n in linears if not torch.equal(qat_grads[n], ref_grads[n])),
                    "nonzero": sorted(n for n in linears if qat_grads[n].abs().sum() > 0),
                    "qat_unmarked": sorted(n for n, v in qat_marks.items() if not v),
                    "ref_unmarked": sorted(n for n, v in ref_marks.items() if not v)}
    finally:
        if saved is None:
            mc_layers.__dict__.pop("fused_weight_gradient_mlp_cuda", None)
        else:
            mc_layers.fused_weight_gradient_mlp_cuda = saved


def step_cache(group: int) -> dict:
    """``ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE=step`` on EP2 GroupedMLP, scope all (dense linears
    and grouped experts), trained the way Megatron's mixed-precision optimizers train: fp32 main
    copies stepped by a torch optimizer, then copied into the bf16 weights through ``.data``
    (which leaves the weights' version counters alone). Two optimizer steps of three
    micro-batches each, with the cache off, on, and on with its optimizer hook removed (to show
    that the hook is what keeps the second step exact)."""
    import torch
    from ascend_rl_plugins import flags
    from ascend_rl_plugins.features.int4_qat import fake_weight_cache
    from tests.support.megatron import canonical_weights, megatron_model

    _activate("all", group)

    def train(h, weights, mode: str):
        os.environ["ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE"] = "off" if mode == "off" else "step"
        flags.reset_cache()
        fake_weight_cache.reset()
        h.load(weights)
        params = [p for p in h.model.parameters()]
        main = [p.detach().float().clone().requires_grad_(True) for p in params]
        opt = torch.optim.SGD(main, lr=0.5)
        if mode == "on, no optimizer hook":
            fake_weight_cache.CACHE._ensure_hook()
            fake_weight_cache.CACHE._hook.remove()
        losses, per_step = [], []
        for step in range(2):
            for p in params:
                p.grad = None
            for micro in range(3):
                tokens = h.tokens(batch=2, seed=10 * step + micro)
                loss = h.loss(tokens)
                loss.backward()
                losses.append(loss.detach().clone())
            h.finalize_grads()
            stats = fake_weight_cache.CACHE.stats
            per_step.append({"hits": stats.hits, "misses": stats.misses, "cached": fake_weight_cache.CACHE.cached_count()})
            for m, p in zip(main, params):
                m.grad = None if p.grad is None else p.grad.float()
            opt.step()
            with torch.no_grad():
                for m, p in zip(main, params):
                    p.data.copy_(m.detach().to(p.dtype))
            per_step[-1]["cached_after_step"] = fake_weight_cache.CACHE.cached_count()
        return losses, [p.detach().clone() for p in params], per_step

    with megatron_model(dtype="bfloat16", ep=2, moe="grouped") as h:
        weights = canonical_weights(h.arch, seed=0)
        ref_losses, ref_params, off_steps = train(h, weights, "off")
        out = {"off": off_steps}
        for mode in ("on", "on, no optimizer hook"):
            losses, params, steps = train(h, weights, mode)
            out[mode] = {"steps": steps,
                         "losses_equal": [bool(torch.equal(a, b)) for a, b in zip(losses, ref_losses)],
                         "params_equal": all(torch.equal(a, b) for a, b in zip(params, ref_params))}
        fake_weight_cache.reset()
        os.environ.pop("ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE", None)
        flags.reset_cache()
        return out
