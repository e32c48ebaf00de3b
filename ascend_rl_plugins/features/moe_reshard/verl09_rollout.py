"""Live expert maps for the ``ascend_rl_alltoallv`` backend inside a verl 0.9.1 deployment.

Where the rollout side runs (read in verl 0.9.1): ``RolloutReplica.init_standalone`` /
``init_colocated`` start one ``CheckpointEngineWorker`` Ray actor per vLLM worker
(``verl/workers/rollout/replica.py``); it builds this backend from ``bucket_size`` and
``engine_kwargs`` alone and never hands it the server adapter it holds beside it
(``verl/checkpoint_engine/base.py``). ``vLLMReplica.launch_servers`` then starts one
``vLLMHttpServer`` actor per node, named ``vllm_server_<replica>_<node>``, and gives it the
node's ``CheckpointEngineWorker`` handles in rollout-rank order (its ``workers``); that server
runs vLLM with ``worker_extension_cls`` = verl's ``vLLMColocateWorkerExtension`` unless
``rollout.engine_kwargs.vllm.worker_extension_cls`` overrides it (the user's engine kwargs are
applied last). Each vLLM worker pairs with its ``CheckpointEngineWorker`` by verl's
weight-sync rank (``_resolve_vllm_weight_sync_local_rank``: its ZMQ weight socket's name), which
is the ``CheckpointEngineWorker``'s index in the server's ``workers``.

PD-disaggregated replicas (``vllm_pd_replica.py``): the prefill server and each decode server
get their own slice of the replica's ``CheckpointEngineWorker`` list as ``workers``, and each
starts its own vLLM engine, whose workers' local ranks start at 0. The pairing above stays local
to one server on both sides (index in that server's ``workers``, weight-sync rank of that
server's vLLM worker), so it needs no offset; ``VERL_ZMQ_BASE_TRAINER_RANK``, which verl sets to
the slice's start for a decode server, only renames that worker's IPC socket.

How the backend reads its vLLM worker's map at every sync (:class:`ServerExpertMaps`): it finds
the ``vllm_server_*`` actor whose ``workers`` list this actor (once, then kept), and calls that
server's own ``collective_rpc`` with the method ``verl09_worker.ReshardWorkerExtension`` adds to
verl's worker extension (a module of its own: it imports verl's vLLM worker code, which the
``CheckpointEngineWorker`` process need not load). verl's ``vLLMHttpServer.collective_rpc`` awaits vLLM's and drops the workers'
return values, and vLLM only ships a callable to its workers under
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; so the method is called by name, and the worker whose
weight-sync rank is asked for answers through a file in a directory the backend made for this
read (the pair is on one node: verl itself pairs them by a node-local IPC socket under /tmp).

The one configuration line this needs (``verl09_config_lines`` prints it)::

    +actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=\
ascend_rl_plugins.features.moe_reshard.verl09_worker.ReshardWorkerExtension

Without it the server's workers have no such method, and the read is a refusal naming that line
(every rank then falls back together), never a silent use of the configured map.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass

from . import WORKER_EXTENSION as EXTENSION
from .planner import PlanError

EXTENSION_LINE = f"+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={EXTENSION}"
PUBLISH_METHOD = "ascend_rl_publish_expert_map"
# verl 0.9.1's policy rollout servers: vLLMReplica.launch_servers names one per node
# f"vllm_server_{replica}_{node}{suffix}"; a PD-disaggregated replica (vllm_pd_replica.py) names
# its prefill server the same way (node 0) and its decode servers
# f"vllm_server_decode_{replica}_{i}{suffix}". Reward and teacher servers (vllm_server_reward_*,
# vllm_server_teacher_*) never receive the policy's weights and are not matched.
SERVER_NAME = re.compile(r"^vllm_server_(decode_)?\d+_\d+(_.*)?$")
ANSWER = "expert-map.json"


@dataclass(frozen=True)
class PublishedExpertMap:
    """One vLLM worker's answer: its weight-sync rank, the experts it hosts in local-slot order
    (``None`` with ``error`` when it cannot say, e.g. per-layer EPLB maps)."""
    weight_sync_rank: int
    expert_map: list | None
    error: str = ""


def _index_of(server, worker) -> int:
    """Runs in a ``vLLMHttpServer`` actor: ``worker``'s index in its ``workers`` (-1: not there)."""
    workers = list(getattr(server, "workers", None) or [])
    return workers.index(worker) if worker in workers else -1


@dataclass
class ServerExpertMaps:
    """Reads, at each call, the experts this ``CheckpointEngineWorker``'s vLLM worker hosts,
    through the node's verl server (module docstring). ``locate`` finds that server."""
    server: object          # the vllm_server_* actor handle
    server_name: str
    weight_sync_rank: int   # this worker's index in the server's workers
    timeout_s: float = 120.0
    method: str = PUBLISH_METHOD    # the worker method (the extension's)

    @classmethod
    def locate(cls) -> "ServerExpertMaps | None":
        """The reader for this process, or None where it is not a Ray actor (no deployment);
        raises PlanError in a Ray actor that no verl vLLM server lists as one of its workers."""
        if "ray" not in sys.modules:       # a Ray actor has imported Ray long before any sync
            return None
        import ray
        if not ray.is_initialized():
            return None
        context = ray.get_runtime_context()
        if context.get_actor_id() is None:
            return None
        me = context.current_actor
        names = sorted(n for n in ray.util.list_named_actors() if SERVER_NAME.match(n))
        for name in names:
            server = ray.get_actor(name)
            index = ray.get(server.__ray_call__.remote(_index_of, me), timeout=cls.timeout_s)
            if index >= 0:
                return cls(server, name, index)
        raise PlanError(f"this checkpoint-engine worker is listed by none of verl's vLLM servers {names} "
                        "(expert maps cannot be read from the live engine; engine_kwargs."
                        "ascend_rl_alltoallv.expert_maps=config uses the placement rule instead)")

    def __call__(self) -> tuple[int, ...]:
        import ray
        directory = tempfile.mkdtemp(prefix="ascend-rl-expert-map-")
        try:
            try:
                ray.get(self.server.collective_rpc.remote(
                    self.method, timeout=self.timeout_s,
                    kwargs={"directory": directory, "weight_sync_rank": self.weight_sync_rank}))
            except Exception as exc:  # noqa: BLE001 -- the reason is what the refusal says
                missing = self.method in str(exc)   # the workers have no such method
                raise PlanError(
                    f"{self.server_name}'s vLLM workers cannot report their expert maps"
                    + (f" (set {EXTENSION_LINE})" if missing else f": {type(exc).__name__}: {str(exc)[-300:]}")
                ) from exc
            path = os.path.join(directory, ANSWER)
            if not os.path.exists(path):
                raise PlanError(f"no vLLM worker of {self.server_name} has weight-sync rank {self.weight_sync_rank}")
            with open(path) as f:
                answer = PublishedExpertMap(**json.load(f))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if answer.expert_map is None:
            raise PlanError(f"{self.server_name} worker {answer.weight_sync_rank}: {answer.error}")
        return tuple(answer.expert_map)


__all__ = ["ANSWER", "EXTENSION", "EXTENSION_LINE", "PUBLISH_METHOD", "PublishedExpertMap", "ServerExpertMaps"]
