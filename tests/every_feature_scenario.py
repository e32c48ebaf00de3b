"""Child-process scenario of ``tests/test_every_feature.py``: a real Megatron-Core GPTModel
built, run forward and backward, in a process where every feature is switched on (one rank
of a gloo group, as the CPU Megatron harness needs)."""

from __future__ import annotations


def megatron_model_with_every_feature_on() -> dict:
    """Activate (the environment switches everything on), build a GPTModel, one
    forward/backward; return the loss and the states of the patches on Megatron-Core."""
    import math

    import ascend_rl_plugins
    from ascend_rl_plugins.patching.core import REGISTRY
    from tests.support.megatron import megatron_model

    ascend_rl_plugins.activate("test: every feature on")
    with megatron_model(layers=1) as h:
        loss = h.loss(h.tokens(batch=2, seed=0))
        loss.backward()
        value = float(loss.detach())
    megatron = {p.name: p.outcome.state for p in REGISTRY.patches.values() if p.dist == "megatron-core"}
    return {"loss": value, "finite": math.isfinite(value), "megatron_patches": megatron,
            "failed": {p.name: p.outcome.reason for p in REGISTRY.patches.values()
                       if p.outcome.state == "failed"}}
