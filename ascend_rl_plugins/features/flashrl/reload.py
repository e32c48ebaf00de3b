"""Weight reload into a running W8A8 engine (worker side).

When vLLM has loaded a model and is about to run each layer's quant-method
post-processing (transpose, oneDNN prepack, NZ cast, scale flattening ...), we remember
every quantized module's *checkpoint-layout* parameter objects (they carry vLLM's
weight loaders). Afterwards ``model.load_weights`` of that model instance is wrapped:

* BF16 tensors with HF names are quantized online (:class:`~.profile.OnlineQuantizer`,
  same code as the offline checkpoint writer);
* a module's checkpoint-layout parameters are re-materialised only while that module is
  being updated, filled through vLLM's own ``load_weights`` (so sharding, fused
  q/k/v and gate/up offsets are vLLM's), and post-processed by the module's own quant
  method;
* the processed tensors are copied into the storage the engine already holds (same data
  pointer, same shape/stride/dtype, or a clear error), the original ``Parameter``
  objects are put back, and the temporary storage is released before the next module.

So the extra memory is one module's worth, not a second model (FlashRL rebuilds every
parameter first), and whatever the quant method keeps outside parameters (oneDNN
handlers on CPU) is rebuilt by the method itself rather than by copying raw storage.
Unquantized modules (norms, embeddings, lm_head) are loaded in place and their quant
method's post-processing is re-run when it exists (on CPU it rebuilds oneDNN handlers).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from .profile import OnlineQuantizer, Profile, ProfileError

log = logging.getLogger("ascend_rl_plugins.flashrl")

_STATE_ATTR = "_ascend_rl_flashrl_reload"


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
    int8: bool  # a W8A8 int8 linear: its BF16 weights are quantized online
    shards: tuple[str, ...]  # HF leaf names that make up the module (q_proj, k_proj, v_proj ...)


@dataclass
class _Pending:
    record: ModuleRecord
    live: dict[str, Any]
    seen: set[str] = field(default_factory=set)
    saved: dict[str, torch.Tensor] = field(default_factory=dict)  # aliased live tensors, for abort
    attrs: dict[str, Any] = field(default_factory=dict)  # tensor attributes (not parameters) of the module
    filled: set[str] = field(default_factory=set)  # fresh params initialised from the engine's values
    written: set[str] = field(default_factory=set)  # fresh params the update wrote


def _is_int8_w8a8(module: torch.nn.Module) -> bool:
    w = module._parameters.get("weight")
    return w is not None and w.dtype == torch.int8 and "weight_scale" in module._parameters


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and a.stride() == b.stride()
            and a.device == b.device)


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
        self.reloads = 0
        self.last_quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.keep_quantized = False  # tests: keep what the last reload quantized, for checks
        self.rebuild_all = False  # benchmark baseline: rebuild every layer before processing any
        packed = dict(getattr(type(model), "packed_modules_mapping", {}) or {})
        self.shard_to_fused = {s: fused for fused, shards in packed.items() for s in shards}
        self.packed = packed

    # -- before/after the engine's own post-processing ---------------------------------
    def record_before(self) -> dict[str, tuple[dict, dict]]:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        before = {}
        for name, module in self.model.named_modules():
            if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase) \
                    and module._parameters.get("weight") is not None:  # (attention KV-scale methods: no)
                params = {n: p for n, p in module._parameters.items() if p is not None}
                layout = {n: (tuple(p.shape), p.stride(), p.dtype, p.data_ptr()) for n, p in params.items()}
                before[name] = (params, layout, _is_int8_w8a8(module))
        return before

    def record_after(self, before: dict) -> None:
        for name, (params, layout, int8) in before.items():
            module = self.model.get_submodule(name)
            now = module._parameters
            kept = all(now.get(n) is p and (tuple(p.shape), p.stride(), p.dtype, p.data_ptr()) == layout[n]
                       for n, p in params.items()) and set(k for k, v in now.items() if v is not None) == set(params)
            specs = {n: ParamSpec(p, layout[n][0], layout[n][2], p.device) for n, p in params.items()}
            leaf = name.rsplit(".", 1)[-1]
            shards = tuple(self.packed.get(leaf, [leaf]))
            self.records[name] = ModuleRecord(name, module, specs, rebuild=not kept, int8=int8, shards=shards)
            if not kept:
                in_use = {id(v) for v in now.values() if v is not None}
                for n, spec in specs.items():
                    if id(spec.param) not in in_use:  # no longer used by the engine: drop its storage
                        spec.param.data = torch.empty(0, dtype=spec.dtype, device=spec.device)

    # -- name mapping ------------------------------------------------------------------
    def module_of(self, hf_name: str) -> tuple[ModuleRecord | None, str]:
        """(record, shard leaf) for an HF tensor name, e.g. ``...q_proj.weight`` ->
        (record of ``...qkv_proj``, ``q_proj``)."""
        base, _, _ = hf_name.rpartition(".")
        parent, _, leaf = base.rpartition(".")
        fused = self.shard_to_fused.get(leaf)
        if fused is not None:
            rec = self.records.get(f"{parent}.{fused}" if parent else fused)
            if rec is not None:
                return rec, leaf
        return self.records.get(base), leaf

    def check_profile(self) -> None:
        """Fail at engine start when the profile does not describe this model."""
        if self.profile is None:
            return
        for lin in self.profile.linears:
            rec, _ = self.module_of(lin)
            if rec is None or not rec.int8:
                raise ProfileError(f"FlashRL profile names {lin}, which is not an INT8 W8A8 linear of the model "
                                   f"being served ({type(self.model).__name__}); was the profile made from "
                                   f"this checkpoint?")
            shape = self.profile.shapes.get(lin)
            k = rec.specs["weight"].shape[1]
            if shape is not None and shape[1] != k:
                raise ProfileError(f"FlashRL profile does not fit the model: {lin} has {shape[1]} input "
                                   f"channels in the profile, {k} in the engine")
            for key in (lin,):
                v = self.profile.col_smooth.get(key)
                if v is not None and v.numel() != k:
                    raise ProfileError(f"FlashRL profile smoothing for {lin} has {v.numel()} entries, the "
                                       f"engine's layer has {k} input channels")

    # -- the reload ----------------------------------------------------------------------
    def load_weights(self, original, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        quantizer = OnlineQuantizer(
            self.profile, fn=self.fn,
            is_quantized=lambda name, shape: len(shape) == 2 and name.endswith(".weight")
            and (self.module_of(name)[0] or _NO).int8)
        pending: dict[str, _Pending] = {}
        dirty_inplace: dict[str, ModuleRecord] = {}
        loaded: set[str] = set()
        quantized_log: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        q_weight: dict[str, torch.Tensor] = {}
        try:
            for name, tensor in quantizer.transform(weights):
                rec, leaf = self.module_of(name)
                if rec is None or not rec.rebuild:
                    loaded |= set(original([(name, tensor)]) or ())
                    if rec is not None and hasattr(rec.module, "quant_method"):
                        dirty_inplace[rec.name] = rec
                    continue
                p = pending.get(rec.name)
                if p is None:
                    p = pending[rec.name] = self._open(rec)
                loaded |= set(original([(name, tensor)]) or ())
                p.written.add(name.rpartition(".")[2])
                if self.keep_quantized and name.endswith(".weight") and tensor.dtype == torch.int8:
                    q_weight[name] = tensor
                if self.keep_quantized and name.endswith(".weight_scale") and name[:-6] in q_weight:
                    quantized_log[name[:-6]] = (q_weight.pop(name[:-6]), tensor)
                if name.endswith(".weight_scale") or (not rec.int8 and name.endswith(".weight")):
                    p.seen.add(leaf)
                    if p.seen >= set(rec.shards) and not self.rebuild_all:
                        self._close(pending.pop(rec.name))
            if self.rebuild_all:  # FlashRL's memory profile (benchmark baseline): everything at once
                for name in [n for n, p in pending.items() if p.seen >= set(p.record.shards)]:
                    self._close(pending.pop(name))
            if pending:
                missing = {n: sorted(set(p.record.shards) - p.seen) for n, p in pending.items()}
                raise ReloadError(f"flashrl reload: the update ended with fused layers only partly sent "
                                  f"(missing shards: {missing}); every shard of a fused layer must be sent "
                                  f"together")
            for rec in dirty_inplace.values():
                self._reprocess_inplace(rec)
        except BaseException:
            for p in pending.values():
                self._abort(p)
            raise
        self.reloads += 1
        if self.keep_quantized:
            self.last_quantized = quantized_log
        return loaded

    def _open(self, rec: ModuleRecord) -> _Pending:
        """Put fresh checkpoint-layout parameters on ``rec.module`` for loading.

        The engine's current objects and storages are remembered: ``live`` maps a name to
        (object, data) -- data is kept separately because some quant methods (vLLM-Ascend)
        post-process by assigning ``param.data`` on the very object they loaded into.
        """
        module = rec.module
        live = {n: (v, None if v is None else v.data) for n, v in module._parameters.items()}
        attrs = {n: v for n, v in vars(module).items() if isinstance(v, torch.Tensor)
                 and not isinstance(v, torch.nn.Parameter)}
        kernel = getattr(getattr(getattr(module, "quant_method", None), "scheme", None), "kernel", None)
        saved: dict[str, torch.Tensor] = {}
        filled: set[str] = set()
        for n, spec in rec.specs.items():
            cur = live.get(n, (None, None))[1]
            if n in _CALIBRATION:
                # static activation calibration is not part of a weight update: keep it
                if cur is None:
                    raise ReloadError(f"flashrl reload: {rec.name}.{n} has no live value to keep")
                fresh = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
                fresh.copy_(cur.reshape(-1)[0].expand(spec.shape) if cur.numel() == 1 else cur.reshape(spec.shape))
                filled.add(n)
            elif cur is not None and tuple(cur.shape) == spec.shape and cur.dtype == spec.dtype \
                    and cur.is_contiguous():
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
        if kernel is not None and hasattr(kernel, "dnnl_handler"):
            attrs["__dnnl_handler__"] = kernel.dnnl_handler  # restored if the update is aborted
        return _Pending(rec, live, saved=saved, attrs=attrs, filled=filled)

    def _close(self, p: _Pending) -> None:
        rec, module = p.record, p.record.module
        missing = sorted(set(rec.specs) - p.filled - p.written)
        if missing:
            raise ReloadError(f"flashrl reload: {rec.name}: the update did not provide {missing} and their "
                              f"values cannot be recovered from the processed layer")
        quant_method = module.quant_method
        kernel = getattr(getattr(quant_method, "scheme", None), "kernel", None)
        if kernel is not None and hasattr(kernel, "dnnl_handler"):
            kernel.dnnl_handler = None  # release the old prepacked weight before building the new one
        from vllm.model_executor.model_loader.utils import device_loading_context
        # (the label lets the benchmark tell the quant method's own transients from the reload's)
        with torch.profiler.record_function("flashrl.quant_method_postprocess"), \
                device_loading_context(module, self.target_device):
            quant_method.process_weights_after_loading(module)
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

    def _abort(self, p: _Pending) -> None:
        module = p.record.module
        for n, copy in p.saved.items():
            p.live[n][1].copy_(copy)
        for n, (obj, data) in p.live.items():
            if obj is not None and data is not None:
                obj.data = data
            module._parameters[n] = obj
        handler = p.attrs.get("__dnnl_handler__")
        if handler is not None:
            module.quant_method.scheme.kernel.dnnl_handler = handler
        for spec in p.record.specs.values():
            if all(spec.param is not obj for obj, _ in p.live.values()):
                spec.param.data = torch.empty(0, dtype=spec.dtype, device=spec.device)

    def _reprocess_inplace(self, rec: ModuleRecord) -> None:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        qm = getattr(rec.module, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and not rec.int8:
            from vllm.model_executor.model_loader.utils import device_loading_context
            with device_loading_context(rec.module, self.target_device):
                qm.process_weights_after_loading(rec.module)


class _No:
    int8 = False


_NO = _No()


_CALIBRATION = ("input_scale", "input_zero_point", "input_offset")


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
