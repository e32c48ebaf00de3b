"""Straight-through INT4 fake quantization of Megatron-Core weights (imported lazily: torch here).

The forward weight is ``quant.int4.fake_quantize(weight, spec)`` -- the one INT4 quantizer
of this project, the same the rollout's W4A16 weights come from -- and the backward passes
the gradient unchanged to the master weight (straight-through estimator). ``fake_quantize``
works on ``[out, in]`` matrices with groups of ``G`` consecutive *input* columns, the layout
of the Hugging Face / vLLM weights the rollout quantizes, so each Megatron-Core weight is
brought to that orientation first:

* ``ColumnParallelLinear`` / ``RowParallelLinear`` (dense linears; ``SequentialMLP``'s
  experts are ``MLP`` s of these): ``weight`` is ``[out / tp, in]`` or ``[out, in / tp]`` --
  already ``[out, in]``. Rows are quantized independently, so the row order of fused QKV /
  ``[gate; up]`` and column-parallel sharding do not matter; a row-parallel shard holds whole
  groups when ``in / tp`` is a multiple of ``G`` (checked).
* ``GroupedMLP``: ``weight1`` is ``[H, n * 2I']`` read as ``[n, H, 2I']`` (expert ``e``'s
  ``fc1`` transposed: ``[in, out]``), ``weight2`` ``[n * I', H]`` read as ``[n, I', H]`` (``fc2``
  transposed). Both are transposed to ``[n, out, in]`` per expert, fake-quantized, and put
  back in Megatron's memory layout.

During the wrapped forward the layer's parameter entry holds the fake-quantized tensor (a
non-leaf of the master parameter); it is put back before the forward returns, so optimizers,
checkpoints and weight export only ever see the master weights.
"""

from __future__ import annotations

import contextlib

import torch


class Int4QatError(ValueError):
    """A layer cannot be fake-quantized with the configured group size."""


class _Proxy:
    """What the backward needs: the master parameter, and the attribute dict it shares with the
    straight-through tensor (no reference to that tensor itself, so no reference cycle through
    the autograd graph)."""
    __slots__ = ("master", "attrs")

    def __init__(self, master):
        self.master = master
        self.attrs = {}


class _StraightThrough(torch.autograd.Function):
    """forward: ``transform(weight)`` (from the step cache when ``cache_key`` is given); backward:
    the incoming gradient, unchanged."""

    @staticmethod
    def forward(ctx, weight, transform, proxy, cache_key):
        ctx.proxy = proxy
        if cache_key is None:
            return transform(weight)
        from .fake_weight_cache import CACHE
        fake = CACHE.fake_weight(weight, cache_key, transform)
        return fake.view_as(fake)   # a fresh tensor object per forward: each gets its own grad_fn

    @staticmethod
    def backward(ctx, grad):
        # Megatron's fused weight-gradient accumulation (gradient_accumulation_fusion, NPU/GPU)
        # adds the weight gradient to ``weight.main_grad`` itself and marks the tensor it was
        # given with ``grad_added_to_main_grad``; the mark belongs on the master parameter,
        # whose DDP hook then skips adding the (dummy) gradient a second time.
        proxy = ctx.proxy
        if proxy.attrs.get("grad_added_to_main_grad") and hasattr(proxy.master, "grad_added_to_main_grad"):
            proxy.master.grad_added_to_main_grad = True
        return grad, None, None, None


def straight_through(weight, transform, cache_key=None):
    """``transform(weight)`` whose gradient flows to ``weight`` unchanged. The result shares its
    attribute dict with the backward and carries ``weight``'s ``main_grad`` (Megatron DDP's
    gradient buffer) and ``grad_added_to_main_grad`` when it has them, so a fused
    weight-gradient kernel accumulates into the master's buffer and its mark reaches the master.

    ``cache_key`` (what ``transform`` computes: the layout and the quantizer spec): with
    ``ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE=step`` and gradients enabled, the transformed weight
    is computed once per optimizer step (:mod:`.fake_weight_cache`); otherwise on every call."""
    from . import fake_weight_cache_enabled
    proxy = _Proxy(weight)
    use_cache = cache_key is not None and torch.is_grad_enabled() and fake_weight_cache_enabled()
    out = _StraightThrough.apply(weight, transform, proxy, cache_key if use_cache else None)
    for name in ("main_grad", "grad_added_to_main_grad"):
        if hasattr(weight, name):
            proxy.attrs[name] = getattr(weight, name)
    out.__dict__ = proxy.attrs
    return out


# -- the transforms: Megatron layout -> [out, in] -> fake quantize -> Megatron layout ------------

def linear_fake_quant(weight, spec, where: str = "linear"):
    """A ``[out, in]`` weight fake-quantized (groups along ``in``); a non-finite weight is refused,
    naming ``where``, at once or before the optimizer step (``finite_checks.py``)."""
    from ...quant.int4 import fake_quantize
    from . import defer_finite_checks
    from .finite_checks import CHECKS
    if weight.shape[-1] % spec.group_size:
        raise Int4QatError(f"INT4 QAT: {where} has {weight.shape[-1]} input features per partition, not a "
                           f"multiple of ASCEND_RL_INT4_QAT_GROUP_SIZE={spec.group_size}; choose a group "
                           f"size that divides it (or fewer tensor-parallel ranks)")
    return fake_quantize(weight, spec, name=where, defer_finite=CHECKS.defer if defer_finite_checks() else None)


def grouped_fc1_fake_quant(weight1, num_experts: int, hidden: int, spec):
    """``GroupedMLP.weight1`` (``[H, n * out]``, expert ``e`` = ``view(n, H, out)[e]`` = fc1^T)."""
    per = weight1.view(num_experts, hidden, -1)                        # [n, in, out]
    out_dim = per.shape[-1]
    rows = per.transpose(1, 2).reshape(num_experts * out_dim, hidden)  # [n * out, in]
    fq = linear_fake_quant(rows, spec, "GroupedMLP.weight1 (fc1)")
    return fq.view(num_experts, out_dim, hidden).transpose(1, 2).reshape(weight1.shape).contiguous()


def grouped_fc2_fake_quant(weight2, num_experts: int, hidden: int, spec):
    """``GroupedMLP.weight2`` (``[n * in, H]``, expert ``e`` = ``view(n, in, H)[e]`` = fc2^T)."""
    per = weight2.view(num_experts, -1, hidden)                        # [n, in, out=H]
    in_dim = per.shape[1]
    rows = per.transpose(1, 2).reshape(num_experts * hidden, in_dim)   # [n * H, in]
    fq = linear_fake_quant(rows, spec, "GroupedMLP.weight2 (fc2)")
    return fq.view(num_experts, hidden, in_dim).transpose(1, 2).reshape(weight2.shape).contiguous()


def already_replaced(module, names) -> bool:
    """An enclosing wrapper (a subclass's forward calling its base's) already swapped these."""
    return any(not isinstance(module._parameters.get(name), torch.nn.Parameter) for name in names)


@contextlib.contextmanager
def fake_parameters(module, replacements: dict):
    """``module.<name>`` reads the given tensors instead of its parameters for the block."""
    if already_replaced(module, replacements):
        yield
        return
    saved = {name: module._parameters[name] for name in replacements}
    try:
        for name, tensor in replacements.items():
            module._parameters[name] = tensor
        yield
    finally:
        for name, param in saved.items():
            module._parameters[name] = param


def linear_replacements(layer, spec) -> dict:
    w = layer._parameters.get("weight")
    if w is None:
        return {}
    where = f"{type(layer).__name__} (weight {tuple(w.shape)})"
    return {"weight": straight_through(w, lambda t: linear_fake_quant(t, spec, where), ("linear", spec))}


def grouped_replacements(experts, spec) -> dict:
    n, hidden = experts.num_local_experts, experts.config.hidden_size
    w1, w2 = experts._parameters["weight1"], experts._parameters["weight2"]
    return {"weight1": straight_through(w1, lambda t: grouped_fc1_fake_quant(t, n, hidden, spec),
                                        ("grouped fc1", n, hidden, spec)),
            "weight2": straight_through(w2, lambda t: grouped_fc2_fake_quant(t, n, hidden, spec),
                                        ("grouped fc2", n, hidden, spec))}


# -- what the rollout receives: canonical [out, in] weights of the QAT model --------------------

def fake_quant_canonical(weights: dict, spec, scope: str) -> dict:
    """The forward weights of a QAT model in the canonical (per-expert ``[out, in]``) naming of
    Megatron-Core (``...mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``): every in-scope
    2-D weight fake-quantized, the rest unchanged. For tests and for checking an export."""
    out = {}
    for name, w in weights.items():
        out[name] = linear_fake_quant(w, spec, name) if in_scope_name(name, scope) and w.dim() == 2 else w
    return out


def in_scope_name(name: str, scope: str) -> bool:
    """Whether a canonical Megatron-Core parameter name is fake-quantized under ``scope``."""
    if not name.endswith(".weight"):
        return False
    if ".mlp.experts." in name:
        return True
    if scope != "all":
        return False
    return any(part in name for part in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
