"""On-policy old log-probs: no extra forward pass for them when the update is on-policy.

PPO's loss needs ``old_log_prob``, the log-probs of the policy that generated the batch. When
each rollout batch makes exactly one optimizer step (``ppo_epochs == 1`` and one mini-batch),
that policy *is* the one being trained at the moment its loss is computed, so
``old_log_prob == log_prob.detach()`` exactly and verl 0.6's separate forward pass over the
whole batch (``actor_rollout_wg.compute_log_prob``) computes nothing the loss needs. The
recipe's verl patch 0003 skipped that pass behind an actor config key; this feature does it
from outside (verl 0.6.1):

- config time: ``verl.utils.config.validate_config`` (and again when ``RayPPOTrainer.fit``
  starts) refuses, naming the config keys, anything that is not one optimizer step per rollout
  batch or that reads ``old_log_probs`` for something else (KL in reward, rollout correction);
- trainer: for the duration of ``RayPPOTrainer.fit``, the actor worker group's
  ``compute_log_prob`` is a local function returning NaN placeholders (and ``temperature``, and
  a marker in ``meta_info``) instead of a remote forward pass;
- Megatron actor: while ``MegatronPPOActor.forward_backward_batch`` updates on a marked batch,
  the policy loss gets ``old_log_prob = log_prob.detach()`` and reports it in its metrics (FSDP's
  actor already uses ``log_prob.detach()`` by itself when it sees one mini-batch and one
  epoch). Megatron workers without the plugin see NaN placeholders (NaN loss, zero gradient)
  and the trainer stops with an error naming the fix after that first, empty update.

README.md beside this file: why, flags, verified where, how it differs from verl 0.9's
``algorithm.rollout_correction.bypass_mode``.

Remove when: verl skips the old-log-prob pass for on-policy updates itself.
"""

from __future__ import annotations

import contextvars

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_ONPOLICY_OLD_LOGPROB", "bool", False,
    "verl 0.6: skip the old-log-prob forward pass and use log_prob.detach() as the old log-prob "
    "(on-policy GRPO/PPO: ppo_epochs=1 and ppo_mini_batch_size=data.train_batch_size; refused "
    "at config time otherwise).", feature="onpolicy_old_logprob")

FEATURE = Feature(
    "onpolicy_old_logprob", "On-policy PPO/GRPO without the old-log-prob forward pass (verl 0.6).",
    flag=ENABLE, replaces="the recipe's verl patch 0003-verl-feature-recompute_old_log_prob",
    verified=Verified(
        cpu_runtime="verl 0.6.1's real validate_config, RayPPOTrainer.__init__ and one real fit() step "
                    "(worker groups doubled), and the real MegatronPPOActor.forward_backward_batch on a "
                    "tiny real Megatron-Core GPT (1 gloo rank; verl's THD-packing forward doubled)",
        doubles="the Ray worker groups of the trainer; verl's packed-sequence model forward (needs "
                "TransformerEngine)",
        static="verl 0.9.1 has no MegatronPPOActor; its bypass mode is a different algorithm"),
    stacks="recipe")

FEATURE.does_not_apply(
    dist="verl", versions=">=0.9",
    why="verl 0.9 has no MegatronPPOActor and no RayPPOTrainer old-log-prob call to skip; set "
        "algorithm.rollout_correction.bypass_mode=True instead (it uses the rollout engine's "
        "log-probs as old log-probs: not the same numbers, see this feature's README)")

MARK = "ascend_rl_onpolicy_old_logprob"  # meta_info key the trainer sets on batches it skipped
ACK = "actor/onpolicy_old_logprob"  # loss metric the Megatron workers report when they used it
VERL_RANGE = ">=0.6,<0.7"
REMOVE_WHEN = "verl skips the old-log-prob forward pass for on-policy updates itself"

# set while a Megatron actor updates on a marked batch (same thread as its loss function)
ON_POLICY_UPDATE: contextvars.ContextVar[bool] = contextvars.ContextVar("ascend_rl_on_policy_update",
                                                                         default=False)


class OnPolicyConfigError(ValueError):
    """The training configuration is not one optimizer step per rollout batch."""


def _get(config, path: str, default=None):
    node = config
    for part in path.split("."):
        if node is None:
            return default
        getter = getattr(node, "get", None)
        node = getter(part, None) if callable(getter) else getattr(node, part, None)
    return default if node is None else node


def problems(config) -> list[str]:
    """Why ``config`` (verl's trainer config) is not an on-policy update, one line per key."""
    out = []
    epochs = _get(config, "actor_rollout_ref.actor.ppo_epochs", 1)
    if epochs != 1:
        out.append(f"actor_rollout_ref.actor.ppo_epochs={epochs}: must be 1 (a second epoch updates with a "
                   f"policy that already changed: off-policy)")
    mini = _get(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    train = _get(config, "data.train_batch_size")
    rollout = _get(config, "data.gen_batch_size", train)
    if mini is None or train is None or mini != rollout:
        n = _get(config, "actor_rollout_ref.rollout.n", 1)
        split = (f"with {rollout // mini} mini-batches the 2nd and later are computed by a policy the 1st "
                 f"already updated: off-policy" if mini and rollout and mini < rollout
                 else "one optimizer step per rollout batch")
        out.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}: must equal the prompts per rollout "
                   f"batch, data.train_batch_size={train}"
                   + ("" if rollout == train else f" (data.gen_batch_size={rollout})")
                   + f", i.e. {rollout} x rollout.n={n} sequences in one optimizer step ({split})")
    if _get(config, "algorithm.use_kl_in_reward", False):
        out.append("algorithm.use_kl_in_reward=True: must be False (the in-reward KL penalty reads the old "
                   "log-probs this feature does not compute; use actor_rollout_ref.actor.use_kl_loss=True)")
    corr = _get(config, "algorithm.rollout_correction")
    if corr is not None:
        if _get(corr, "bypass_mode", False):
            out.append("algorithm.rollout_correction.bypass_mode=True: must be False (bypass mode already "
                       "skips the pass, with the rollout's log-probs as old log-probs; choose one)")
        for key in ("rollout_is", "rollout_rs"):
            if _get(corr, key) is not None:
                out.append(f"algorithm.rollout_correction.{key}={_get(corr, key)}: must be null (importance "
                           f"weights against the rollout policy need the recomputed old log-probs)")
    loss_mode = _get(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    if loss_mode == "rollout_correction":
        out.append("actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction: its old_log_prob is the "
                   "rollout's log-prob, not the policy's")
    return out


def check(config) -> None:
    """Raise :class:`OnPolicyConfigError` naming every offending key and the accepted values."""
    found = problems(config)
    if found:
        raise OnPolicyConfigError(
            "ASCEND_RL_ONPOLICY_OLD_LOGPROB=1 uses log_prob.detach() as the PPO old log-prob, which is exact "
            "only when every rollout batch makes exactly one optimizer step:\n  - " + "\n  - ".join(found)
            + "\nChange these keys, or unset ASCEND_RL_ONPOLICY_OLD_LOGPROB to recompute old log-probs.")


# -- config time ------------------------------------------------------------------------------

@FEATURE.after("verl.utils.config:validate_config", dist="verl", versions=VERL_RANGE, order=60,
               params=("config",), name="onpolicy_old_logprob.validate_config",
               reason="refuse, when verl validates the trainer config, a configuration in which "
                      "log_prob.detach() is not the old policy's log-prob",
               replaces="recipe verl patch 0003 (assert ppo_epochs == 1 in ActorConfig.__post_init__)",
               upstream="https://github.com/verl-project/verl/issues/3996", remove_when=REMOVE_WHEN)
def _validate_config(result, instance, args, kwargs):
    check(args[0] if args else kwargs["config"])
    return result


# -- the trainer --------------------------------------------------------------------------------

@FEATURE.wrap("verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit", dist="verl", versions=VERL_RANGE, order=50,
              params=("self",), name="onpolicy_old_logprob.trainer_fit",
              reason="RayPPOTrainer.fit recomputes old log-probs with a full forward pass of the actor "
                     "over the batch (actor_rollout_wg.compute_log_prob) even when the update is "
                     "on-policy and the loss can use log_prob.detach()",
              replaces="recipe verl patch 0003 (ray_trainer.py: skip compute_log_prob)",
              upstream="https://github.com/verl-project/verl/issues/3996", remove_when=REMOVE_WHEN)
def _trainer_fit(wrapped, instance, args, kwargs):
    from .runtime import skipping_old_log_prob
    check(instance.config)
    with skipping_old_log_prob(instance):
        return wrapped(*args, **kwargs)


# -- the Megatron actor ---------------------------------------------------------------------------

@FEATURE.wrap("verl.workers.actor.megatron_actor:MegatronPPOActor.forward_backward_batch", dist="verl",
              versions=VERL_RANGE, order=50, params=("self", "data", "forward_only"),
              name="onpolicy_old_logprob.megatron_update",
              reason="the Megatron actor's loss reads old_log_probs from the batch; on a batch whose "
                     "old-log-prob pass was skipped it must use log_prob.detach() instead",
              replaces="recipe verl patch 0003 (megatron_actor.py loss_func)", remove_when=REMOVE_WHEN)
def _megatron_update(wrapped, instance, args, kwargs):
    from .runtime import bind_forward_backward
    data, forward_only = bind_forward_backward(*args, **kwargs)
    if forward_only or not data.meta_info.get(MARK, False):
        return wrapped(*args, **kwargs)
    token = ON_POLICY_UPDATE.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        ON_POLICY_UPDATE.reset(token)


@FEATURE.wrap("verl.workers.actor.megatron_actor:get_policy_loss_fn", dist="verl", versions=VERL_RANGE,
              order=50, params=("name",), rebind=False, name="onpolicy_old_logprob.megatron_policy_loss",
              reason="inside an on-policy Megatron update, the policy loss function gets "
                     "old_log_prob = log_prob.detach() (only the megatron actor's copy of the name)",
              replaces="recipe verl patch 0003 (megatron_actor.py loss_func)", remove_when=REMOVE_WHEN)
def _megatron_policy_loss(wrapped, instance, args, kwargs):
    loss_fn = wrapped(*args, **kwargs)
    if not ON_POLICY_UPDATE.get():
        return loss_fn
    from .runtime import on_policy
    return on_policy(loss_fn)
