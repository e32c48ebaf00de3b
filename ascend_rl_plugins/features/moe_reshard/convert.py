"""HF <-> Megatron-Core expert-weight converter (grouped-GEMM and per-expert layouts).

Why: the recipe converts HF checkpoints for Megatron's grouped-GEMM experts (``weight1`` /
``weight2``) with a patched converter (its patch 0001, switched by ``USE_ALLTOALL_OVERLAP``);
here both directions use ``layout.py``'s one mapping -- the same one the reshard executor uses
at run time -- so a checkpoint written by one is read back bit-identically by the other.

Scope: expert weights only (``model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight``).
Every other tensor of the HF checkpoint is passed through unchanged (``non_expert.safetensors``
on the Megatron side, copied back on the way home); attention, norms, embeddings and the router
are converted by verl's / Megatron's own converters.

Megatron side (a directory): ``moe_layout.json`` (shape and layout) and one
``experts_pp{p}_ep{e}_etp{t}.pt`` (``torch.save`` of ``{megatron_name: tensor}``, global layer
numbers) per expert shard -- expert data-parallel replicas share a file.
HF side: ``*.safetensors`` in a directory (read lazily, one tensor at a time); written as one
file per MoE layer plus ``model.safetensors.index.json``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

from .layout import PROJS, LayoutError, MoEShape, TrainingLayout, hf_expert_name, hf_to_megatron, \
    megatron_to_hf, parse_hf_expert_name

META = "moe_layout.json"
NON_EXPERT = "non_expert.safetensors"


class ConvertError(ValueError):
    """A checkpoint the converter cannot handle; the message says why."""


class _LazyHF:
    """``{hf_name: tensor}`` over a directory of safetensors files, opened lazily."""

    def __init__(self, directory: str):
        from safetensors import safe_open
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise ConvertError(f"no *.safetensors files in {directory}")
        self._handles = [safe_open(f, framework="pt") for f in files]
        self.where = {}
        for h in self._handles:
            for k in h.keys():
                if k in self.where:
                    raise ConvertError(f"tensor {k} is in two files")
                self.where[k] = h

    def __getitem__(self, name: str):
        return self.where[name].get_tensor(name)

    def keys(self):
        return self.where.keys()


def infer_shape(hf: _LazyHF, num_layers: int | None, config_dir: str | None = None) -> MoEShape:
    """The expert geometry of an HF checkpoint, from its tensors (and config.json if any)."""
    layers, experts = set(), set()
    for name in hf.keys():
        parsed = parse_hf_expert_name(name)
        if parsed:
            layers.add(parsed[0])
            experts.add(parsed[1])
    if not layers:
        raise ConvertError("no HF expert tensors (model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight)")
    if experts != set(range(len(experts))):
        raise ConvertError(f"expert ids are not 0..{len(experts) - 1}")
    if num_layers is None and config_dir and os.path.exists(os.path.join(config_dir, "config.json")):
        with open(os.path.join(config_dir, "config.json")) as f:
            num_layers = json.load(f).get("num_hidden_layers")
    num_layers = num_layers or max(layers) + 1
    first = min(layers)
    gate = hf[hf_expert_name(first, 0, "gate_proj")]
    shape = MoEShape(num_layers=num_layers, num_experts=len(experts), hidden=gate.shape[1], ffn_hidden=gate.shape[0],
                     moe_layers=None if layers == set(range(num_layers)) else tuple(sorted(layers)),
                     dtype_bytes=gate.element_size())
    for layer in shape.expert_layers:
        for e in range(shape.num_experts):
            for p in PROJS:
                name = hf_expert_name(layer, e, p)
                if name not in hf.where:
                    raise ConvertError(f"missing {name}")
    return shape


def _shards(training: TrainingLayout, shape: MoEShape) -> dict[tuple[int, int, int], int]:
    """``(pp, ep, etp) -> a representative rank`` of every expert shard."""
    return {k: ranks[0] for k, ranks in sorted(training.owner_table(shape).items())}


def hf_to_mcore(src: str, dst: str, training: TrainingLayout, num_layers: int | None = None) -> dict:
    """Write the Megatron expert shards of the HF checkpoint in ``src`` to ``dst`` (one file per
    (pp, ep, etp) shard; the training tp and dp do not change expert shards)."""
    from safetensors.torch import save_file
    import torch
    hf = _LazyHF(src)
    shape = infer_shape(hf, num_layers, src)
    try:
        t = TrainingLayout(tp=1, pp=training.pp, ep=training.ep, etp=training.etp, vpp=training.vpp,
                           expert_impl=training.expert_impl, layer_stages=training.layer_stages,
                           ).with_world(training.pp * training.ep * training.etp)
        shards = _shards(t, shape)
    except LayoutError as exc:
        raise ConvertError(str(exc)) from None
    os.makedirs(dst, exist_ok=True)
    files = []
    for (pp, ep, etp), rank in shards.items():
        local = hf_to_megatron(hf, shape, t, rank)
        path = os.path.join(dst, f"experts_pp{pp}_ep{ep}_etp{etp}.pt")
        torch.save(local, path)
        files.append(os.path.basename(path))
    rest = {k: hf[k].contiguous() for k in hf.keys() if parse_hf_expert_name(k) is None}
    if rest:
        save_file(rest, os.path.join(dst, NON_EXPERT))
    meta = {"shape": dataclasses.asdict(shape), "training": dataclasses.asdict(t), "files": files}
    with open(os.path.join(dst, META), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def _load_meta(src: str) -> tuple[MoEShape, TrainingLayout]:
    path = os.path.join(src, META)
    if not os.path.exists(path):
        raise ConvertError(f"{path} not found (write the Megatron side with --direction hf-to-mcore)")
    with open(path) as f:
        meta = json.load(f)
    s, t = meta["shape"], meta["training"]
    shape = MoEShape(**{**s, "moe_layers": tuple(s["moe_layers"]) if s["moe_layers"] is not None else None})
    training = TrainingLayout(**{**t, "layer_stages": tuple(t["layer_stages"]) if t["layer_stages"] else None})
    return shape, training


_SHARD = re.compile(r"^experts_pp(\d+)_ep(\d+)_etp(\d+)\.pt$")


def mcore_to_hf(src: str, dst: str) -> list[str]:
    """Write full HF expert tensors (one safetensors file per MoE layer, plus the passed-through
    non-expert tensors and an index) from the Megatron expert shards in ``src``."""
    from safetensors.torch import save_file
    import torch
    shape, training = _load_meta(src)
    shards = _shards(training, shape)
    loaded = {}
    for (pp, ep, etp), rank in shards.items():
        path = os.path.join(src, f"experts_pp{pp}_ep{ep}_etp{etp}.pt")
        if not os.path.exists(path):
            raise ConvertError(f"missing shard {path}")
        loaded[(pp, ep, etp)] = (rank, torch.load(path, mmap=True, weights_only=True))
    os.makedirs(dst, exist_ok=True)
    weight_map, written = {}, []
    for layer in shape.expert_layers:
        out, filled = {}, {}
        stage = training.stage_of_layer(layer, shape.num_layers)
        for (pp, _, _), (rank, tensors) in loaded.items():
            if pp != stage:
                continue
            prefix = f"decoder.layers.{layer}.mlp.experts."
            for name, tensor in tensors.items():
                if not name.startswith(prefix):
                    continue
                for hf_name, sl, view in megatron_to_hf(name, tensor, shape, training, rank):
                    if hf_name not in out:
                        size = (shape.hidden, shape.ffn_hidden) if sl.proj == "down_proj" else (shape.ffn_hidden, shape.hidden)
                        out[hf_name] = torch.empty(size, dtype=tensor.dtype)
                        filled[hf_name] = 0
                    dim = 1 if sl.proj == "down_proj" else 0
                    out[hf_name].narrow(dim, sl.lo, sl.rows).copy_(view)
                    filled[hf_name] += sl.rows
        for e in range(shape.num_experts):
            for p in PROJS:
                name = hf_expert_name(layer, e, p)
                if filled.get(name) != shape.ffn_hidden:
                    raise ConvertError(f"{name}: the shards cover {filled.get(name, 0)} of {shape.ffn_hidden} rows")
        fname = f"model-experts-layer{layer:05d}.safetensors"
        save_file(out, os.path.join(dst, fname))
        weight_map.update({k: fname for k in out})
        written.append(fname)
    rest = os.path.join(src, NON_EXPERT)
    if os.path.exists(rest):
        from safetensors import safe_open
        with safe_open(rest, framework="pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        save_file(tensors, os.path.join(dst, "model-non-experts.safetensors"))
        weight_map.update({k: "model-non-experts.safetensors" for k in tensors})
        written.append("model-non-experts.safetensors")
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    return written
