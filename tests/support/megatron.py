"""A CPU harness for real Megatron-Core models (test support, not part of the product).

Used by tests that need Megatron-Core's own parallel layouts on this GPU-less machine (MoE
expert reshard, hybrid data parallel, INT4 QAT, ...). It runs inside the ranks of a gloo
group started by ``tests.support.child.run_group`` (one process per rank, all on CPU)::

    # tests/<area>/<scenario module>.py -- called on every rank by run_group(module, fn, 4, ...)
    from tests.support.megatron import megatron_model

    def tp2_ep2(tmp):
        with megatron_model(tp=2, ep=2, moe="grouped", layers=2) as h:
            tokens = h.tokens(batch=4, seed=1)       # the global batch, identical on every rank
            loss = h.loss(tokens)                    # this rank's share of the global-mean LM loss
            loss.backward()
            h.finalize_grads()                       # data-parallel / expert-data-parallel sums
            ...                                      # h.model (GPTModel), h.config, h.layout

What is real: Megatron-Core's ``parallel_state`` (every group a gloo group), its
``TransformerConfig``, ``GPTModel`` built from ``get_gpt_layer_local_spec`` (no
TransformerEngine, no Apex), attention with GQA, RoPE and Qwen3's q/k RMSNorm, the MoE
layer with its router, alltoall token dispatcher and ``SequentialMLP`` or legacy
``GroupedMLP`` experts, sequence parallelism where Megatron requires it (MoE with
``tp > 1``), vocab-parallel cross entropy, autograd through all of it.

What is not: the CUDA / NCCL / Apex-only assumptions replaced by the test shims of
``tests/support/megatron_shims.py`` (each documented there, none changes numerics), and
the configuration this harness chooses for CPU: fp32 (or fp64) parameters built on CPU,
every fusion off, dropout 0, no auxiliary load-balancing loss (the loss is the LM loss
only), an explicit causal mask, ``torch._dynamo`` disabled (Megatron's ``jit_fuser`` is
``torch.compile``; eager execution computes the same values without compiling C++ on a
2-core machine), one intra-op thread per rank. ``GroupedMLP.forward`` of Megatron-Core
0.16 asserts ``config.bf16`` (0.12 does not); for ``moe="grouped"`` on such a version the
harness sets that flag while the parameters stay fp32 (no ``Float16Module`` wrapper) and
``attention_softmax_in_fp32=False`` keeps attention from casting its probabilities to
bf16 because of the flag -- nothing is computed in bf16. A later test that hands
``h.config`` to code reading ``config.bf16`` (optimizer, checkpoint conversion) must keep
that in mind.

Weights are *canonical*: every model is loaded from one layout-independent set of full
tensors (``canonical_weights``: the parameter names of the 1-process model, experts by
global index), so a 4-process TP2xEP2 model and a 1-process model compute the same
function and their logits, losses and gradients can be compared. ``Harness.local_view``
maps canonical tensors (weights or gradients) to this rank's shards -- tensor-parallel
rows/columns, the per-shard ``[gate; up]`` layout of SwiGLU, the expert-parallel slice of
experts, the expert-tensor-parallel shards, ``GroupedMLP``'s ``weight1`` / ``weight2``
memory layout; ``Harness.to_canonical`` goes the other way for an unsharded model.

Harness API: ``h.model`` (``GPTModel``), ``h.config``, ``h.arch`` (:class:`Arch`),
``h.layout`` (:class:`Layout`), ``h.tp_rank/tp_size/ep_rank/ep_size/etp_rank/etp_size/
dp_rank/dp_size``, ``h.tokens(batch, seed)``, ``h.local_batch(tokens)``,
``h.forward(tokens[, labels])`` (logits ``[b, s, vocab/tp]``), ``h.loss(tokens)``,
``h.finalize_grads()``, ``h.grads()``, ``h.load(canonical)``, ``h.local_view(canonical)``,
``h.to_canonical(local)``. Lower level: ``parallel_groups(Layout)`` (just
``parallel_state``, for any tp/pp/ep/etp/cp), ``build(arch, layout)``,
``canonical_weights(arch, seed)``, ``canonical_shapes(arch)``.

Limits: ``megatron_model`` builds ``pp == cp == 1`` models (pipeline schedules and
context-parallel attention need TransformerEngine / more of Megatron's runtime);
``parallel_groups`` accepts any pp / cp. Megatron's vocab-parallel cross entropy computes
in fp32, so with ``dtype="float64"`` the logits are float64-exact but loss and gradients
carry fp32 rounding. No ``DistributedDataParallel`` / distributed optimizer wrapper
(``finalize_grads`` does their gradient reduction by hand).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

from tests.support import megatron_shims

EXPERT_IMPLS = {"sequential": False, "grouped": True}   # moe= value -> moe_grouped_gemm


@dataclass(frozen=True)
class Layout:
    """Parallel sizes; the data-parallel size is what is left of the world."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None   # expert tensor parallel; None: Megatron's default (= tp)
    cp: int = 1


@dataclass(frozen=True)
class Arch:
    """A tiny Qwen3-style decoder: GQA attention with q/k RMSNorm and RoPE, SwiGLU MLP or
    top-k MoE (softmax over the top-k logits, i.e. normalized top-k probabilities)."""
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    query_groups: int = 2
    kv_channels: int = 16
    ffn_hidden: int = 128          # dense MLP
    vocab: int = 256
    seq_len: int = 16
    moe: str | None = None         # None (dense), "sequential" or "grouped"
    experts: int = 4
    topk: int = 2
    moe_ffn_hidden: int = 32
    dtype: str = "float32"         # or "float64"

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)


# ---------------------------------------------------------------------------------------------
# process groups

def _setup_process() -> None:
    """Shims, eager execution and one thread per rank (2 cores for up to 4 ranks)."""
    import torch
    torch.set_num_threads(1)
    import torch._dynamo
    torch._dynamo.config.disable = True
    megatron_shims.install()


@contextlib.contextmanager
def parallel_groups(layout: Layout = Layout(), seed: int = 1234) -> Iterator[Layout]:
    """Megatron-Core's ``parallel_state`` initialized for ``layout`` on the already
    initialized (gloo) default group, and its RNG tracker seeded; torn down on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _setup_process()
    assert dist.is_initialized(), "run inside tests.support.child.run_group (a gloo group)"
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, create_gloo_process_groups=False)
    try:
        model_parallel_cuda_manual_seed(seed)
        yield layout
    finally:
        ps.destroy_model_parallel()


# ---------------------------------------------------------------------------------------------
# canonical weights and their shards

def canonical_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the 1-process model (experts by global index)."""
    h, kv = arch.hidden, arch.kv_channels
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (arch.vocab, h)}
    for layer in range(arch.layers):
        p = f"decoder.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attention.linear_qkv.weight"] = ((arch.heads + 2 * arch.query_groups) * kv, h)
        shapes[p + "self_attention.q_layernorm.weight"] = (kv,)
        shapes[p + "self_attention.k_layernorm.weight"] = (kv,)
        shapes[p + "self_attention.linear_proj.weight"] = (h, arch.heads * kv)
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        if arch.moe is None:
            shapes[p + "mlp.linear_fc1.weight"] = (2 * arch.ffn_hidden, h)
            shapes[p + "mlp.linear_fc2.weight"] = (h, arch.ffn_hidden)
        else:
            shapes[p + "mlp.router.weight"] = (arch.experts, h)
            for e in range(arch.experts):
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * arch.moe_ffn_hidden, h)
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, arch.moe_ffn_hidden)
    shapes["decoder.final_layernorm.weight"] = (h,)
    shapes["output_layer.weight"] = (arch.vocab, h)
    return shapes


def canonical_weights(arch: Arch, seed: int = 0) -> dict:
    """Deterministic full weights for ``arch`` (the same on every rank and layout): norms
    around 1, matrices N(0, 0.5/sqrt(fan_in)) (the router a little wider, so that top-k
    choices are far from ties)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in canonical_shapes(arch).items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            std = (2.0 if name.endswith("router.weight") else 0.5) / shape[1] ** 0.5
            t = std * torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = t.to(arch.torch_dtype)
    return out


def _chunk(t, parts: int, rank: int, dim: int):
    return t.chunk(parts, dim=dim)[rank]


def _glu_chunk(t, parts: int, rank: int):
    """A shard of a SwiGLU fc1 weight ``[gate; up]``: Megatron keeps ``[gate_r; up_r]``."""
    import torch
    gate, up = t.chunk(2, dim=0)
    return torch.cat([_chunk(gate, parts, rank, 0), _chunk(up, parts, rank, 0)], dim=0)


class Harness:
    """A built model and everything needed to drive it; see the module docstring."""

    def __init__(self, model, config, arch: Arch, layout: Layout):
        from megatron.core import parallel_state as ps
        self.model, self.config, self.arch, self.layout = model, config, arch, layout
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.ep_rank, self.ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.etp_size = ps.get_expert_tensor_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.local_experts = arch.experts // self.ep_size if arch.moe else 0

    # -- weights ---------------------------------------------------------------------------
    def _expert(self, layer_prefix: str, e_local: int, which: str, canonical: dict):
        e = self.ep_rank * self.local_experts + e_local
        full = canonical[f"{layer_prefix}mlp.experts.local_experts.{e}.{which}.weight"]
        if which == "linear_fc1":
            return _glu_chunk(full, self.etp_size, self.etp_rank)
        return _chunk(full, self.etp_size, self.etp_rank, 1)

    def _local_expert(self, name: str, canonical: dict):
        """This rank's value of expert parameter ``name`` from canonical tensors, or None where
        ``name`` is not a routed-expert parameter."""
        import torch
        prefix, _, leaf = name.partition("mlp.experts.")
        if leaf.startswith("local_experts."):                           # SequentialMLP
            _, i, which, _ = leaf.split(".")
            return self._expert(prefix, int(i), which, canonical)
        if leaf in ("weight1", "weight2"):                               # GroupedMLP
            which = "linear_fc1" if leaf == "weight1" else "linear_fc2"
            per_expert = [self._expert(prefix, i, which, canonical).t() for i in range(self.local_experts)]
            stacked = torch.stack(per_expert)                            # [n, hidden, 2f] / [n, f, hidden]
            return stacked.reshape(self.arch.hidden, -1) if leaf == "weight1" else stacked.reshape(-1, self.arch.hidden)
        return None

    def local_expert_view(self, canonical: dict) -> dict:
        """``local_view`` of the routed-expert parameters only (``canonical`` needs only the
        ``...mlp.experts.local_experts.{e}.linear_fc{1,2}.weight`` tensors): how a model built
        elsewhere (e.g. through Megatron-Bridge) gets checkpoint experts into its storage."""
        out = {}
        for name, _ in self.model.named_parameters():
            local = self._local_expert(name, canonical)
            if local is not None:
                out[name] = local
        return out

    def local_view(self, canonical: dict) -> dict:
        """This rank's tensors (by local parameter name) of canonical full tensors --
        weights, or gradients of the 1-process model."""
        out = {}
        for name, _ in self.model.named_parameters():
            local = self._local_expert(name, canonical)
            if local is not None:
                out[name] = local
            else:
                full = canonical[name]
                if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
                    out[name] = _chunk(full, self.tp_size, self.tp_rank, 0)
                elif name.endswith("mlp.linear_fc1.weight"):
                    out[name] = _glu_chunk(full, self.tp_size, self.tp_rank)
                elif name.endswith(("linear_proj.weight", "mlp.linear_fc2.weight")):
                    out[name] = _chunk(full, self.tp_size, self.tp_rank, 1)
                else:                                                    # norms, router: replicated
                    out[name] = full
        return out

    def to_canonical(self, local: dict) -> dict:
        """Inverse of ``local_view`` for an unsharded model (tp = ep = etp = 1)."""
        assert self.tp_size == self.ep_size == self.etp_size == 1, "only an unsharded model"
        out = {}
        for name, t in local.items():
            prefix, _, leaf = name.partition("mlp.experts.")
            if leaf in ("weight1", "weight2"):
                which = "linear_fc1" if leaf == "weight1" else "linear_fc2"
                per = t.reshape(self.arch.experts, self.arch.hidden, -1) if leaf == "weight1" \
                    else t.reshape(self.arch.experts, -1, self.arch.hidden)
                for e in range(self.arch.experts):
                    out[f"{prefix}mlp.experts.local_experts.{e}.{which}.weight"] = per[e].t().contiguous()
            else:
                out[name] = t
        return out

    def load(self, canonical: dict) -> None:
        """Copy this rank's shards of canonical full weights into the model."""
        import torch
        local = self.local_view(canonical)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                assert p.shape == local[name].shape, (name, tuple(p.shape), tuple(local[name].shape))
                p.copy_(local[name])

    def grads(self) -> dict:
        """Local gradients by parameter name (after ``finalize_grads``)."""
        return {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}

    # -- data, forward, loss ---------------------------------------------------------------
    def tokens(self, batch: int, seed: int = 1):
        """A global batch ``[batch, seq_len]`` of token ids, the same on every rank."""
        import torch
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.arch.vocab, (batch, self.arch.seq_len), generator=g)

    def local_batch(self, tokens):
        """This data-parallel rank's rows of a global batch."""
        assert tokens.shape[0] % self.dp_size == 0, "batch must divide by the data-parallel size"
        return tokens.chunk(self.dp_size, dim=0)[self.dp_rank]

    def forward(self, tokens, labels=None):
        """``GPTModel.forward`` on ``tokens`` ``[b, s]`` (this rank's rows): logits
        ``[b, s, vocab / tp]`` (vocab-parallel), or the per-token loss ``[b, s]`` with labels."""
        import torch
        b, s = tokens.shape
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
        return self.model(input_ids=tokens, position_ids=position_ids, attention_mask=causal, labels=labels)

    def loss(self, tokens):
        """This rank's share of the mean next-token loss of the *global* batch ``tokens``
        (its data-parallel rows, normalized by the global token count): summed over the
        data-parallel ranks by ``finalize_grads`` the gradients are those of the global mean.

        Megatron's vocab-parallel cross entropy (what ``GPTModel`` computes with labels),
        which works in fp32: with ``dtype="float64"`` the logits are float64 but the loss
        and gradients carry fp32 rounding."""
        import torch
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        local = self.local_batch(tokens)
        labels = torch.roll(local, shifts=-1, dims=1)
        per_token = vocab_parallel_cross_entropy(self.forward(local), labels)
        return per_token.sum() / tokens.numel()

    def finalize_grads(self) -> None:
        """What Megatron's ``finalize_model_grads`` does for this configuration: sum dense
        gradients over the data(-and-context)-parallel group, expert gradients over the
        expert-data-parallel group, then over the tensor-parallel group the gradients of
        parameters marked ``sequence_parallel`` (norms and router, which saw only this
        rank's share of the sequence) and of the q/k norms (each tensor-parallel rank
        normalizes its own heads)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        dp = ps.get_data_parallel_group(with_context_parallel=True)
        edp = ps.get_expert_data_parallel_group()
        tp = ps.get_tensor_model_parallel_group()
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            group = dp if getattr(p, "allreduce", True) else edp
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
            if self.tp_size > 1 and (
                    (self.config.sequence_parallel and getattr(p, "sequence_parallel", False))
                    or "q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=tp)


# ---------------------------------------------------------------------------------------------
# building

def _config(arch: Arch, layout: Layout):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    wanted = dict(
        num_layers=arch.layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
        num_query_groups=arch.query_groups, kv_channels=arch.kv_channels, ffn_hidden_size=arch.ffn_hidden,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, sequence_parallel=_sequence_parallel(arch, layout),
        normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=arch.torch_dtype, use_cpu_initialization=True, perform_initialization=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, attention_softmax_in_fp32=False,
    )
    if arch.moe is not None:
        wanted.update(
            num_moe_experts=arch.experts, moe_router_topk=arch.topk, moe_ffn_hidden_size=arch.moe_ffn_hidden,
            moe_grouped_gemm=EXPERT_IMPLS[arch.moe], moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
            moe_permute_fusion=False, moe_router_fusion=False, moe_router_pre_softmax=False,
        )
        if arch.moe == "grouped" and _grouped_mlp_asserts_bf16():
            wanted["bf16"] = True   # flag only; see the module docstring
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    return TransformerConfig(**{k: v for k, v in wanted.items() if k in known})


def _sequence_parallel(arch: Arch, layout: Layout) -> bool:
    """Megatron requires sequence parallelism for MoE with tensor parallelism."""
    return arch.moe is not None and layout.tp > 1


def _grouped_mlp_asserts_bf16() -> bool:
    import inspect
    from megatron.core.transformer.moe.experts import GroupedMLP
    return "config.bf16" in inspect.getsource(GroupedMLP.forward)


def build(arch: Arch, layout: Layout):
    """A ``GPTModel`` for ``arch`` in the current ``parallel_state`` (call inside
    ``parallel_groups``); returns ``(model, config)``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    assert layout.pp == 1 and layout.cp == 1, "megatron_model builds pp = cp = 1 models (see the docstring)"
    config = _config(arch, layout)
    spec = get_gpt_layer_local_spec(
        num_experts=arch.experts if arch.moe else None, moe_grouped_gemm=EXPERT_IMPLS.get(arch.moe, False),
        qk_layernorm=True, normalization="RMSNorm")
    if config.sequence_parallel:
        spec = _with_sequence_parallel_norms(spec, arch.layers)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.vocab,
                     max_sequence_length=arch.seq_len, position_embedding_type="rope", rotary_base=1000000,
                     share_embeddings_and_output_weights=False, parallel_output=True)
    return model, config


def _with_sequence_parallel_norms(layer_spec, layers: int):
    """The block spec of ``layers`` copies of ``layer_spec`` with every norm replaced by the
    ``SequenceParallelTorchNorm`` test shim (see tests/support/megatron_shims.py)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    norm = megatron_shims.SequenceParallelTorchNorm
    attn = layer_spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, q_layernorm=norm, k_layernorm=norm))
    layer = dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        layer_spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attn))
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=norm)


@contextlib.contextmanager
def megatron_model(tp: int = 1, ep: int = 1, etp: int | None = None, moe: str | None = None, *,
                   pp: int = 1, cp: int = 1, seed: int = 0, **arch_fields) -> Iterator[Harness]:
    """Parallel groups for the layout, a real ``GPTModel`` loaded with the canonical weights
    of ``seed``, and a :class:`Harness` around it. ``arch_fields`` override :class:`Arch`
    (``layers``, ``hidden``, ``experts``, ``dtype``...)."""
    arch = Arch(moe=moe, **arch_fields)
    layout = Layout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp)
    with parallel_groups(layout):
        model, config = build(arch, layout)
        h = Harness(model, config, arch, layout)
        h.load(canonical_weights(arch, seed))
        model.train()
        yield h
