"""optimizer_state_none on a real Megatron-Core ``DistributedOptimizer``, run on every rank of a
2-process gloo group by test_optimizer_state_none.py (never imported by the pytest process).

Real: Megatron-Core's GPTModel with GroupedMLP experts (EP2; the dense part DP2) from the
harness, its ``DistributedDataParallel`` and ``DistributedOptimizer`` (a ``ChainedOptimizer`` of
the dense and the expert optimizer, built by ``get_megatron_optimizer``), one training step,
``sharded_state_dict``, ``dist_checkpointing.save`` / ``load`` and ``load_state_dict``, in the
format verl uses on the running stack. Double: the inner optimizer, MindSpeed's swap AdamW as
it stores optimizer state (``megatron_checkpoint_shims.swap_adamw_double``), bound where MindSpeed
registers it (as Apex's FusedAdam). Shims: megatron_checkpoint_shims (CPU devices, this stack's checkpoint I/O).
"""

from __future__ import annotations

import os

PATCHES = ("optimizer_state_none.get_states", "optimizer_state_none.set_states")


def sharding_metadata() -> dict:
    """The optimizer checkpoint format verl uses with this Megatron-Core: verl 0.6.1 calls
    ``sharded_state_dict(model_sd, is_loading=...)`` (Megatron's default, fully_sharded_model_space,
    on 0.12.1); verl 0.9.1 passes ``distrib_optim_sharding_type='dp_reshardable'`` by default
    (fully_sharded_model_space no longer saves on 0.16: flattened ranges are refused)."""
    from importlib.metadata import version
    return {} if version("megatron-core").startswith("0.12") else {
        "metadata": {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                     "chained_optim_avoid_prefix": True}}


def _inner_optimizers(opt):
    return [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]


def _snapshot(opt) -> list:
    """Every parameter's optimizer state (tensors cloned, None kept) and every group's step."""
    import torch
    out = []
    for inner in _inner_optimizers(opt):
        for group in inner.param_groups:
            states = [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in inner.state[p].items()}
                      for p in group["params"]]
            out.append({"step": group.get("step"), "params": [p.detach().clone() for p in group["params"]],
                        "states": states})
    return out


def _perturb(opt) -> None:
    import torch
    with torch.no_grad():
        for inner in _inner_optimizers(opt):
            for group in inner.param_groups:
                group["step"] = 99
                for p in group["params"]:
                    p.add_(1.0)
                    for value in inner.state[p].values():
                        if torch.is_tensor(value):
                            value.add_(3.0)


def _differences(before: list, opt) -> list[str]:
    """What differs, bit for bit, between a snapshot and the optimizer now."""
    import torch
    now, wrong = _snapshot(opt), []
    for g, (a, b) in enumerate(zip(before, now)):
        if a["step"] != b["step"]:
            wrong.append(f"group {g}: step {b['step']} != {a['step']}")
        for i, (pa, pb) in enumerate(zip(a["params"], b["params"])):
            if not torch.equal(pa, pb):
                wrong.append(f"group {g} param {i}: main parameter differs")
        for i, (sa, sb) in enumerate(zip(a["states"], b["states"])):
            if set(sa) != set(sb):
                wrong.append(f"group {g} param {i}: state keys {sorted(sb)} != {sorted(sa)}")
            for key, value in sa.items():
                got = sb.get(key)
                same = got is None if value is None else torch.is_tensor(got) and torch.equal(value, got)
                if not same:
                    wrong.append(f"group {g} param {i}: {key} differs")
    return wrong


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def _load(opt, model, ckpt: str, kwargs: dict) -> None:
    """What verl's checkpoint manager does to load the optimizer. Under ``no_grad``: Megatron-Core
    0.16.1's dp_reshardable loader copies into fp32 main parameters, which are views of the
    model's fp32 parameters (the torch norms of the local layer spec stay fp32 in a bf16 model),
    outside ``no_grad`` and fails on that alone (its fully_sharded_model_space loader is
    decorated with ``no_grad``)."""
    import torch
    from megatron.core import dist_checkpointing
    from tests.support import megatron_checkpoint_shims as support
    with support.cuda_literals_on_cpu(), torch.no_grad():
        load_sd = opt.sharded_state_dict(model.sharded_state_dict(), is_loading=True, **kwargs)
        opt.load_state_dict(dist_checkpointing.load({"optimizer": load_sd}, ckpt)["optimizer"])


def round_trip(ckpt_root: str) -> dict:
    """A real step, then: (A) without the feature, building the optimizer's sharded state dict;
    (B) with it, save -> perturb -> load, compared bit for bit; (C) with only its save side,
    loading the same checkpoint again."""
    import torch
    import torch.distributed as dist

    import ascend_rl_plugins
    from ascend_rl_plugins.patching.core import REGISTRY
    from tests.support import megatron_checkpoint_shims as support
    from tests.support.megatron import megatron_model

    kwargs = sharding_metadata()
    ckpt = os.path.join(ckpt_root, "optimizer")
    os.makedirs(ckpt, exist_ok=True)
    with megatron_model(ep=2, moe="grouped", dtype="bfloat16") as h:
        support.install_mindspeed_optimizer_double()
        from megatron.core import dist_checkpointing
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        out: dict = {"shims": support.install_checkpoint_shims()}
        ddp = DistributedDataParallel(config=h.config, module=h.model,
                                      ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True))
        with support.cuda_literals_on_cpu():
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                         bf16=True, params_dtype=torch.bfloat16),
                                         [ddp], use_gloo_process_groups=False)
        out["inner"] = sorted({type(inner).__name__ for inner in _inner_optimizers(opt)})
        ddp.zero_grad_buffer()
        opt.zero_grad()
        h.loss(h.tokens(batch=4, seed=1)).backward()
        ddp.finish_grad_sync()
        with support.cuda_literals_on_cpu():
            out["stepped"] = bool(opt.step()[0])
        out["none_states"] = sorted({k for inner in _inner_optimizers(opt) for s in inner.state.values()
                                     for k, v in s.items() if v is None})
        out["tensor_states"] = sorted({k for inner in _inner_optimizers(opt) for s in inner.state.values()
                                       for k, v in s.items() if torch.is_tensor(v)})

        # (A) stock Megatron-Core
        try:
            opt.sharded_state_dict(h.model.sharded_state_dict(), is_loading=False, **kwargs)
            out["stock_save"] = "ok"
        except Exception as exc:  # the reproduction: record it, the test asserts on it
            out["stock_save"] = _error(exc)

        # (B) with the feature
        ascend_rl_plugins.activate()
        out["patch_states"] = {name: REGISTRY.patches[name].outcome.state for name in PATCHES}
        try:
            saved_sd = opt.sharded_state_dict(h.model.sharded_state_dict(), is_loading=False, **kwargs)
            dist.barrier()
            with support.cuda_literals_on_cpu():
                dist_checkpointing.save({"optimizer": saved_sd}, ckpt)
            before = _snapshot(opt)
            _perturb(opt)
            out["perturbed"] = len(_differences(before, opt)) > 0
            _load(opt, h.model, ckpt, kwargs)
            out["differences"] = _differences(before, opt)
        except Exception as exc:  # a broken feature: recorded for the test (every rank fails alike)
            out["round_trip_error"] = _error(exc)
            return out

        # (C) the load side of the feature removed
        REGISTRY.revert(REGISTRY.patches["optimizer_state_none.set_states"])
        _perturb(opt)
        try:
            _load(opt, h.model, ckpt, kwargs)
            out["load_without_set_states"] = "ok"
        except Exception as exc:  # expected: recorded for the test
            out["load_without_set_states"] = _error(exc)
    return out

