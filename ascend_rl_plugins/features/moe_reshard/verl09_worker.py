"""The vLLM worker side of reading live expert maps in a verl 0.9.1 deployment (``verl09_rollout``
says how the pieces meet): verl's own worker extension plus one method, named in the rollout's
engine kwargs (``verl09_rollout.EXTENSION_LINE``). Imported only by vLLM, by that name, in its
worker processes: it loads verl's vLLM worker code.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from verl.workers.rollout.vllm_rollout.utils import (_resolve_vllm_weight_sync_local_rank,
                                                     vLLMColocateWorkerExtension)

from .verl09_rollout import ANSWER, PublishedExpertMap


class ReshardWorkerExtension(vLLMColocateWorkerExtension):
    """verl's vLLM worker extension (weight IPC, LoRA, FP8 kept as they are) plus the one method
    the backend calls through the server's ``collective_rpc``."""

    def ascend_rl_publish_expert_map(self, directory: str, weight_sync_rank: int) -> dict | None:
        """If this worker is the one paired with ``weight_sync_rank``: read the experts its
        ``FusedMoE`` layers host now and write them to ``directory`` (atomically); the others
        return at once. Returns what it wrote (for direct vLLM callers)."""
        from .vllm_side import local_expert_map
        parallel = getattr(getattr(self.model_runner, "vllm_config", None), "parallel_config", None)
        mine = _resolve_vllm_weight_sync_local_rank(self.local_rank, parallel)
        if mine != weight_sync_rank:
            return None
        model = self.model_runner.get_model() if hasattr(self.model_runner, "get_model") else self.model_runner.model
        try:
            hosted = local_expert_map(model)
            answer = PublishedExpertMap(mine, None if hosted is None else list(hosted),
                                        "" if hosted is not None else "the rollout model has no FusedMoE layers")
        except ValueError as exc:
            answer = PublishedExpertMap(mine, None, str(exc))
        tmp = os.path.join(directory, ANSWER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(answer), f)
        os.replace(tmp, os.path.join(directory, ANSWER))
        return asdict(answer)


__all__ = ["ReshardWorkerExtension"]
