"""onpolicy_old_logprob on verl 0.6.1's trainer: config-time refusal and the skipped pass.

Real: ``verl.utils.config.validate_config``, ``RayPPOTrainer.__init__`` and one real
``RayPPOTrainer.fit`` GRPO step on CPU (tests/features/onpolicy_old_logprob/toy_trainer.py
says what is doubled: the Ray worker group and the reward function). The patches are applied
by the framework's registry in ``@pytest.mark.forked`` children (patches are process-global).
"""

from __future__ import annotations

import pytest

from ascend_rl_plugins.features import onpolicy_old_logprob as feature
from ascend_rl_plugins.patching.core import REGISTRY
from tests.features.data_rebalance.verl_env import import_verl
from tests.features.onpolicy_old_logprob import toy_trainer

verl, verl_config, ray_trainer = import_verl("verl", "verl.utils.config", "verl.trainer.ppo.ray_trainer")
if not verl.__version__.startswith("0.6."):
    pytest.skip("onpolicy_old_logprob patches verl 0.6 (on verl >= 0.9 it declares it does not apply: use "
                "algorithm.rollout_correction.bypass_mode)", allow_module_level=True)

VALIDATE = REGISTRY.patches["onpolicy_old_logprob.validate_config"]
FIT = REGISTRY.patches["onpolicy_old_logprob.trainer_fit"]

OFF_POLICY = {
    "ppo_epochs": ({"actor_rollout_ref.actor.ppo_epochs": 2}, ["actor_rollout_ref.actor.ppo_epochs=2"]),
    "two_mini_batches": ({"actor_rollout_ref.actor.ppo_mini_batch_size": toy_trainer.PROMPTS // 2},
                         ["actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.train_batch_size=4",
                          "with 2 mini-batches"]),
    # verl's dataloader yields data.gen_batch_size prompts per rollout (train_batch_size only when
    # unset): a mini-batch of train_batch_size prompts then splits each rollout batch in two
    "gen_batch_size": ({"data.gen_batch_size": toy_trainer.PROMPTS * 2},
                       ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.gen_batch_size=8",
                        "with 2 mini-batches"]),
    "kl_in_reward": ({"algorithm.use_kl_in_reward": True}, ["algorithm.use_kl_in_reward=True"]),
    "bypass_mode": ({"algorithm.rollout_correction.bypass_mode": True},
                    ["algorithm.rollout_correction.bypass_mode=True"]),
    "rollout_is": ({"algorithm.rollout_correction.rollout_is": "token"},
                   ["algorithm.rollout_correction.rollout_is=token"]),
}


def _validate(cfg):
    verl_config.validate_config(config=cfg, use_reference_policy=False, use_critic=False)


def test_the_on_policy_configuration_is_valid_for_verl_itself():
    _validate(toy_trainer.config())
    assert feature.problems(toy_trainer.config()) == []


def test_the_rollout_batch_is_data_gen_batch_size_when_set():
    """One mini-batch per rollout batch of data.gen_batch_size prompts is on-policy, even when
    data.train_batch_size differs (the refusal compares with the batch verl rolls out)."""
    half = toy_trainer.PROMPTS // 2
    cfg = toy_trainer.config(**{"data.gen_batch_size": half, "actor_rollout_ref.actor.ppo_mini_batch_size": half})
    assert feature.problems(cfg) == []


@pytest.mark.parametrize("case", sorted(OFF_POLICY))
def test_without_the_patch_verl_accepts_the_off_policy_configurations(case):
    """The teeth of the refusal tests below: verl itself accepts these configurations."""
    assert VALIDATE.outcome.state != "applied"
    _validate(toy_trainer.config(**OFF_POLICY[case][0]))


@pytest.mark.forked
@pytest.mark.parametrize("case", sorted(OFF_POLICY))
def test_validate_config_refuses_off_policy_configurations_naming_the_keys(case):
    assert REGISTRY.apply(VALIDATE), VALIDATE.outcome
    _validate(toy_trainer.config())  # the on-policy one still passes
    overrides, named = OFF_POLICY[case]
    with pytest.raises(feature.OnPolicyConfigError) as refused:
        _validate(toy_trainer.config(**overrides))
    for text in named + ["ASCEND_RL_ONPOLICY_OLD_LOGPROB"]:
        assert text in str(refused.value)


@pytest.mark.forked
def test_fit_without_the_patch_runs_the_old_log_prob_pass():
    t = toy_trainer.trainer(toy_trainer.config())
    t.fit()
    assert t.actor_rollout_wg.calls == {"generate_sequences": 1, "compute_log_prob": 1, "update_actor": 1}
    assert (t.actor_rollout_wg.updated_with.batch["old_log_probs"] == -1).all()


@pytest.mark.forked
def test_fit_skips_the_old_log_prob_pass_and_marks_the_update():
    from ascend_rl_plugins.features.onpolicy_old_logprob import runtime
    assert REGISTRY.apply(FIT), FIT.outcome
    t = toy_trainer.trainer(toy_trainer.config())
    wg = t.actor_rollout_wg
    t.fit()
    assert wg.calls == {"generate_sequences": 1, "compute_log_prob": 0, "update_actor": 1}
    assert runtime.SKIPPED.skipped == 1
    update = wg.updated_with
    old = update.batch["old_log_probs"]
    assert old.shape == update.batch["responses"].shape and old.isnan().all()
    assert update.meta_info["temperature"] == toy_trainer.TEMPERATURE
    assert update.meta_info[feature.MARK] is True
    assert "advantages" in update.batch.keys()  # the real GRPO step ran around the skipped pass
    # the worker group's own methods are back once fit returns
    assert "compute_log_prob" not in vars(wg) and "update_actor" not in vars(wg)
    assert wg.compute_log_prob.__func__ is toy_trainer.WorkerGroupDouble.compute_log_prob


@pytest.mark.forked
def test_fit_stops_when_the_megatron_workers_did_not_apply_the_loss_patch():
    """Workers without ascend-rl computed their loss on the NaN placeholders: the trainer
    stops after that first update, naming the fix."""
    assert REGISTRY.apply(FIT), FIT.outcome
    t = toy_trainer.trainer(toy_trainer.config(), workers_patched=False)
    with pytest.raises(RuntimeError, match="VERL_USE_EXTERNAL_MODULES=ascend_rl_plugins"):
        t.fit()
    assert t.actor_rollout_wg.calls["update_actor"] == 1


@pytest.mark.forked
def test_fit_refuses_before_any_step_when_the_config_is_off_policy():
    """A trainer built without verl's validate_config (a custom launcher) is refused by fit
    before its first generation."""
    assert REGISTRY.apply(FIT), FIT.outcome
    t = toy_trainer.trainer(toy_trainer.config(**{"actor_rollout_ref.actor.ppo_epochs": 2}))
    with pytest.raises(feature.OnPolicyConfigError, match="ppo_epochs=2"):
        t.fit()
    assert t.actor_rollout_wg.calls["generate_sequences"] == 0
    assert "compute_log_prob" not in vars(t.actor_rollout_wg)


def test_the_refusal_message_counts_mini_batches():
    cfg = toy_trainer.config(**{"actor_rollout_ref.actor.ppo_mini_batch_size": 1})
    (message,) = feature.problems(cfg)
    assert "with 4 mini-batches" in message
