"""verl 0.6.1 hooks: ``per_tensor_generator`` with experts from the reshard, and the rollout's
``update_weights`` that gives the generator its vLLM model and re-runs post-load processing.

How verl 0.6.1 syncs weights (``ActorRolloutRefWorker.rollout_mode`` in
``verl/workers/megatron_workers.py``): it builds the generator ``per_tensor_generator(...)``
(lazy: nothing runs yet) and awaits ``self.rollout.update_weights(generator)``, which calls
vLLM's ``model.load_weights(generator)`` in the same process (hybrid engine, colocated). So by
the time the generator's body runs, ``update_weights`` has been entered and the vLLM model is
known: :func:`update_weights` publishes it (:data:`LIVE`), :func:`generator` reads it.

The generator, on every rank together:

1. decides, collectively (``agreement.py``): the model has experts, a vLLM MoE model is live in
   this process, vLLM's rollout rank equals the global rank (colocated), Megatron's rank
   coordinates match the layout the planner assumes, the plan (cached by its input digest) is
   valid and every rank plans from the same digest. Each step runs under ``agreement.attempt``
   (any exception becomes a reason) and the votes are all-gathered: if any rank cannot take
   part, every rank falls back to the stock generator (one-line reason logged; an error under
   ``ASCEND_RL_MOE_RESHARD=on``) -- never a partial sync, never a rank left waiting;
2. yields the experts from ``executor.reshard_experts``: whole experts under rollout expert
   parallelism (through vLLM's own loader, which places them by its expert map); without
   expert parallelism the executor delivers the rank's narrow, which is written straight into
   the fused parameter (``vllm_side.load_pre_narrowed``) since vLLM's loader would narrow again;
3. yields verl's own stock generator over a dense-only view of the model (expert parameters
   hidden), so the dense tensors are exactly stock's (experts go first so that no collective
   of the dense path runs while reshard rounds are in flight).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

from ...patching.fallback import fall_back


@dataclass
class _Live:
    """The vLLM model ``update_weights`` is loading into (this process), if any, and a rollout
    layout declared by the caller (:func:`declare_rollout`) for when no model is reachable."""
    model: Any = None
    vllm_config: Any = None
    declared: Any = None


LIVE = _Live()


@contextlib.contextmanager
def declare_rollout(layout):
    """Use ``layout`` (a ``RolloutLayout`` over the whole world, rollout rank = global rank) when
    no vLLM model is being loaded in this process -- e.g. a colocated rollout whose engine the
    generator cannot reach, with the layout built from its config (``RolloutLayout.linear`` /
    ``round_robin``, vLLM's ``expert_placement_strategy``). Only expert-parallel layouts: a
    tensor-parallel narrow can only be written into a live model."""
    old = LIVE.declared
    LIVE.declared = layout
    try:
        yield
    finally:
        LIVE.declared = old


@contextlib.contextmanager
def live_model(model, vllm_config):
    old = (LIVE.model, LIVE.vllm_config)
    LIVE.model, LIVE.vllm_config = model, vllm_config
    try:
        yield
    finally:
        LIVE.model, LIVE.vllm_config = old


# -- update_weights ----------------------------------------------------------------------

def _lora_only(args, kwargs) -> bool:
    return bool(kwargs.get("peft_config")) and bool(kwargs.get("base_sync_done"))


async def _update_weights(wrapped, instance, args, kwargs):
    from . import POST_LOAD, vllm_side
    runner = vllm_side.model_runner_of(instance)
    model = getattr(runner, "model", None)
    if model is None or _lora_only(args, kwargs) or not vllm_side.fused_moe_layers(model):
        return await wrapped(*args, **kwargs)
    vllm_config = runner.vllm_config
    with live_model(model, vllm_config):
        if not POST_LOAD.value:
            return await wrapped(*args, **kwargs)
        with vllm_side.reload_session(model, vllm_config):
            return await wrapped(*args, **kwargs)


def update_weights(wrapped, instance, args, kwargs):
    """The patched (async) ``update_weights`` of verl 0.6.1's vLLM rollouts."""
    return _update_weights(wrapped, instance, args, kwargs)


# -- per_tensor_generator ------------------------------------------------------------------

class DenseOnly:
    """A view of a Megatron model chunk without its routed-expert parameters: verl's generator
    reads only ``named_parameters()`` and ``state_dict()`` of the unwrapped chunk."""

    def __init__(self, module):
        self._module = module

    @staticmethod
    def is_expert(name: str) -> bool:
        from .layout import parse_megatron_name
        return parse_megatron_name(name) is not None

    def named_parameters(self, *args, **kwargs):
        return ((n, p) for n, p in self._module.named_parameters(*args, **kwargs) if not self.is_expert(n))

    def state_dict(self, *args, **kwargs):
        sd = self._module.state_dict(*args, **kwargs)
        for name in [n for n in sd if self.is_expert(n)]:
            del sd[name]
        return sd


def expert_impl_of(model) -> str | None:
    """``sequential`` / ``grouped`` / ``te_grouped``: how the model stores its experts, read from
    its parameter names (what the executor parses), None without routed experts."""
    from .layout import parse_megatron_name
    for name, _ in model.named_parameters():
        parsed = parse_megatron_name(name)
        if parsed is not None:
            return parsed.impl
    return None


def moe_layers(transformer_config) -> tuple[int, ...] | None:
    """Global ids of the MoE layers (Megatron's ``moe_layer_freq``: an int period or a 0/1 list)."""
    freq = getattr(transformer_config, "moe_layer_freq", 1)
    n = transformer_config.num_layers
    if isinstance(freq, int):
        return None if freq == 1 else tuple(i for i in range(n) if i % freq == 0)
    return tuple(i for i, v in enumerate(freq) if v)


def local_expert_params(actor_module, transformer_config) -> dict:
    """This rank's expert parameters keyed by global-layer Megatron names (verl's own
    ``normalize_model_name`` turns PP/VPP-local layer numbers into global ones)."""
    from megatron.core import parallel_state as mpu
    from verl.utils.megatron_utils import unwrap_model
    from verl.utils.model import normalize_model_name

    from .layout import parse_megatron_name
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    out = {}
    for vpp, chunk in enumerate(actor_module):
        for name, param in unwrap_model(chunk).named_parameters():
            if parse_megatron_name(name) is None:
                continue
            full = normalize_model_name(name, pp_rank, vpp, transformer_config)
            while full.startswith("module."):
                full = full[len("module."):]
            out[full] = param.detach()
    return out


@dataclass
class Setup:
    """Everything the reshard needs, or why it cannot run on this rank."""
    reason: str = ""
    shape: Any = None
    training: Any = None
    rollout: Any = None
    narrowed: bool = False


def _setup(actor_module, transformer_config) -> Setup:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from verl.utils.megatron_utils import unwrap_model

    from . import vllm_side
    from .layout import MoEShape, TrainingLayout
    from .planner import PlanError

    model, declared = LIVE.model, LIVE.declared
    rank, world = dist.get_rank(), dist.get_world_size()
    if model is None and declared is None:
        return Setup("no vLLM MoE model is being loaded in this process (the reshard needs verl's "
                     "colocated rollout update_weights) and no rollout layout was declared")
    if model is None:
        if not declared.expert_parallel or declared.world_size() != world:
            return Setup("a declared rollout layout must be expert-parallel over the whole world")
        hosted, ep = declared.hosted(MoEShape(1, transformer_config.num_moe_experts, 1, 1), rank), True
        rr = vllm_side.RolloutRank(declared.tp, declared.dp, rank % declared.tp, rank // declared.tp)
    else:
        try:
            hosted = vllm_side.local_expert_map(model)
            ep = vllm_side.uses_expert_parallel(model)
            rr = vllm_side.rollout_rank()
        except (ValueError, AttributeError, RuntimeError, AssertionError) as exc:
            return Setup(f"cannot read the rollout layout: {exc}")
    if rr.rank != rank or rr.tp * rr.dp != world:
        return Setup(f"rollout rank {rr.rank} of {rr.tp * rr.dp} is not global rank {rank} of {world} "
                     "(the reshard needs a colocated rollout over the whole world)")
    first = unwrap_model(actor_module[0])
    impl = expert_impl_of(first)
    if impl is None:
        return Setup("no SequentialMLP / GroupedMLP / TEGroupedMLP experts in the training model")
    cfg = transformer_config
    shape = MoEShape(num_layers=cfg.num_layers, num_experts=cfg.num_moe_experts, hidden=cfg.hidden_size,
                     ffn_hidden=cfg.moe_ffn_hidden_size, moe_layers=moe_layers(cfg),
                     dtype_bytes=next(first.parameters()).element_size())
    try:
        training = TrainingLayout(
            tp=mpu.get_tensor_model_parallel_world_size(), pp=mpu.get_pipeline_model_parallel_world_size(),
            ep=mpu.get_expert_model_parallel_world_size(), etp=mpu.get_expert_tensor_parallel_world_size(),
            cp=mpu.get_context_parallel_world_size(), vpp=len(actor_module), expert_impl=impl).with_world(world)
        coords = training.coords(rank)
    except (ValueError, PlanError) as exc:
        return Setup(f"training layout: {exc}")
    actual = {"tp": mpu.get_tensor_model_parallel_rank(), "pp": mpu.get_pipeline_model_parallel_rank(),
              "ep": mpu.get_expert_model_parallel_rank(), "etp": mpu.get_expert_tensor_parallel_rank()}
    if any(coords[k] != v for k, v in actual.items()):
        return Setup(f"Megatron's rank coordinates {actual} are not the planner's {coords} "
                     "(a rank order other than tp-cp-ep-dp-pp)")
    narrowed = not ep and world > 1
    if narrowed and model is not None and not vllm_side.checkpoint_layout(model, cfg.hidden_size):
        return Setup("the fused expert weights are not in checkpoint layout [E, 2I, H] / [E, H, I] "
                     "(a platform transposed them after loading), so a pre-narrowed slice cannot be "
                     "written into them")
    return Setup(shape=shape, training=training, narrowed=narrowed, rollout=(hosted, ep, rr.tp, rr.dp))


def _agree(setup: Setup) -> Setup:
    """All ranks decide together (``agreement.decide``): the expert maps of every rollout rank
    are gathered, and any rank's reason makes every rank fall back."""
    from . import agreement
    from .layout import RolloutLayout
    outcome = agreement.decide(agreement.Vote(setup.reason, payload=setup.rollout))
    if outcome.reason:
        return Setup(outcome.reason)
    every = [v.payload for v in outcome.votes]
    hosted, ep, tp, dp = setup.rollout
    if any(e[1:] != (ep, tp, dp) for e in every):
        return Setup("rollout ranks disagree on expert parallelism or tp/dp")
    layout, why = agreement.attempt("rollout layout", lambda: RolloutLayout.from_expert_maps(tp, dp, [e[0] for e in every])
                                    if ep else RolloutLayout(tp, dp, False))
    setup.rollout, setup.reason = layout, why    # the same on every rank: built from gathered data
    return setup


def fall_back_to_stock(reason: str) -> None:
    """Every rank has agreed the reshard cannot run (``reason``): an error under
    ``ASCEND_RL_MOE_RESHARD=on``, else one WARNING and the caller's stock path."""
    from . import MODE
    if MODE.value == "on":
        raise RuntimeError(f"ASCEND_RL_MOE_RESHARD=on but the expert reshard cannot run: {reason}")
    fall_back("moe_reshard", "stock weight sync", reason)


def generator(wrapped, args, kwargs) -> Iterator[tuple[str, Any]]:
    """The patched ``per_tensor_generator`` (a generator, like the original)."""
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if not getattr(a["transformer_config"], "num_moe_experts", None):
        return wrapped(*args, **kwargs)
    return _generate(wrapped, a)


def _generate(wrapped, a: dict) -> Iterator[tuple[str, Any]]:
    from . import agreement, bucket_bytes, vllm_side
    from .executor import prepare_reshard

    actor_module, cfg = a["actor_module"], a["transformer_config"]
    # every step before the first exchange runs under attempt(): a rank that fails votes, it
    # never leaves the others waiting in decide() (a deadlock) or takes another path (a partial sync)
    setup, why = agreement.attempt("setup", _setup, actor_module, cfg)
    setup = _agree(setup if setup is not None else Setup(why))
    prepared = None
    if not setup.reason:
        prepared, why = agreement.attempt(  # planning (cached) and validation: no communication
            "plan", lambda: prepare_reshard(local_expert_params(actor_module, cfg), shape=setup.shape,
                                            training=setup.training, rollout=setup.rollout,
                                            bucket_bytes=bucket_bytes()))
        setup.reason = agreement.decide(agreement.Vote(why, prepared.key if prepared else "")).reason
    if setup.reason:
        fall_back_to_stock(setup.reason)
        yield from wrapped(**a)
        return
    model, layers = LIVE.model, None
    for name, tensor in prepared.stream():  # experts first: no collective of the dense path interleaves a round
        if setup.narrowed:
            layers = layers or vllm_side.fused_moe_layers(model)
            vllm_side.load_pre_narrowed(model, name, tensor, layers)
        else:
            yield name, tensor
    yield from wrapped(**dict(a, actor_module=[DenseOnly(_unwrapped(m)) for m in actor_module]))


def _unwrapped(chunk):
    from verl.utils.megatron_utils import unwrap_model
    return unwrap_model(chunk)
