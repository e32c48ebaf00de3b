"""Weight reload into a running W8A8 engine (worker side).

When vLLM has loaded a model and is about to run each layer's quant-method
post-processing (transpose, oneDNN prepack, NZ cast, scale flattening ...), we remember
every quantized module's *checkpoint-layout* parameter objects (they carry vLLM's
weight loaders). Afterwards ``model.load_weights`` of that model instance is wrapped:

* BF16 tensors with HF names are quantized online (:class:`~.profile.OnlineQuantizer`,
  same code as the offline checkpoint writer);
* the update is handed to vLLM's own ``load_weights`` in **one call**, as a stream: at
  the start of the call every quantized module shows its checkpoint-layout ``Parameter``
  objects (with empty storage), so vLLM's name -> parameter map (built once per call)
  points at them; a module's storage is allocated when its first tensor passes, filled
  by vLLM's loaders (sharding, fused q/k/v and gate/up offsets are vLLM's), and the module
  is post-processed by its own quant method as soon as its last shard has been consumed
  (the stream is resumed only after vLLM has loaded the previous tensor; a counter on
  the loaders checks it);
* the processed tensors are copied into the storage the engine already holds (same data
  pointer, same shape/stride/dtype, or a clear error), the original ``Parameter``
  objects are put back, and the temporary storage is released before the next module.

So the extra memory is about one module's worth, not a second model (FlashRL rebuilds
every parameter first), and whatever the quant method keeps outside parameters (oneDNN
handlers on CPU) is rebuilt by the method itself rather than by copying raw storage.
Unquantized modules (norms, embeddings, lm_head) are loaded in place and their quant
method's post-processing is re-run when it exists (on CPU it rebuilds oneDNN handlers).
Every post-processing runs under the default dtype the engine's own post-processing saw
(:attr:`ReloadState.default_dtype`; vLLM's CPU int8 kernel makes it the output type of a
static-activation oneDNN handler). Static activation calibration (``input_scale`` ...) is
not part of a weight update: the engine keeps the checkpoint's values.

An *update session* (:func:`update_session`; opened by the verl 0.9 hook) spans several
``load_weights`` calls -- verl 0.9 sends an update in buckets, and a fused layer can be
split between two of them -- and is finished by the next
``process_weights_after_loading`` of the model (which verl 0.9 calls once after the last
bucket) or when the session ends. Without a session every ``load_weights`` call is a
complete update.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from .config import BLOCK_FP8_FNS, INT4_FNS
from .profile import Int4OnlineQuantizer, OnlineQuantizer, Profile, ProfileError

log = logging.getLogger("ascend_rl_plugins.flashrl")

_STATE_ATTR = "_ascend_rl_flashrl_reload"
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)


class ReloadError(RuntimeError):
    """A weight update could not be applied exactly."""


@dataclass
class ParamSpec:
    param: torch.nn.Parameter  # the checkpoint-layout Parameter object (keeps its loader attributes)
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass
class ModuleRecord:
    name: str
    module: torch.nn.Module
    specs: dict[str, ParamSpec]
    rebuild: bool  # post-processing replaced/reshaped parameters: reload through fresh params
    quantized: bool  # a W8A8 (int8 or fp8) or W4A16 linear: its BF16 weights are quantized online
    shards: tuple[str, ...]  # HF leaf names that make up the module (q_proj, k_proj, v_proj ...)
    countable: bool = True  # every checkpoint-layout param has a weight_loader we count calls of
    loads: int = 0  # weight_loader calls into the checkpoint-layout params so far
    kind: str | None = None  # "w8a8" | "w4a16" (compressed-tensors pack-quantized) | None


@dataclass
class _Pending:
    record: ModuleRecord
    live: dict[str, Any]
    seen: set[str] = field(default_factory=set)
    saved: dict[str, torch.Tensor] = field(default_factory=dict)  # aliased live tensors, for abort
    attrs: dict[str, Any] = field(default_factory=dict)  # tensor attributes (not parameters) of the module
    filled: set[str] = field(default_factory=set)  # fresh params initialised from the engine's values
    written: set[str] = field(default_factory=set)  # fresh params the update wrote
    yielded: int = 0  # tensors of this module handed to vLLM's loader
    loads_at_open: int = 0


def _is_quantized_w8a8(module: torch.nn.Module) -> bool:
    w = module._parameters.get("weight")
    return w is not None and w.dtype in QUANTIZED_DTYPES and "weight_scale" in module._parameters


def _quant_kind(module: torch.nn.Module) -> str | None:
    """``"w8a8"`` (int8 / fp8 ``weight`` + ``weight_scale``), ``"w4a16"`` (compressed-tensors
    pack-quantized: int32 ``weight_packed`` + ``weight_scale``), ``"block_fp8"`` (vLLM's Fp8
    method with ``weight_block_size``: fp8 ``weight`` + float32 ``weight_scale_inv``) or None."""
    if _is_quantized_w8a8(module):
        return "w8a8"
    w = module._parameters.get("weight")
    if w is not None and w.dtype == torch.float8_e4m3fn and "weight_scale_inv" in module._parameters:
        return "block_fp8"
    w = module._parameters.get("weight_packed")
    if w is not None and w.dtype == torch.int32 and "weight_scale" in module._parameters:
        return "w4a16"
    return None


def _scheme_of(module: torch.nn.Module):
    """The compressed-tensors scheme of a linear (vLLM 0.23 keeps it on the layer, 0.13 on its
    quant method)."""
    scheme = getattr(module, "scheme", None)
    return scheme if scheme is not None else getattr(getattr(module, "quant_method", None), "scheme", None)


def wna16_direct_layout(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot take the direct W4A16 repack (None when it can).

    The direct path covers vLLM's ``CPUWNA16LinearKernel`` in its W4A16 mode (symmetric,
    no activation reordering, ``use_w4a8`` off): post-processed ``weight_packed`` int32
    ``[out/16, 2*in]`` and ``weight_scale`` ``[groups, out]``. Anything else (its W4A8 mode
    on AMX CPUs, other kernels) is re-processed by the kernel itself and copied back."""
    kernel = getattr(_scheme_of(module), "kernel", None)
    if type(kernel).__name__ != "CPUWNA16LinearKernel":
        return f"kernel {type(kernel).__name__} is not vLLM's CPUWNA16LinearKernel"
    if getattr(module, "use_w4a8", True):
        return "CPUWNA16 runs its W4A8 mode (VLLM_CPU_INT4_W4A8=1 on an AMX CPU)"
    cfg = kernel.config
    if cfg.zero_points or cfg.has_g_idx:
        return "asymmetric or activation-reordered W4A16"
    return None



def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and a.stride() == b.stride()
            and a.device == b.device)


# -- bounded, exact integer reductions inside quant-method post-processing -------------

SUM_SLICE_BYTES = 256 << 10


class BoundedIntSum(TorchFunctionMode):
    """``t.sum(dim, dtype=torch.float32)`` of an int8 matrix, without a float32 copy of it.

    vLLM's CPU int8 kernel computes ``azp_adj = weight.sum(dim=0, dtype=float32)`` while
    post-processing a layer; torch converts the *whole* int8 weight to float32 first (4x
    the int8 layer) and reduces a transposed view. Here, on CPU, when the reduced
    dimension is contiguous (vLLM's case: the transposed view of the ``[out, in]``
    weight), one numba pass sums each row in int32 (no temporary at all); otherwise the
    reduction runs over slices of the kept dimension, each converted separately (at most
    :data:`SUM_SLICE_BYTES` of float32 at a time). The result is bit-identical: every
    partial sum is an integer below 2**24 in magnitude (checked), exact in float32
    whatever the order of additions. Anything else passes through unchanged.
    """

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.sum or func is torch.sum:
            out = _sliced_int_sum(args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _sliced_int_sum(args, kwargs):
    if not args or not isinstance(args[0], torch.Tensor) or kwargs.get("out") is not None:
        return None
    x = args[0]
    if x.dtype not in (torch.int8, torch.uint8) or x.dim() != 2 or kwargs.get("dtype") is not torch.float32:
        return None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keepdim = bool(kwargs.get("keepdim", args[2] if len(args) > 2 else False))
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return None
        dim = dim[0]
    if not isinstance(dim, int):
        return None
    rd = dim % 2
    od = 1 - rd
    k = x.shape[rd]
    if k * 256 >= 2 ** 24 or x.numel() == 0:
        return None
    shape = list(x.shape)
    shape[rd] = 1
    if x.device.type == "cpu" and x.dtype == torch.int8 and x.stride(rd) == 1:
        from ...quant._cpu_kernels import int8_row_sums
        result = torch.empty(shape, dtype=torch.float32)
        int8_row_sums(x.detach() if rd == 1 else x.detach().t(), result.view(-1))
        return result if keepdim else result.squeeze(rd)
    if x.numel() * 4 <= SUM_SLICE_BYTES:
        return None
    rows = max(1, SUM_SLICE_BYTES // (4 * k))
    result = torch.empty(shape, dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[od], rows):
        n = min(rows, x.shape[od] - start)
        torch.sum(x.narrow(od, start, n), dim=rd, keepdim=True, dtype=torch.float32,
                  out=result.narrow(od, start, n))
    return result if keepdim else result.squeeze(rd)


def _release_kernel_state(module: torch.nn.Module) -> None:
    """Drop what the previous post-processing attached and the next one rebuilds (CPU: the
    oneDNN handler of an int8 kernel, the ``cpu_linear`` closure holding the prepacked
    weight of an unquantized layer), so the old and the new prepacked weights never
    coexist. No reference is kept: if the quant method's post-processing then fails, the
    layer cannot be restored (the error says so)."""
    kernel = getattr(getattr(getattr(module, "quant_method", None), "scheme", None), "kernel", None)
    if kernel is not None and getattr(kernel, "dnnl_handler", None) is not None:
        kernel.dnnl_handler = None
    if "cpu_linear" in vars(module) and vars(module)["cpu_linear"] is not torch.nn.functional.linear:
        module.cpu_linear = torch.nn.functional.linear


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None):
    """``torch.set_default_dtype(dtype)`` inside the block (restored even on error)."""
    if dtype is None or dtype == torch.get_default_dtype():
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _postprocess(module: torch.nn.Module, quant_method, target_device, layer: str,
                 timing: dict | None = None, key: str = "postprocess_s",
                 dtype: torch.dtype | None = None) -> None:
    """The quant method's own post-processing of ``module``, with its previous kernel state
    released first and int8 reductions bounded (:class:`BoundedIntSum`), under the default
    dtype the engine's own post-processing ran with (``dtype``; see
    :attr:`ReloadState.default_dtype`)."""
    from vllm.model_executor.model_loader.utils import device_loading_context
    t0 = time.perf_counter()
    _release_kernel_state(module)
    try:
        # (the label lets the benchmark tell the quant method's own transients from the reload's)
        with torch.profiler.record_function("flashrl.quant_method_postprocess"), default_dtype(dtype), \
                device_loading_context(module, target_device), BoundedIntSum():
            quant_method.process_weights_after_loading(module)
    except Exception as exc:
        raise ReloadError(f"flashrl reload: the quant method's post-processing of {layer} failed "
                          f"({type(exc).__name__}: {exc}); its previous kernel state was already released, "
                          f"so this layer is unusable until a complete reload succeeds") from exc
    finally:
        if timing is not None:
            timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0


def _counting(loader: Callable, rec: ModuleRecord) -> Callable:
    def weight_loader(*args, **kwargs):
        rec.loads += 1
        return loader(*args, **kwargs)
    weight_loader.__wrapped__ = loader
    weight_loader._ascend_rl_counts = rec.name
    return weight_loader


def _count_loads(rec: ModuleRecord) -> bool:
    """Make every checkpoint-layout parameter of ``rec`` count its loader calls (again, if
    someone replaced the loader since -- verl 0.9 re-assigns MoE expert loaders before each
    update). False when a parameter has no loader of its own (vLLM then uses its default
    loader, which cannot be counted)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    for spec in rec.specs.values():
        loader = getattr(spec.param, "weight_loader", None)
        if loader is None or loader is default_weight_loader:
            return False
        if getattr(loader, "_ascend_rl_counts", None) != rec.name:
            spec.param.weight_loader = _counting(loader, rec)
    return True


class ReloadState:
    """Everything the reload needs about one model instance."""

    def __init__(self, model: torch.nn.Module, model_config: Any, target_device: Any,
                 profile: Profile | None, fn: str):
        self.model = model
        self.model_config = model_config
        self.target_device = target_device
        self.profile = profile
        self.fn = fn
        self.records: dict[str, ModuleRecord] = {}
        # The default dtype in effect while the engine post-processed the model: vLLM's loader
        # runs process_weights_after_loading under set_default_torch_dtype(model_config.dtype),
        # and quant methods read it. vLLM's CPU int8 kernel (CPUInt8ScaledMMLinearKernel.
        # process_weights_for_onednn) passes torch.get_default_dtype() as the oneDNN handler's
        # output type, which for *static* activations is the dtype the matmul writes straight
        # into the layer's output buffer (allocated in the activation dtype): a reload
        # post-processing under torch's float32 default built handlers that wrote float32 rows
        # into bfloat16 buffers -- twice their size, a heap overflow. Every reload
        # post-processing therefore runs under this dtype (this object is made inside the
        # engine's own post-processing, see hooks.process_weights_after_loading).
        self.default_dtype = torch.get_default_dtype()
        self.reloads = 0
        self.last_quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.keep_quantized = False  # tests: keep what the last reload quantized, for checks
        self.rebuild_all = False  # benchmark baseline: rebuild every layer before processing any
        self.update: _Update | None = None  # the open update session
        self.last_stats: dict[str, Any] = {}
        self.int4_spec = None  # W4A16: the served checkpoint's Int4Spec (set by the engine-start hook)
        packed = dict(getattr(type(model), "packed_modules_mapping", {}) or {})
        self.shard_to_fused = {s: fused for fused, shards in packed.items() for s in shards}
        self.packed = packed
        self._names: dict[str, tuple[ModuleRecord | None, str]] = {}
        # seconds spent by the last update in the quant methods' post-processing and in the
        # online quantizer (the benchmark's breakdown; a few perf_counter calls per layer)
        self.timing: dict[str, float] = {}

    # -- before/after the engine's own post-processing ---------------------------------
    def record_before(self) -> dict[str, tuple[dict, dict]]:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        before = {}
        for name, module in self.model.named_modules():
            if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase) \
                    and (module._parameters.get("weight") is not None
                         or module._parameters.get("weight_packed") is not None):  # (KV-scale methods: no)
                params = {n: p for n, p in module._parameters.items() if p is not None}
                layout = {n: (tuple(p.shape), p.stride(), p.dtype, p.data_ptr()) for n, p in params.items()}
                before[name] = (params, layout, _quant_kind(module))
        return before

    def record_after(self, before: dict) -> None:
        for name, (params, layout, kind) in before.items():
            module = self.model.get_submodule(name)
            now = module._parameters
            kept = all(now.get(n) is p and (tuple(p.shape), p.stride(), p.dtype, p.data_ptr()) == layout[n]
                       for n, p in params.items()) and set(k for k, v in now.items() if v is not None) == set(params)
            specs = {n: ParamSpec(p, layout[n][0], layout[n][2], p.device) for n, p in params.items()}
            leaf = name.rsplit(".", 1)[-1]
            shards = tuple(self.packed.get(leaf, [leaf]))
            rec = ModuleRecord(name, module, specs, rebuild=not kept, quantized=kind is not None, shards=shards,
                               kind=kind)
            self.records[name] = rec
            if not kept:
                in_use = {id(v) for v in now.values() if v is not None}
                for n, spec in specs.items():
                    if id(spec.param) not in in_use:  # no longer used by the engine: drop its storage
                        spec.param.data = torch.empty(0, dtype=spec.dtype, device=spec.device)

    # -- name mapping ------------------------------------------------------------------
    def module_of(self, hf_name: str) -> tuple[ModuleRecord | None, str]:
        """(record, shard leaf) for an HF tensor name, e.g. ``...q_proj.weight`` ->
        (record of ``...qkv_proj``, ``q_proj``)."""
        hit = self._names.get(hf_name)
        if hit is not None:
            return hit
        base, _, _ = hf_name.rpartition(".")
        parent, _, leaf = base.rpartition(".")
        fused = self.shard_to_fused.get(leaf)
        hit = None
        if fused is not None:
            rec = self.records.get(f"{parent}.{fused}" if parent else fused)
            if rec is not None:
                hit = (rec, leaf)
        if hit is None:
            hit = (self.records.get(base), leaf)
        if len(self._names) < 1 << 20:
            self._names[hf_name] = hit
        return hit

    def check_profile(self) -> None:
        """Fail at engine start when the profile does not describe this model."""
        if self.profile is None:
            return
        for lin in self.profile.linears:
            rec, _ = self.module_of(lin)
            if rec is None or not rec.quantized:
                raise ProfileError(f"FlashRL profile names {lin}, which is not a quantized W8A8 linear of the "
                                   f"model being served ({type(self.model).__name__}); was the profile made from "
                                   f"this checkpoint?")
            shape = self.profile.shapes.get(lin)
            k = rec.specs["weight"].shape[1]
            if shape is not None and shape[1] != k:
                raise ProfileError(f"FlashRL profile does not fit the model: {lin} has {shape[1]} input "
                                   f"channels in the profile, {k} in the engine")
            v = self.profile.col_smooth.get(lin)
            if v is not None and v.numel() != k:
                raise ProfileError(f"FlashRL profile smoothing for {lin} has {v.numel()} entries, the "
                                   f"engine's layer has {k} input channels")

    def quantizer(self) -> OnlineQuantizer | Int4OnlineQuantizer:
        def is_quantized(name, shape):
            return len(shape) == 2 and name.endswith(".weight") and (self.module_of(name)[0] or _NO).quantized
        if self.fn in BLOCK_FP8_FNS:
            return BlockFp8DirectWriter(self)
        if self.fn in INT4_FNS:
            if self.int4_spec is None:
                raise ReloadError("flashrl reload: W4A16 reload without an Int4Spec (engine start did not record "
                                  "the served group size)")
            q = Int4OnlineQuantizer(self.int4_spec, is_quantized)
        else:
            q = OnlineQuantizer(self.profile, fn=self.fn, is_quantized=is_quantized)
        plain, timing = q.quantize_linear, self.timing

        def quantize_linear(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return plain(*args, **kwargs)
            finally:
                timing["quantize_s"] = timing.get("quantize_s", 0.0) + time.perf_counter() - t0
        q.quantize_linear = quantize_linear
        return q

    # -- the reload ----------------------------------------------------------------------
    def begin_update(self) -> "_Update":
        if self.update is not None:
            raise ReloadError("flashrl reload: an update session is already open for this model")
        self.update = _Update(self, explicit=True)
        return self.update

    def finish_update(self) -> None:
        """Finish the open session (no-op without one): complete fused layers, re-process
        the unquantized layers that were loaded, raise if a fused layer is incomplete."""
        upd = self.update
        if upd is None:
            return
        try:
            upd.finish()
        except BaseException:
            upd.abort()
            raise
        finally:
            self.update = None

    def abort_update(self) -> None:
        upd, self.update = self.update, None
        if upd is not None:
            upd.abort()

    def load_weights(self, original, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        upd = self.update
        implicit = upd is None
        if implicit:
            upd = _Update(self, explicit=False)
        try:
            loaded = upd.call(original, weights)
            if implicit:
                upd.finish()
        except BaseException:
            upd.abort()
            if not implicit:
                self.update = None
            raise
        return loaded

    def _reprocess_inplace(self, rec: ModuleRecord) -> None:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        qm = getattr(rec.module, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and not rec.quantized:
            _postprocess(rec.module, qm, self.target_device, rec.name, self.timing, "postprocess_unquantized_s",
                         self.default_dtype)


class _Update:
    """One weight update (one ``load_weights`` call, or a session of several)."""

    def __init__(self, state: ReloadState, explicit: bool):
        state.timing.clear()
        self.state = state
        self.explicit = explicit
        self.quantizer = state.quantizer()
        self.pending: dict[str, _Pending] = {}
        self.swapped: dict[str, tuple[dict[str, tuple], list[str]]] = {}
        self.dirty_inplace: dict[str, ModuleRecord] = {}
        self.quantized_log: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._q_weight: dict[str, torch.Tensor] = {}
        self.original = None
        self.loaded: set[str] = set()
        self.closed = 0
        self.calls = 0
        self.spanned: set[str] = set()  # fused layers left incomplete at the end of a call (sessions)
        self.skipped_calibration = 0  # input_scale ... tensors of the update not loaded (kept from the engine)

    # -- parameter objects vLLM's loader sees ---------------------------------------------
    def _swap_in(self) -> None:
        """Every rebuilt module shows its checkpoint-layout Parameter objects (empty until
        the module's first tensor arrives), so the name -> parameter map vLLM builds at the
        start of ``load_weights`` points at them."""
        for rec in self.state.records.values():
            if not rec.rebuild or rec.name in self.swapped or rec.name in self.pending or rec.kind == "block_fp8":
                continue  # (block FP8: written straight into the engine's storage, see BlockFp8DirectWriter)
            rec.countable = _count_loads(rec)
            params = rec.module._parameters
            live = {n: (v, None if v is None else v.data) for n, v in params.items()}
            absent = [n for n in rec.specs if n not in params]
            for n, spec in rec.specs.items():
                params[n] = spec.param
            self.swapped[rec.name] = (live, absent)

    def _swap_out(self, rec: ModuleRecord) -> None:
        live, absent = self.swapped.pop(rec.name)
        params = rec.module._parameters
        for n, (obj, data) in live.items():
            if obj is not None and data is not None and obj.data is not data:
                obj.data = data
            params[n] = obj
        for n in absent:
            params.pop(n, None)

    # -- one call of vLLM's load_weights --------------------------------------------------
    def call(self, original, weights) -> set[str]:
        self.original = original
        self.calls += 1
        self._swap_in()
        loaded = set(original(self._stream(weights)) or ())
        self.loaded |= loaded
        # the consumer may not ask for more after the last tensor: close what is complete
        for name in [n for n, p in self.pending.items() if p.seen >= set(p.record.shards)
                     and not self.state.rebuild_all]:
            self._close(self.pending.pop(name))
        if not self.explicit:
            return loaded
        self.spanned |= set(self.pending)
        for name in [n for n in self.swapped if n not in self.pending]:
            self._swap_out(self.state.records[name])
        return loaded

    def _quantized(self, weights) -> Iterator[tuple[str, torch.Tensor]]:
        if self.explicit:  # the session may continue: norms held for pruning wait for finish()
            for name, tensor in weights:
                yield from self.quantizer.push(name, tensor)
        else:
            yield from self.quantizer.transform(weights)

    def _stream(self, weights) -> Iterator[tuple[str, torch.Tensor]]:
        state = self.state
        keep = state.keep_quantized
        for name, tensor in self._quantized(weights):
            rec, leaf = state.module_of(name)
            if rec is not None and rec.quantized and name.rpartition(".")[2] in _CALIBRATION:
                # Static activation calibration (input_scale ...) is not part of a weight update:
                # the engine keeps the values it loaded from the checkpoint (see _open). The
                # online quantizer emits them for a static profile (the offline writer needs
                # them); they are not handed to vLLM.
                self.skipped_calibration += 1
                continue
            if rec is None or not rec.rebuild:
                if rec is not None and hasattr(rec.module, "quant_method"):
                    self.dirty_inplace[rec.name] = rec
                yield name, tensor
                continue
            p = self.pending.get(rec.name)
            if p is None:
                p = self.pending[rec.name] = self._open(rec)
            if keep:
                if name.endswith(".weight") and tensor.dtype in QUANTIZED_DTYPES:
                    self._q_weight[name] = tensor
                elif name.endswith(".weight_packed") and tensor.dtype == torch.int32:
                    self._q_weight[name[: -len("_packed")]] = tensor
                elif name.endswith(".weight_scale") and name[:-6] in self._q_weight:
                    self.quantized_log[name[:-6]] = (self._q_weight.pop(name[:-6]), tensor)
            p.yielded += 1
            yield name, tensor
            # resumed: vLLM has loaded that tensor
            del tensor
            p.written.add(name.rpartition(".")[2])
            if name.endswith(".weight_scale") or (not rec.quantized and name.endswith(".weight")):
                p.seen.add(leaf)
                if p.seen >= set(rec.shards) and not state.rebuild_all:
                    self._close(self.pending.pop(rec.name))

    def finish(self) -> None:
        state = self.state
        if self.explicit:
            held = list(self.quantizer.flush())
            if held:
                if self.original is None:
                    raise ReloadError("flashrl reload: norms held for pruning but no load_weights call")
                self.call(self.original, held)
        check = getattr(self.quantizer, "check_complete", None)
        if check is not None:
            check()
        if state.rebuild_all:  # FlashRL's memory profile (benchmark baseline): everything at once
            for name in [n for n, p in self.pending.items() if p.seen >= set(p.record.shards)]:
                self._close(self.pending.pop(name))
        if self.pending:
            missing = {n: sorted(set(p.record.shards) - p.seen) for n, p in self.pending.items()}
            raise ReloadError(f"flashrl reload: the update ended with fused layers only partly sent "
                              f"(missing shards: {missing}); every shard of a fused layer must be sent "
                              f"in the same update")
        for name in list(self.swapped):
            self._swap_out(state.records[name])
        for rec in self.dirty_inplace.values():
            state._reprocess_inplace(rec)
        state.reloads += 1
        state.last_stats = {"closed": self.closed, "inplace": len(self.dirty_inplace), "calls": self.calls,
                            "session": self.explicit, "spanned": sorted(self.spanned),
                            "kept_calibration": self.skipped_calibration}
        if state.keep_quantized:
            state.last_quantized = self.quantized_log

    def abort(self) -> None:
        for p in list(self.pending.values()):
            self._abort(p)
        self.pending.clear()
        for name in list(self.swapped):
            self._swap_out(self.state.records[name])

    # -- one module ----------------------------------------------------------------------
    def _open(self, rec: ModuleRecord) -> _Pending:
        """Give ``rec.module``'s checkpoint-layout parameters storage for loading.

        ``live`` maps a name to the engine's (object, data) -- data is kept separately
        because some quant methods (vLLM-Ascend) post-process by assigning ``param.data``
        on the very object they loaded into.
        """
        module = rec.module
        live = self.swapped[rec.name][0] if rec.name in self.swapped else \
            {n: (v, None if v is None else v.data) for n, v in module._parameters.items()}
        attrs = {n: v for n, v in vars(module).items() if isinstance(v, torch.Tensor)
                 and not isinstance(v, torch.nn.Parameter)}
        saved: dict[str, torch.Tensor] = {}
        filled: set[str] = set()
        for n, spec in rec.specs.items():
            cur = live.get(n, (None, None))[1]
            if n in _CALIBRATION:
                # static activation calibration is not part of a weight update: keep the engine's
                # value (the checkpoint's, as post-processed at engine start: for CPU int8 the max
                # over the fused shards, a 0-dim tensor; post-processing it again is the identity)
                if cur is None:
                    raise ReloadError(f"flashrl reload: {rec.name}.{n} has no live value to keep")
                fresh = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
                fresh.copy_(cur.reshape(-1)[0].expand(spec.shape) if cur.numel() == 1 else cur.reshape(spec.shape))
                filled.add(n)
            elif cur is not None and tuple(cur.shape) == spec.shape and cur.dtype == spec.dtype \
                    and cur.is_contiguous() and not (rec.kind == "w4a16" and n in _W4A16_REPACKED):
                # Same layout before and after post-processing (e.g. a channel weight_scale):
                # load straight into the engine's storage, so whatever the quant method builds
                # from it (the CPU oneDNN handler keeps a raw pointer to the scales) points at
                # storage that stays. A copy restores it if the update is aborted.
                saved[n] = cur.clone()
                fresh = cur
                filled.add(n)
            else:
                fresh = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
                if n != "weight" and cur is not None and cur.numel() == fresh.numel() and cur.dtype == fresh.dtype:
                    fresh.copy_(cur.reshape(spec.shape))  # e.g. a flattened weight_offset: keep its value
                    filled.add(n)
            spec.param.data = fresh
            module._parameters[n] = spec.param
        return _Pending(rec, live, saved=saved, attrs=attrs, filled=filled, loads_at_open=rec.loads)

    def _close(self, p: _Pending) -> None:
        rec, module = p.record, p.record.module
        if rec.kind == "w4a16" and wna16_direct_layout(module) is None:
            return self._close_w4a16(p)
        try:
            missing = sorted(set(rec.specs) - p.filled - p.written)
            if missing:
                raise ReloadError(f"flashrl reload: {rec.name}: the update did not provide {missing} and their "
                                  f"values cannot be recovered from the processed layer")
            if rec.countable and rec.loads - p.loads_at_open < p.yielded:
                raise ReloadError(f"flashrl reload: {rec.name}: {p.yielded} tensors were handed to the model's "
                                  f"load_weights but its loaders ran {rec.loads - p.loads_at_open} times before the "
                                  f"layer was complete; the reload needs a load_weights that consumes the update "
                                  f"tensor by tensor")
            _postprocess(module, module.quant_method, self.state.target_device, rec.name, self.state.timing,
                         "postprocess_quantized_s" if rec.quantized else "postprocess_unquantized_s",
                         self.state.default_dtype)
        except BaseException:
            self._abort(p)  # the engine's parameter objects and values back (kernel state: see _postprocess)
            raise
        new = {n: (None if v is None else v.data) for n, v in module._parameters.items()}
        new_attrs = {n: v for n, v in vars(module).items() if isinstance(v, torch.Tensor)
                     and not isinstance(v, torch.nn.Parameter)}
        try:
            for n in set(new) | set(p.live):
                old, fresh = p.live.get(n, (None, None))[1], new.get(n)
                _transplant(rec.name, n, old, fresh)
            for n in set(new_attrs) & set(p.attrs):
                _transplant(rec.name, n, p.attrs[n], new_attrs[n])
                setattr(module, n, p.attrs[n])
        finally:
            for n, (obj, data) in p.live.items():
                if obj is not None and data is not None:
                    obj.data = data  # the engine's storage, now holding the new values
                module._parameters[n] = obj
            for n, spec in rec.specs.items():
                if all(spec.param is not obj for obj, _ in p.live.values()):
                    spec.param.data = torch.empty(0, dtype=spec.dtype, device=spec.device)
                    if n not in p.live:
                        module._parameters.pop(n, None)
            self.swapped.pop(rec.name, None)
        self.closed += 1

    def _close_w4a16(self, p: _Pending) -> None:
        """W4A16 on vLLM's CPUWNA16 kernel: the staged checkpoint-layout tensors (filled by vLLM's
        loaders) are written straight into the engine's post-processed storage -- the blocked
        nibble layout the kernel builds (:func:`ascend_rl_plugins.quant._cpu_kernels.wna16_blocked_cpu`, bit moves only)
        and the transposed scales -- without running the kernel's post-processing, whose
        unpacked int32 copy of the layer is 2x the BF16 tensor (and ~20x its copy time)."""
        rec, module = p.record, p.record.module
        t0 = time.perf_counter()
        try:
            missing = sorted(set(rec.specs) - p.filled - p.written)
            if missing:
                raise ReloadError(f"flashrl reload: {rec.name}: the update did not provide {missing}")
            if rec.countable and rec.loads - p.loads_at_open < p.yielded:
                raise ReloadError(f"flashrl reload: {rec.name}: {p.yielded} tensors were handed to the model's "
                                  f"load_weights but its loaders ran {rec.loads - p.loads_at_open} times")
            staged_w = rec.specs["weight_packed"].param.data
            staged_s = rec.specs["weight_scale"].param.data
            live_w = p.live["weight_packed"][1]
            live_s = p.live["weight_scale"][1]
            out, words = staged_w.shape
            want_w = (out // 16, 2 * words * 8)
            if (tuple(live_w.shape) != want_w or live_w.dtype != torch.int32 or not live_w.is_contiguous()
                    or out % 16 or tuple(live_s.shape) != tuple(staged_s.shape[::-1])
                    or live_s.dtype != staged_s.dtype):
                raise ReloadError(f"flashrl reload: {rec.name}: the engine's W4A16 tensors "
                                  f"({_desc(live_w)}, {_desc(live_s)}) are not CPUWNA16's layout of "
                                  f"({_desc(staged_w)}, {_desc(staged_s)})")
            if not staged_w.is_contiguous():
                staged_w = staged_w.contiguous()
            from ...quant._cpu_kernels import wna16_blocked_cpu
            wna16_blocked_cpu(staged_w, live_w)
            live_s.copy_(staged_s.t())
        except BaseException:
            self._abort(p)
            raise
        finally:
            t = self.state.timing
            t["postprocess_quantized_s"] = t.get("postprocess_quantized_s", 0.0) + time.perf_counter() - t0
        for n, (obj, data) in p.live.items():
            if obj is not None and data is not None:
                obj.data = data
            module._parameters[n] = obj
        for n, spec in rec.specs.items():
            if all(spec.param is not obj for obj, _ in p.live.values()):
                spec.param.data = torch.empty(0, dtype=spec.dtype, device=spec.device)
                if n not in p.live:
                    module._parameters.pop(n, None)
        self.swapped.pop(rec.name, None)
        self.closed += 1

    def _abort(self, p: _Pending) -> None:
        module = p.record.module
        for n, copy in p.saved.items():
            p.live[n][1].copy_(copy)
        for n, (obj, data) in p.live.items():
            if obj is not None and data is not None:
                obj.data = data
            module._parameters[n] = obj
        for n, spec in p.record.specs.items():
            if all(spec.param is not obj for obj, _ in p.live.values()):
                spec.param.data = torch.empty(0, dtype=spec.dtype, device=spec.device)
                if n not in p.live:
                    module._parameters.pop(n, None)
        self.swapped.pop(p.record.name, None)


class _No:
    quantized = False


_NO = _No()


_CALIBRATION = ("input_scale", "input_zero_point", "input_offset")
_W4A16_REPACKED = ("weight_packed", "weight_scale")  # post-processed into another layout


def _transplant(layer: str, name: str, old, fresh) -> None:
    """Copy a freshly processed tensor into the engine's tensor (same storage)."""
    if old is None and fresh is None:
        return
    if old is None or fresh is None or not _same_layout(old, fresh):
        raise ReloadError(f"flashrl reload: {layer}.{name} changed layout on reprocessing "
                          f"({_desc(old)} -> {_desc(fresh)}); the engine's storage cannot be reused")
    if old.data_ptr() != fresh.data_ptr():
        old.copy_(fresh)


def _desc(t) -> str:
    if t is None:
        return "None"
    return f"{t.dtype} {tuple(t.shape)} stride {t.stride()}"


def install(model: torch.nn.Module, state: ReloadState) -> None:
    """Wrap this model instance's ``load_weights`` (verl and tests call it)."""
    original = model.load_weights
    setattr(model, _STATE_ATTR, state)

    def load_weights(self, weights):
        return state.load_weights(original, weights)

    load_weights.__wrapped__ = original
    model.load_weights = types.MethodType(load_weights, model)


def state_of(model: torch.nn.Module) -> ReloadState | None:
    return getattr(model, _STATE_ATTR, None)


@contextlib.contextmanager
def update_session(*models: torch.nn.Module):
    """Treat every ``load_weights`` call on ``models`` inside the block as one update.

    Fused layers may be split across calls; the update is finished by the models'
    ``process_weights_after_loading`` (vLLM's function, patched by this feature) or when
    the block ends; an exception aborts it (the engine keeps its previous weights for the
    layers not yet completed). Models without flashrl reload state are ignored.
    """
    states = [s for s in (state_of(m) for m in models) if s is not None]
    for s in states:
        s.begin_update()
    try:
        yield states
    except BaseException:
        for s in states:
            s.abort_update()
        raise
    else:
        errors = []
        for s in states:
            try:
                s.finish_update()
            except BaseException as exc:  # noqa: BLE001  (finish every model, then raise)
                errors.append(exc)
        if errors:
            raise errors[0]


# -- block FP8 (128x128) on vLLM 0.23's CPU kernel: direct in-place writes ------------------

BLOCK_FP8_STRIP_BYTES = 1 << 20  # fp8 bytes quantized and VNNI-packed at a time (then copied into place)


def block_fp8_direct_layout(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot take the direct block-FP8 write (None when it can).

    The direct path covers vLLM 0.23's ``Fp8LinearMethod`` with ``weight_block_size [128, 128]``
    served by ``CPUFp8BlockScaledMMKernel``: its post-processing replaces ``weight`` by
    ``_C.convert_weight_packed(weight)`` (VNNI prepack for AMX: same shape and dtype, bytes
    moved within each group of 32 output rows) and re-wraps ``weight_scale_inv`` unchanged."""
    kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
    if type(kernel).__name__ != "CPUFp8BlockScaledMMKernel":
        return f"kernel {type(kernel).__name__} is not vLLM's CPUFp8BlockScaledMMKernel"
    block = tuple(int(b) for b in (getattr(module, "weight_block_size", None) or ()))
    if block != (128, 128):
        return f"weight_block_size {list(block)} is not [128, 128]"
    w, s = module._parameters.get("weight"), module._parameters.get("weight_scale_inv")
    if w is None or s is None or w.dim() != 2 or not w.is_contiguous() or w.dtype != torch.float8_e4m3fn:
        return f"weight is {_desc(w)}, not a contiguous float8_e4m3fn matrix"
    n, k = w.shape
    if s.dtype != torch.float32 or tuple(s.shape) != (-(-n // 128), -(-k // 128)) or not s.is_contiguous():
        return f"weight_scale_inv is {_desc(s)}, not float32 {(-(-n // 128), -(-k // 128))}"
    widths = list(getattr(module, "logical_widths", None) or [n])
    if sum(widths) != n or any(x % 128 for x in widths[:-1]) or n % 32:
        return (f"output shards {widths} (total {n}) do not start on 128-row blocks or the total is not a "
                f"multiple of 32")
    if int(getattr(module, "input_size_per_partition", k)) != k:
        return f"input_size_per_partition {getattr(module, 'input_size_per_partition', None)} != {k}"
    return None


class BlockFp8DirectWriter:
    """The reload's "quantizer" for ``fn: fp8_block``: each BF16 linear weight of a block-FP8
    layer is quantized with :func:`ascend_rl_plugins.quant.block_fp8.quantize` (the offline converter's function) a
    strip of 128-row blocks at a time, VNNI-packed with vLLM's own ``_C.convert_weight_packed``
    (a strip of whole 32-row groups packs independently of the rest) and copied straight into
    the engine's post-processed ``weight`` at the shard's row offset; its block scales go into
    ``weight_scale_inv``. Nothing of these layers is handed to vLLM's ``load_weights`` and no
    data pointer changes; the extra memory is one strip (:data:`BLOCK_FP8_STRIP_BYTES`).
    Everything else (norms, embeddings, lm_head) passes through to vLLM's loader.

    Tensor parallelism: a shard must arrive whole (``[logical width, in]``), i.e. TP=1."""

    def __init__(self, state: ReloadState):
        self.state = state
        self.seen: dict[str, set[str]] = {}

    def quantize_linear(self, name, weight, out=None, scale_out=None):  # (timing wrapper target)
        from ...quant import block_fp8
        return block_fp8.quantize(weight, block_fp8.BLOCK, out_weight=out, out_scale_inv=scale_out, name=name)

    def transform(self, weights):
        for name, tensor in weights:
            yield from self.push(name, tensor)

    def push(self, name: str, tensor: torch.Tensor):
        rec, leaf = self.state.module_of(name)
        if rec is None or rec.kind != "block_fp8":
            yield name, tensor
            return
        if not name.endswith(".weight") or tensor.dim() != 2 or not tensor.is_floating_point() \
                or tensor.dtype == torch.float8_e4m3fn:
            raise ReloadError(f"flashrl reload: {name} ({_desc(tensor)}) -- the block-FP8 reload takes the BF16 "
                              f"(or float32) linear weights of {rec.name} only, quantized online")
        self._write(rec, leaf, tensor)
        self.seen.setdefault(rec.name, set()).add(leaf)

    def flush(self):
        return iter(())

    def _write(self, rec: ModuleRecord, leaf: str, tensor: torch.Tensor) -> None:
        module = rec.module
        w, s = module._parameters["weight"], module._parameters["weight_scale_inv"]
        n_all, k = w.shape
        widths = list(getattr(module, "logical_widths", None) or [n_all])
        if leaf not in rec.shards or len(widths) != len(rec.shards):
            raise ReloadError(f"flashrl reload: {rec.name}: shard {leaf!r} does not map onto the layer's "
                              f"output shards {list(rec.shards)} / widths {widths}")
        i = rec.shards.index(leaf)
        off, n = sum(widths[:i]), widths[i]
        if tuple(tensor.shape) != (n, k):
            raise ReloadError(f"flashrl reload: {rec.name}.{leaf}: update shape {tuple(tensor.shape)} != the "
                              f"engine's shard {(n, k)} (the block-FP8 reload writes whole shards: TP=1)")
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        step = max(128, (BLOCK_FP8_STRIP_BYTES // max(1, k)) // 128 * 128)
        t0 = time.perf_counter()
        with torch.no_grad():
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                q, sc = self.quantize_linear(f"{rec.name}.{leaf}", src[r0:r1])
                packed = torch.ops._C.convert_weight_packed(q)
                del q
                w.data[off + r0: off + r1].copy_(packed)
                del packed
                b0 = (off + r0) // 128
                s.data[b0: b0 + sc.shape[0]].copy_(sc)
        t = self.state.timing
        t["quantize_s"] = t.get("quantize_s", 0.0) + time.perf_counter() - t0

    def check_complete(self) -> None:
        partial = {name: sorted(set(self.state.records[name].shards) - leaves)
                   for name, leaves in self.seen.items() if leaves < set(self.state.records[name].shards)}
        if partial:
            raise ReloadError(f"flashrl reload: the update sent fused block-FP8 layers only in part (missing "
                              f"shards: {partial}); the shards it did send are already written (the block-FP8 "
                              f"reload writes in place), so send every shard of a fused layer in one update")


def block_fp8_process_weights(wrapped, args, kwargs, cfg):
    """Engine start with ``fn: fp8_block``: the engine's own post-processing, then check every
    quantized layer takes the direct write (:func:`block_fp8_direct_layout`) and wrap
    ``model.load_weights``. Raises ConfigError naming the layer otherwise."""
    from .config import ConfigError
    b = dict(zip(("model", "model_config", "target_device"), args))
    b.update(kwargs)
    model = b["model"]
    state = ReloadState(model, b.get("model_config"), b.get("target_device"), None, cfg.fn)
    before = state.record_before()
    result = wrapped(*args, **kwargs)
    state.record_after(before)
    quantized = [r for r in state.records.values() if r.quantized]
    if not quantized:
        raise ConfigError(f"ASCEND_RL_FLASHRL selects fn='fp8_block' with model {cfg.model!r}, but the engine "
                          f"loaded no block-FP8 linear layer (write the checkpoint with `ascend-rl flashrl quantize "
                          f"--fn fp8-block`)")
    other = sorted(r.name for r in quantized if r.kind != "block_fp8")
    if other:
        raise ConfigError(f"ASCEND_RL_FLASHRL selects fn='fp8_block' but {cfg.model!r} holds other quantized "
                          f"layers ({len(other)}, e.g. {other[0]}); use the fn of that checkpoint")
    for r in quantized:
        why = block_fp8_direct_layout(r.module)
        if why is not None:
            raise ConfigError(f"ASCEND_RL_FLASHRL fn='fp8_block': {r.name} cannot take flashrl's block-FP8 "
                              f"reload: {why}")
    install(model, state)
    log.info("flashrl: %d block-FP8 layers ready for online-quantized reload (direct VNNI writes)", len(quantized))
    return result
