"""The run-time half of on-policy old log-probs (imported by the patches when they act)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

from . import ACK, MARK


@dataclass
class Counter:
    """Old-log-prob passes this process skipped (for logs and tests)."""

    skipped: int = 0


SKIPPED = Counter()


def placeholder_log_prob(temperature: float):
    """What the actor worker group's ``compute_log_prob`` returns instead of a forward pass:
    NaN ``old_log_probs`` and ``entropys`` shaped like the responses (the trainer reads both,
    and logs ``actor/entropy`` from the latter: NaN says it was not computed), the
    ``temperature`` the update needs in ``meta_info`` (the real method puts it there) and the
    marker that makes the Megatron actor's loss use ``log_prob.detach()``. NaN, not zeros: a
    worker without the plugin would fail loudly on them instead of training on wrong numbers."""

    def compute_log_prob(data, *args, **kwargs):
        import torch
        from verl.protocol import DataProto
        nan = torch.full(tuple(data.batch["responses"].shape), float("nan"), dtype=torch.float32)
        SKIPPED.skipped += 1
        return DataProto.from_dict(tensors={"old_log_probs": nan, "entropys": nan.clone()},
                                   meta_info={"temperature": temperature, MARK: True})

    compute_log_prob.__name__ = "compute_log_prob"
    compute_log_prob.ascend_rl_skipped = True
    return compute_log_prob


_UNSET = object()


def acknowledged(metrics) -> bool:
    """Did the actor's loss report that it used ``log_prob.detach()`` (the Megatron actor
    patch adds :data:`ACK` to its loss metrics)?"""
    if isinstance(metrics, dict):
        return ACK in metrics
    return any(isinstance(m, dict) and ACK in m for m in metrics or ())


def checked_update(update_actor):
    """The worker group's ``update_actor``, refusing to go on when the Megatron workers did not
    apply this feature (their loss then saw the NaN placeholders: a NaN loss and a zero policy
    gradient in that first update)."""

    def update(*args, **kwargs):
        out = update_actor(*args, **kwargs)
        if not acknowledged(out.meta_info.get("metrics")):
            raise RuntimeError(
                "ascend-rl onpolicy_old_logprob: the trainer skipped the old-log-prob pass, but the Megatron "
                "actor workers did not use log_prob.detach() (their loss saw NaN placeholders). Load "
                "ascend-rl in the workers too: VERL_USE_EXTERNAL_MODULES=ascend_rl_plugins and "
                "ASCEND_RL_ONPOLICY_OLD_LOGPROB=1 in the Ray workers' environment (runtime_env env_vars).")
        return out

    update.__name__ = "update_actor"
    return update


@contextlib.contextmanager
def skipping_old_log_prob(trainer):
    """While ``trainer.fit`` runs, its actor worker group's ``compute_log_prob`` (an attribute
    verl binds per worker-group instance) is the placeholder, and with the Megatron actor its
    ``update_actor`` checks the workers' acknowledgement; both restored afterwards."""
    wg = trainer.actor_rollout_wg
    replaced = {"compute_log_prob": placeholder_log_prob(trainer.config.actor_rollout_ref.rollout.temperature)}
    if trainer.config.actor_rollout_ref.actor.get("strategy") == "megatron":
        replaced["update_actor"] = checked_update(wg.update_actor)
    before = {name: vars(wg).get(name, _UNSET) for name in replaced}
    for name, fn in replaced.items():
        setattr(wg, name, fn)
    try:
        yield
    finally:
        for name, old in before.items():
            if old is _UNSET:
                delattr(wg, name)
            else:
                setattr(wg, name, old)


def bind_forward_backward(self_or_data=None, *args, **kwargs):
    """``(data, forward_only)`` from a ``MegatronPPOActor.forward_backward_batch`` call (the
    instance is already bound: the first argument is ``data``)."""
    data = kwargs["data"] if "data" in kwargs else self_or_data
    forward_only = kwargs["forward_only"] if "forward_only" in kwargs else (args[0] if args else False)
    return data, bool(forward_only)


def on_policy(loss_fn):
    """``loss_fn`` (a verl policy loss: ``old_log_prob, log_prob, advantages, ...`` returning
    ``(loss, metrics)``) called with ``old_log_prob = log_prob.detach()``; its metrics carry
    :data:`ACK` so the trainer knows the workers did it."""

    @functools.wraps(loss_fn)
    def loss(*args, **kwargs):
        if "log_prob" in kwargs:
            kwargs["old_log_prob"] = kwargs["log_prob"].detach()
            if args:  # old_log_prob given positionally, log_prob by keyword
                args = args[1:]
        elif len(args) >= 2:
            args = (args[1].detach(),) + tuple(args[1:])
        else:
            raise TypeError("ascend-rl onpolicy_old_logprob: the policy loss was called without log_prob")
        pg_loss, metrics = loss_fn(*args, **kwargs)
        return pg_loss, {**metrics, ACK: 1.0}

    return loss
