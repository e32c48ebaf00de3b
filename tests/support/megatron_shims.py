"""Test shims that let real Megatron-Core run on a CPU-only machine (test support only).

Megatron-Core assumes CUDA (and NCCL, Apex, TransformerEngine, grouped_gemm) in a few
places that have nothing to do with the math of the model. Each shim below replaces
exactly one such assumption with its CPU / gloo equivalent, is installed only in the child
processes of the Megatron harness (``tests/support/megatron.py``), and is listed here and
nowhere else:

1. ``cuda_device_api``         torch.cuda.current_device/current_stream/Stream/stream -> CPU
2. ``rng_tracker``             Megatron's RNG-state tracker on the CPU generator
3. ``te_general_gemm``         the name Megatron-Core >= 0.14's router reads, None without TE
4. ``grouped_gemm``            grouped_gemm.ops.gmm (CUDA extension) as per-expert matmuls
5. ``split_sizes_to_host``     alltoall dispatcher split sizes as numpy also on CPU
6. ``gloo_uneven_collectives`` uneven all_gather / reduce_scatter lists on gloo
7. ``SequenceParallelTorchNorm`` torch norm usable with sequence parallelism (spec-level,
                               used by the harness only when it enables sequence parallelism)
8. ``gloo_strided_scatter``    non-contiguous scatter inputs on gloo as contiguous copies

None of them changes numerics: they pick the device a buffer is allocated on, the stream
a host copy is ordered on, the generator a (zero-probability) dropout draws from, how a
collective moves the same bytes (8: the bytes the call's own contract names, where gloo
moves others), or they compute the very same products / normalization that the missing
CUDA kernel or module would compute. Each docstring says what it replaces
and why it cannot change a value. ``install()`` applies only the ones the running
Megatron-Core / torch need (3 is a no-op on 0.12.1) and ``applied()`` names them.

The shims a real ``DistributedOptimizer`` and ``dist_checkpointing`` additionally need (CUDA
device literals, ``torch.cuda.synchronize``, and three Megatron-Core 0.12.1 incompatibilities
with torch >= 2.9 / NumPy 2) are listed in ``megatron_checkpoint_shims.py``.

What is deliberately *not* a shim (set by the harness as configuration instead):
``use_cpu_initialization=True``; every fusion flag off (the fused kernels are CUDA or
Apex/TransformerEngine); an explicit causal ``attention_mask`` (Megatron's default one is
allocated on ``"cuda"``); ``torch._dynamo`` disabled so that Megatron's ``jit_fuser``
(``torch.compile``) runs eagerly.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

_installed: list[str] = []
_done: list[bool] = []


# --- 1. torch.cuda device and stream API -> torch.cpu's -------------------------------------

class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU, where every op is synchronous: waiting is a
    no-op and ``record_event`` returns an already-complete event (``torch.cpu.Stream`` has
    the same no-op methods but returns ``None`` from ``record_event``)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        import torch
        event = event or torch.cpu.Event()
        event.record()
        return event

    def synchronize(self) -> None:
        pass


def shim_cuda_device_api() -> bool:
    """Test shim: ``torch.cuda.current_device`` / ``current_stream`` / ``Stream`` / ``stream``
    answer with their CPU counterparts.

    Replaces: Megatron-Core allocating buffers with ``device=torch.cuda.current_device()``
    (tensor-parallel all-gather / reduce-scatter outputs, rotary ``inv_freq``, router
    weights, GroupedMLP) and the alltoall token dispatcher creating a side
    ``torch.cuda.Stream()`` for its device-to-host copies of the split sizes, synchronized
    through an event. Cannot change numerics: it only chooses where an empty buffer lives
    (the CPU, like every other tensor here) and orders host copies that are already
    synchronous on CPU; no value is computed differently."""
    import torch
    if torch.cuda.is_available():
        return False
    torch.cuda.current_device = torch.cpu.current_device   # returns "cpu", valid for device=
    torch.cuda.current_stream = lambda device=None: _CPU_DEFAULT_STREAM
    torch.cuda.Stream = _CpuStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    return True


_CPU_DEFAULT_STREAM = _CpuStream()


# --- 2. the RNG tracker forks the CPU generator ----------------------------------------------

def shim_rng_tracker() -> bool:
    """Test shim: Megatron's RNG-state tracker keeps named states of the CPU generator.

    Replaces: ``CudaRNGStatesTracker.add`` / ``fork`` (used by
    ``model_parallel_cuda_manual_seed`` and around every attention/embedding dropout)
    reading and writing ``torch.cuda`` RNG states, which do not exist without a GPU. The
    subclass is installed under the same module-level name, so Megatron's own
    ``initialize_rng_tracker`` / ``model_parallel_cuda_manual_seed`` create it. Cannot
    change numerics: the harness builds models with every dropout probability 0 and loads
    explicit weights, so no value is drawn inside a fork; the CPU default generator is
    restored on exit exactly as the CUDA one would be."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    if getattr(base, "_arp_cpu_tracker", False) or torch.cuda.is_available():
        return False

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        _arp_cpu_tracker = True

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    return True


# --- 3. te_general_gemm is None without TransformerEngine -----------------------------------

def shim_te_general_gemm() -> bool:
    """Test shim: ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` when
    TransformerEngine is absent.

    Replaces: Megatron-Core >= 0.14's router gating (``RouterGatingLinearFunction``) testing
    ``te_general_gemm is not None`` while the name is only bound when the TransformerEngine
    import succeeded (a ``NameError`` otherwise). Cannot change numerics: ``None`` selects
    the branch Megatron itself takes without TE and for float64 routers, a plain
    ``torch.mm`` in the router dtype."""
    from megatron.core.transformer.moe import moe_utils
    if "RouterGatingLinearFunction" in vars(moe_utils) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        return True
    return False


# --- 4. grouped GEMM as per-expert matmuls ---------------------------------------------------

def _gmm(a, b, batch_sizes, trans_b: bool = False):
    """``grouped_gemm.ops.gmm``: rows ``[s_e, s_e + batch_sizes[e])`` of ``a`` times
    ``b[e]`` (or ``b[e].T``), concatenated in expert order; differentiable by autograd."""
    import torch
    outs, start = [], 0
    for e, n in enumerate(batch_sizes.tolist()):
        w = b[e].t() if trans_b else b[e]
        outs.append(a[start:start + n] @ w)
        start += n
    if not outs:
        return a.new_zeros(0, b.shape[1] if trans_b else b.shape[2])
    return torch.cat(outs)


def shim_grouped_gemm() -> bool:
    """Test shim: the ``grouped_gemm`` package (``ops.gmm``) that the legacy ``GroupedMLP``
    calls, as a loop of per-expert matmuls.

    Replaces: ``grouped_gemm`` (fanshiqing/grouped_gemm), a CUDA-only CUTLASS extension;
    without it ``GroupedMLP`` refuses to build. Cannot change numerics: it computes the
    same products, ``tokens_of_expert_e @ W_e``, that the fused kernel computes, with
    autograd supplying the same gradients; only the kernel launch strategy differs."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg
    if gg.grouped_gemm is not None:
        return False
    ops = SimpleNamespace(gmm=_gmm)
    gg.grouped_gemm = SimpleNamespace(ops=ops, __name__="grouped_gemm (ascend-rl test shim)")
    gg.ops = ops
    return True


# --- 5. host copies of split sizes are numpy also when they already live on the host ---------

def shim_split_sizes_to_host() -> bool:
    """Test shim: ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` returns numpy for a CPU
    tensor too (in ``moe_utils`` and where the alltoall dispatcher imported it).

    Replaces: the alltoall token dispatcher's assumption that its split sizes are CUDA
    tensors: the helper converts them to numpy only on the way off the GPU, so on CPU
    they reach ``all_to_all_single`` as tensors, which its binding rejects (it takes a
    sequence of ints). Cannot change numerics: the same integers, as numpy, exactly what
    the helper returns for a CUDA tensor."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_arp_shim", False):
        return False

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        import torch
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(out):
            out = out.numpy()
        return out

    maybe_move_tensor_to_cpu._arp_shim = True
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    return True


# --- 6. uneven all-gather / reduce-scatter lists on gloo -------------------------------------

def _is_gloo(group) -> bool:
    import torch.distributed as dist
    return dist.get_backend(group) == "gloo"


def shim_gloo_uneven_collectives() -> bool:
    """Test shim: ``torch.distributed.all_gather`` and ``reduce_scatter`` with tensors of
    different first-dimension sizes, on gloo, by padding / by an all-reduce.

    Replaces: NCCL's support for uneven tensor lists, which the alltoall token dispatcher
    uses with expert tensor parallelism > 1 (``gather_from_sequence_parallel_region`` /
    ``reduce_scatter_to_sequence_parallel_region`` over the expert-TP group, with per-rank
    token counts); gloo requires equal sizes. Only uneven calls on a gloo group are redirected. Cannot change
    numerics: the gather pads every contribution to the largest size, gathers and copies
    each back without the padding (pure data movement); the reduce-scatter sums the
    concatenated inputs with ``all_reduce`` and keeps this rank's segment (the same sum of
    the same addends; with the two-rank groups of the harness, bit-identical)."""
    import torch
    import torch.distributed as dist
    if getattr(dist.all_gather, "_arp_shim", False):
        return False
    all_gather, reduce_scatter = dist.all_gather, dist.reduce_scatter

    def uneven_all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] for t in tensor_list]
        even = len(set(sizes)) == 1 and tensor.shape[0] == sizes[0]
        if async_op or even or not _is_gloo(group):
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        n = max(sizes)
        padded = tensor.new_zeros((n, *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        bufs = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(bufs, padded, group=group)
        for out, buf, size in zip(tensor_list, bufs, sizes):
            out.copy_(buf[:size])
        return None

    def uneven_reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        sizes = [t.shape[0] for t in input_list]
        if async_op or len(set(sizes)) == 1 or not _is_gloo(group):
            return reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        flat = torch.cat([t.contiguous() for t in input_list], dim=0)
        dist.all_reduce(flat, op=op, group=group)
        rank = dist.get_rank(group)
        start = sum(sizes[:rank])
        output.copy_(flat[start:start + sizes[rank]])
        return None

    uneven_all_gather._arp_shim = uneven_reduce_scatter._arp_shim = True
    dist.all_gather, dist.reduce_scatter = uneven_all_gather, uneven_reduce_scatter
    return True


# --- 7. a torch norm that takes part in sequence parallelism ---------------------------------

class SequenceParallelTorchNorm:
    """Test shim (a module the harness puts in the layer spec, only with sequence
    parallelism): ``torch.nn.RMSNorm`` / ``LayerNorm`` whose parameters carry Megatron's
    ``sequence_parallel`` attribute, like Apex's ``FusedLayerNorm`` and TE's norms set it.

    Replaces: the norm of the local spec. Megatron-Core uses Apex's ``FusedLayerNorm``
    (CUDA) when Apex is installed, else ``WrappedTorchNorm``, which refuses
    ``config.sequence_parallel`` -- and an MoE layer with tensor parallelism needs sequence
    parallelism (Megatron raises in training mode without it; in eval mode the experts'
    gradients count every token once per tensor-parallel rank). Cannot change numerics:
    the very torch module ``WrappedTorchNorm`` returns (parameters in
    ``config.params_dtype``), plus the attribute that makes the gradient finalization sum
    its weight gradients over the tensor-parallel ranks, each of which normalized its own
    share of the sequence."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        import torch
        norm_cls = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)
        if "sequence_parallel_torch_norm" not in _installed:
            _installed.append("sequence_parallel_torch_norm")
        return norm


# --- 8. scatter of non-contiguous tensors on gloo ------------------------------------------

def shim_gloo_strided_scatter() -> bool:
    """Test shim: ``torch.distributed.scatter`` on a gloo group hands gloo contiguous copies of
    any non-contiguous ``scatter_list`` entry.

    Replaces: nothing of Megatron's -- it works around torch's gloo backend, whose scatter
    reads each input from its data pointer for ``numel()`` elements and ignores its strides
    (pytorch/pytorch#24836, open since 2019; #192920 for scatter / broadcast / reduce;
    NCCL refuses such input with "Tensors must be contiguous"). Megatron-Bridge 0.3.1's
    ``RowParallelMapping.hf_to_megatron`` scatters ``torch.chunk(hf_weight, tp, dim=1)``
    (column blocks: non-contiguous views) after ``s.to(device=..., dtype=...)``: on a GPU that
    is a host-to-device copy, which is contiguous; on this CPU machine with a bf16 checkpoint
    and a bf16 model it is the view itself, and every row-parallel shard the bridge loads
    (attention ``linear_proj`` over TP, the experts' ``linear_fc2`` over ETP) is the full
    weight's storage read in order from the block's offset -- seen with verl 0.9.1's
    ``MegatronEngine`` at TP 2 (``tests/features/moe_reshard/verl09_mcore_engine_scenario.py``).
    Cannot change numerics: each rank receives exactly ``scatter_list[rank]``, what the call
    documents and what the device copy gives the bridge on a GPU; contiguous inputs and
    non-gloo groups go through untouched. ``tests/harness/test_megatron_harness.py`` pins
    gloo's behaviour: when torch fixes it, that test fails and this shim can go."""
    import torch.distributed as dist
    if getattr(dist.scatter, "_arp_shim", False):
        return False
    scatter = dist.scatter

    def contiguous_scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, **more):
        if scatter_list and _is_gloo(group) and not all(t.is_contiguous() for t in scatter_list):
            scatter_list = [t.contiguous() for t in scatter_list]
        return scatter(tensor, scatter_list, src=src, group=group, async_op=async_op, **more)

    contiguous_scatter._arp_shim = True
    dist.scatter = contiguous_scatter
    return True


SHIMS = {
    "cuda_device_api": shim_cuda_device_api,
    "rng_tracker": shim_rng_tracker,
    "te_general_gemm": shim_te_general_gemm,
    "grouped_gemm": shim_grouped_gemm,
    "split_sizes_to_host": shim_split_sizes_to_host,
    "gloo_uneven_collectives": shim_gloo_uneven_collectives,
    "gloo_strided_scatter": shim_gloo_strided_scatter,
}


def install() -> list[str]:
    """Install every shim that this Megatron-Core / torch needs (idempotent); returns the
    names of those applied in this process. ``SequenceParallelTorchNorm`` is not installed
    here: the harness puts it in the layer spec when it enables sequence parallelism."""
    if not _done:
        for name, shim in SHIMS.items():
            if shim():
                _installed.append(name)
        _done.append(True)
    return applied()


def applied() -> list[str]:
    """Names of the shims applied in this process (plus the spec-level norm shim once the
    harness used it)."""
    return list(_installed)
