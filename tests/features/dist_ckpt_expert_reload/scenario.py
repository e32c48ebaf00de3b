"""dist_ckpt_expert_reload on real verl and Megatron-Core, run on every rank of a 2-process gloo
group by test_dist_ckpt_expert_reload.py (never imported by the pytest process).

Real: a Megatron-Core GPTModel with legacy GroupedMLP experts from the harness
(tests/support/megatron.py), ``dist_checkpointing.save`` of its ``sharded_state_dict()`` (what
verl's converter writes as ``dist_checkpointing_path``), and verl's own
``verl.utils.model.load_mcore_dist_weights`` loading it back. Shims: the checkpoint I/O shims of
tests/support/megatron_checkpoint_shims.py that the running stack needs.
"""

from __future__ import annotations

import os

PATCHES = ("dist_ckpt_expert_reload.load_mcore_dist_weights", "dist_ckpt_expert_reload.dist_checkpointing_load")
LAYOUTS = {"ep2": {"ep": 2}, "etp2": {"ep": 1, "etp": 2}}

verl_copy = None  # a `from verl.utils.model import load_mcore_dist_weights` copy, as verl's workers hold


def _perturb(model) -> None:
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def _stale(model, saved: dict) -> list[str]:
    """Parameters not bit-identical to the saved ones."""
    import torch
    return sorted(n for n, p in model.named_parameters() if not torch.equal(p.detach(), saved[n]))


def reload(ckpt_root: str, layouts: list) -> dict:
    """For each layout: save; then verl's load_mcore_dist_weights over perturbed weights, once
    stock and once with the feature (through a from-import copy taken before activation), and
    Megatron-Core's dist_checkpointing.load called directly with the feature on."""
    global verl_copy
    import torch.distributed as dist

    import ascend_rl_plugins
    from ascend_rl_plugins.features import dist_ckpt_expert_reload as feature
    from ascend_rl_plugins.patching.core import REGISTRY
    from tests.support import megatron_checkpoint_shims as support
    from tests.support.megatron import megatron_model

    results: dict = {}
    for name in layouts:
        out = results[name] = {}
        ckpt = os.path.join(ckpt_root, name)
        os.makedirs(ckpt, exist_ok=True)
        with megatron_model(moe="grouped", **LAYOUTS[name]) as h:
            from megatron.core import dist_checkpointing
            out["shims"] = support.install_checkpoint_shims()
            out["sizes"] = {"ep": h.ep_size, "etp": h.etp_size}
            out["experts"] = type(h.model.decoder.layers[0].mlp.experts).__name__
            saved = {n: p.detach().clone() for n, p in h.model.named_parameters()}
            dist.barrier()
            dist_checkpointing.save(h.model.sharded_state_dict(), ckpt)

            if verl_copy is None:
                from verl.utils.model import load_mcore_dist_weights
                verl_copy = load_mcore_dist_weights
            patches = list(feature.FEATURE.patches)
            for patch in patches:  # stock verl first (the feature is reverted for later layouts)
                REGISTRY.revert(patch)
            _perturb(h.model)
            out["perturbed"] = _stale(h.model, saved)
            verl_copy([h.model], ckpt)
            out["stale_stock"] = _stale(h.model, saved)

            ascend_rl_plugins.activate()
            REGISTRY.activate(only=patches)  # again after a revert (activate() runs once per process)
            out["patch_states"] = {p.name: p.outcome.state for p in patches}
            out["copy_rebound"] = getattr(verl_copy, "__wrapped__", None) is not None
            _perturb(h.model)
            verl_copy([h.model], ckpt)  # the copy taken before activation, rebound by the framework
            out["stale_patched"] = _stale(h.model, saved)
            _perturb(h.model)  # Megatron-Core's load outside verl's function: left as it was
            dist_checkpointing.load(h.model.sharded_state_dict(), ckpt)
            out["stale_direct_load"] = _stale(h.model, saved)
    return results
