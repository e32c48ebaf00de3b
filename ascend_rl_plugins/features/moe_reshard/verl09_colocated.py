"""verl 0.9 colocated (``checkpoint_engine.backend: naive``) weight sync with the MoE reshard.

How verl 0.9.1 syncs a colocated rollout (read in ``verl/checkpoint_engine/base.py`` and
``verl/workers/engine_workers.py``): ``CheckpointEngineManager.update_weights`` calls no checkpoint
engine for ``naive``; it asks every trainer worker for ``update_weights(mode="naive")``, which
resumes the rollout's weights, takes ``self.actor.engine.get_per_tensor_param(layered_summon=...,
base_sync_done=True)`` and hands that generator to ``self.rollout.update_weights`` -- the vLLM
``ServerAdapter``, which streams it in buckets over a node-local ZMQ socket into the vLLM worker
on the same device (``update_weights_from_ipc``). Stock ``get_per_tensor_param`` is
Megatron-Bridge's ``export_hf_weights``: every expert gathered over EP to every trainer rank,
so every vLLM worker is handed every expert and keeps the few its expert map hosts. There is no
upstream extension point on this path (the checkpoint-engine registry is not consulted for
``naive``), so the feature patches it, in two narrow pieces:

- ``moe_reshard.hand_training_engine`` (the worker's ``update_weights``): in its ``naive``
  branch it only opens a :func:`scope` for the duration of that call, carrying this trainer
  rank's co-located rollout rank (:class:`ColocatedRollout`, read from the worker's rollout
  config and its ``ServerAdapter``);
- ``moe_reshard.colocated_export`` (``MegatronEngine.get_per_tensor_param``): inside such a
  scope, and only there, :func:`export` replaces the stock export. Every other caller -- the
  checkpoint-engine backends' ``send_weights`` hand-off, ``delta_sharded``, the backend's own
  fallback -- calls it outside any scope and gets the stock export unchanged.

Which trainer rank feeds which vLLM worker (verl 0.9.1 hybrid mode): ``RolloutReplica.init_hybrid``
gives replica ``k`` the trainer workers ``[k*W, (k+1)*W)`` (``W`` = the rollout's
``tensor_model_parallel_size * data_parallel_size * pipeline_model_parallel_size``), and
``ServerAdapter`` sets ``replica_rank = RANK // W``, ``rollout_rank = RANK % W`` and sends to the
vLLM worker of that local rank. So trainer rank ``r`` feeds rollout rank ``r % W`` of replica
``r // W``, and the rollout's ranks are the trainer's ranks: the reshard runs over the trainer's
own default process group with senders = receivers (``RolloutLayout.first_rank = 0``, as on verl
0.6.1's hybrid engine).

What :func:`export` does, on every trainer rank together, at the call:

1. votes (``agreement.decide`` over the trainer's default group): this rank's expert geometry
   and training layout (``verl09_backend.trainer_setup``) and the experts its co-located vLLM
   worker hosts -- vLLM's placement rule for its rank within its replica (``expert_parallel_size``,
   ``engine_kwargs.vllm.expert_placement_strategy``); any reason on any rank is every rank's;
2. plans from the gathered votes (``executor.prepare_reshard``: cached by input digest,
   validated) and votes again on the plan key;
3. returns ``(stream, None)``: the stream yields this rank's hosted experts from the reshard's
   all-to-alls (run while verl's adapter consumes it; every rank consumes its whole stream), then
   the dense tensors from the bridge's export of its non-expert tasks
   (``verl09_backend.bridge_dense_export``).

A refusal anywhere: every rank returns the stock export (``fall_back_to_stock``: one WARNING
naming the rank and reason; under ``ASCEND_RL_MOE_RESHARD=on`` a RuntimeError on every rank).

Expert maps come from the rollout configuration, not from the live vLLM worker (which is another
process here, reachable only through the replica's server on rollout rank 0): a configuration
with vLLM EPLB (``enable_eplb``), whose maps move at run time (verl #7086's stale expert ids), is
refused with that reason rather than synced from a map that may be stale.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .layout import PLACEMENTS
from .planner import PlanError


@dataclass(frozen=True)
class ColocatedRollout:
    """The vLLM worker one trainer rank feeds in verl 0.9.1's hybrid mode: its rank within its
    replica (``rollout_rank``), the replica's ranks (``tp * dp``), whether vLLM spreads the
    experts over them (``expert_parallel``) and by which rule (``placement``). ``reason`` is set
    instead when the configuration is one the colocated reshard does not serve (it is this
    rank's vote against)."""
    rollout_rank: int = 0
    tp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    placement: str = "linear"
    reason: str = ""

    @property
    def replica_world_size(self) -> int:
        return self.tp * self.dp

    @classmethod
    def from_config(cls, rollout_config, rollout_rank: int) -> "ColocatedRollout":
        """From verl's ``actor_rollout_ref.rollout`` config (an OmegaConf node or ``RolloutConfig``)."""
        def get(key, default=None):
            getter = getattr(rollout_config, "get", None)
            value = getter(key, default) if callable(getter) else getattr(rollout_config, key, default)
            return default if value is None else value
        tp, dp, pp = (int(get("tensor_model_parallel_size", 1)), int(get("data_parallel_size", 1)),
                      int(get("pipeline_model_parallel_size", 1)))
        vllm_kwargs = (get("engine_kwargs", {}) or {}).get("vllm", {}) or {}
        placement = vllm_kwargs.get("expert_placement_strategy") or "linear"
        ep = int(get("expert_parallel_size", 1) or 1)
        base = cls(rollout_rank, tp, dp, ep > 1, placement)
        disaggregation = get("disaggregation", None)
        why = ""
        if get("name", "vllm") != "vllm":
            why = f"rollout.name={get('name')!r}: the colocated reshard feeds vLLM workers only"
        elif disaggregation is not None and (disaggregation.get("enabled", False) if hasattr(disaggregation, "get")
                                             else getattr(disaggregation, "enabled", False)):
            why = ("prefill/decode-disaggregated rollout replicas are not served (a replica runs a prefill and "
                   "decode engines of their own sizes, not one engine of rank r % W per trainer rank r)")
        elif pp > 1:
            why = f"rollout pipeline_model_parallel_size={pp}: vLLM pipeline stages are not served"
        elif vllm_kwargs.get("enable_eplb"):
            why = ("rollout.engine_kwargs.vllm.enable_eplb: vLLM moves experts at run time and the colocated "
                   "reshard reads expert maps from the configuration (a stale map is verl #7086)")
        elif placement not in PLACEMENTS:
            why = (f"rollout.engine_kwargs.vllm.expert_placement_strategy must be one of {PLACEMENTS}, "
                   f"got {placement!r}")
        elif not base.expert_parallel and tp > 1:
            why = ("rollout without expert parallelism at tensor_model_parallel_size > 1 narrows every expert "
                   "over TP; the colocated reshard serves expert-parallel rollouts (or TP 1)")
        elif not 0 <= rollout_rank < tp * dp:
            why = f"rollout rank {rollout_rank} is outside its replica of {tp * dp} ranks"
        return cls(rollout_rank, tp, dp, base.expert_parallel, placement, why)

    @classmethod
    def from_worker(cls, worker) -> "ColocatedRollout":
        """From verl 0.9.1's ``ActorRolloutRefWorker``: its rollout config and its rollout
        adapter's ``rollout_rank`` (``ServerAdapter``: ``RANK % W``)."""
        rank = getattr(getattr(worker, "rollout", None), "rollout_rank", None)
        if rank is None:
            return cls(reason=f"the worker's rollout {type(getattr(worker, 'rollout', None)).__name__} has no "
                              "rollout_rank (not verl's vLLM ServerAdapter)")
        return cls.from_config(worker.config.rollout, int(rank))

    def expert_map(self, num_experts: int) -> tuple[int, ...]:
        """The experts this rank's vLLM worker hosts, in local-slot order."""
        from .layout import placement_map
        if not self.expert_parallel:
            return tuple(range(num_experts))
        return placement_map(self.placement, self.replica_world_size, self.rollout_rank, num_experts)


_SCOPE: contextvars.ContextVar[ColocatedRollout | None] = contextvars.ContextVar("ascend_rl_colocated", default=None)


@contextlib.contextmanager
def scope(rollout: ColocatedRollout):
    """Marks a colocated (``naive``) weight sync of this trainer rank, feeding ``rollout``: the
    engine's export called inside it is the resharded one. A context variable: it follows the
    ``update_weights`` coroutine (its task) and nothing else."""
    token = _SCOPE.set(rollout)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def current() -> ColocatedRollout | None:
    return _SCOPE.get()


@dataclass
class ColocatedSync:
    """What the last colocated export did on this rank (tests and logs read it)."""
    resharded: bool = False
    reason: str = ""
    plan_key: str = ""
    plan_cached: bool = False
    expert_map: tuple = ()
    experts: list = field(default_factory=list)   # expert tensors yielded from the reshard, by name
    dense: list = field(default_factory=list)     # dense tensors yielded, by name


@dataclass
class _LastSync:
    """The one owner of this process's last :class:`ColocatedSync` (``reset`` for tests)."""
    sync: ColocatedSync | None = None

    def reset(self) -> None:
        self.sync = None


LAST = _LastSync()


@dataclass(frozen=True)
class ColocatedVote:
    """One trainer rank's vote payload: what it trains (``verl09_backend.TrainerVote``) and the
    experts its co-located vLLM worker hosts."""
    trainer: Any
    expert_map: tuple[int, ...]


def _setup(engine, stock: Callable[[], Any], rollout: ColocatedRollout):
    import torch.distributed as dist

    from .verl09_backend import TrainingSource, bridge_dense_export, trainer_setup
    if rollout.reason:
        raise PlanError(rollout.reason)
    if getattr(engine, "peft_cls", None) is not None:
        raise PlanError("LoRA engine: the colocated reshard moves full weights, not adapters")
    world = dist.get_world_size()
    if world % rollout.replica_world_size:
        raise PlanError(f"the trainer's {world} ranks are not whole rollout replicas of {rollout.replica_world_size}")
    for attr in TrainingSource.ENGINE_ATTRIBUTES:
        if not hasattr(engine, attr):
            raise PlanError(f"the training engine {type(engine).__name__} has no {attr}")

    def full():
        return stock()[0]
    source = TrainingSource(list(engine.module), engine.tf_config, full, bridge_dense_export(engine, full))
    vote, params = trainer_setup(source, dist.get_rank())
    return source, params, ColocatedVote(vote, rollout.expert_map(vote.shape.num_experts))


def export(engine, stock: Callable[[], tuple], rollout: ColocatedRollout) -> tuple:
    """The patched ``get_per_tensor_param`` inside a colocated sync (module docstring): collective
    over the trainer's default group. ``stock`` calls the unpatched export with verl's arguments."""
    import torch

    from . import agreement, bucket_bytes
    from .executor import prepare_reshard
    from .hooks_verl06 import fall_back_to_stock
    from .verl09_backend import agreed_inputs
    report = ColocatedSync()
    LAST.sync = report
    got, why = agreement.attempt("setup", _setup, engine, stock, rollout)
    source, params, vote = got if got is not None else (None, {}, None)
    outcome = agreement.decide(agreement.Vote(why, payload=vote))
    reason, prepared = outcome.reason, None
    if not reason:
        votes = [v.payload for v in outcome.votes]    # the same on every rank: built from gathered data
        agreed, reason = agreement.attempt("layouts", agreed_inputs, [v.trainer for v in votes],
                                           [v.expert_map for v in votes], 0)
    if not reason:
        report.expert_map = vote.expert_map
        prepared, why = agreement.attempt(
            "plan", lambda: prepare_reshard(params, shape=agreed.shape, training=agreed.training,
                                            rollout=agreed.rollout, bucket_bytes=bucket_bytes(),
                                            dtype=getattr(torch, agreed.dtype)))
        reason = agreement.decide(agreement.Vote(why, prepared.key if prepared else "")).reason
    if reason:
        report.reason = reason
        fall_back_to_stock(reason)
        return stock()
    report.resharded, report.plan_key, report.plan_cached = True, prepared.key, prepared.cached
    return _stream(prepared, source, report), None


def _stream(prepared, source, report: ColocatedSync) -> Iterator[tuple[str, Any]]:
    # experts first: no collective of the dense export interleaves a reshard round
    for name, tensor in prepared.stream():
        report.experts.append(name)
        yield name, tensor
    for name, tensor in source.dense_tensors():
        report.dense.append(name)
        yield name, tensor


def patched_export(wrapped, instance, args, kwargs):
    """The ``moe_reshard.colocated_export`` wrapper: the stock export outside a colocated scope.
    Inside one, the stock export stays reachable only through ``wrapped`` (the fallback, FP8's
    dense export), never through the patched method again."""
    rollout = current()
    if rollout is None or not getattr(getattr(instance, "tf_config", None), "num_moe_experts", None):
        return wrapped(*args, **kwargs)      # not a colocated sync, or a dense model: nothing to reshard
    return export(instance, lambda: wrapped(*args, **kwargs), rollout)


__all__ = ["ColocatedRollout", "ColocatedSync", "LAST", "current", "export", "patched_export", "scope"]
