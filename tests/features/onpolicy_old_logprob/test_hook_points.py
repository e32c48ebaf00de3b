"""onpolicy_old_logprob: what the patches rely on, read in both verl versions' sources.

verl 0.6.1: the trainer calls ``actor_rollout_wg.compute_log_prob`` unless bypass mode is on
and then asserts ``old_log_probs`` is in the batch (hence placeholders, not a skipped key);
the Megatron actor's loss closure looks ``get_policy_loss_fn`` up as a module global and
calls the loss with keywords; FSDP's actor already uses ``log_prob.detach()`` on one
mini-batch and one epoch. verl 0.9.1 has no Megatron actor (the feature does not apply).
"""

from __future__ import annotations

import ast
import os

from ascend_rl_plugins.features import onpolicy_old_logprob
from tests.features.upstream_source import method, module_path, parse
from tests.support import stacks


def _calls(node) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def test_verl_06_trainer_computes_old_log_probs_then_asserts_they_are_there():
    fit = method(parse(module_path("recipe", "verl", "verl.trainer.ppo.ray_trainer")), "RayPPOTrainer", "fit")
    assert "self.actor_rollout_wg.compute_log_prob" in {ast.unparse(c.func) for c in _calls(fit)}
    asserts = [ast.unparse(n.test) for n in ast.walk(fit) if isinstance(n, ast.Assert)]
    assert "'old_log_probs' in batch.batch" in asserts


def test_verl_06_megatron_loss_calls_the_module_global_loss_fn_with_keywords():
    tree = parse(module_path("recipe", "verl", "verl.workers.actor.megatron_actor"))
    assert any(isinstance(n, ast.ImportFrom) and n.module == "verl.trainer.ppo.core_algos"
               and "get_policy_loss_fn" in [a.name for a in n.names] for n in tree.body)
    fbb = method(tree, "MegatronPPOActor", "forward_backward_batch")
    loss_calls = [c for c in _calls(fbb) if ast.unparse(c.func) == "policy_loss_fn"]
    assert loss_calls and all({"old_log_prob", "log_prob"} <= {k.arg for k in c.keywords} for c in loss_calls)


def test_verl_06_fsdp_actor_already_uses_log_prob_detach_when_on_policy():
    update = method(parse(module_path("recipe", "verl", "verl.workers.actor.dp_actor")), "DataParallelPPOActor",
                    "update_policy")
    text = ast.unparse(update)
    assert "on_policy = len(mini_batches) == 1 and self.config.ppo_epochs == 1" in text
    assert "old_log_prob = log_prob.detach()" in text


def test_verl_09_has_no_megatron_actor_and_offers_bypass_mode_instead():
    root = stacks.source("current", "verl", "verl")

    assert not os.path.exists(os.path.join(root, "workers", "actor", "megatron_actor.py"))
    fit = method(parse(module_path("current", "verl", "verl.trainer.ppo.ray_trainer")), "RayPPOTrainer", "fit")
    assert "bypass_mode" in ast.unparse(fit)
    assert onpolicy_old_logprob.FEATURE.inapplicable(stacks.roots("current"))
    assert not onpolicy_old_logprob.FEATURE.inapplicable(stacks.roots("recipe"))
