"""onpolicy_old_logprob on verl 0.6.1's real Megatron actor (one gloo rank, tiny real GPT).

The scenario (tests/features/onpolicy_old_logprob/actor_scenario.py, which lists what is real
and what is doubled) runs ``MegatronPPOActor.forward_backward_batch`` on a batch whose
``old_log_probs`` are the NaN placeholders the trainer sends when it skipped the pass, and
compares the gradients with the on-policy policy gradient computed by hand on the same model.
"""

from __future__ import annotations

import math

import pytest

from tests.features.data_rebalance.verl_env import import_verl
from tests.support.child import run_group

(verl,) = import_verl("verl")
if not verl.__version__.startswith("0.6."):
    pytest.skip("the Megatron actor patch is for verl 0.6 (verl >= 0.9 has no MegatronPPOActor)",
                allow_module_level=True)
pytest.importorskip("megatron.core")

ENV = {"ASCEND_RL_AUTOLOAD": "0", "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": ""}


@pytest.fixture(scope="module")
def updates():
    (result,) = run_group("tests.features.onpolicy_old_logprob.actor_scenario", "updates", 1, env=ENV, timeout=600)
    return result


def test_the_loss_sees_old_log_prob_equal_to_log_prob_detached(updates):
    """Ratio exactly 1 (PPO KL 0, nothing clipped) and the gradient is the on-policy policy
    gradient, to the last bit of this model's fp32 arithmetic."""
    r = updates["patched_marked"]
    assert r["metrics"]["actor/ppo_kl"] == [0.0]
    assert r["metrics"]["actor/pg_clipfrac"] == [0.0] and r["metrics"]["actor/pg_clipfrac_lower"] == [0.0]
    assert math.isfinite(r["metrics"]["actor/pg_loss"][0])
    assert r["relative_error"] <= 1e-6 and r["params"] > 0
    assert r["metrics"]["actor/onpolicy_old_logprob"] == [1.0]  # the acknowledgement the trainer checks
    assert updates["context_clear"]


@pytest.mark.parametrize("case", ["unpatched_marked", "patched_unmarked"])
def test_without_the_patch_or_the_trainers_mark_the_placeholders_reach_the_loss(updates, case):
    """The teeth: verl's own loss reads the batch's NaN placeholders (NaN loss, not the policy
    gradient), and the patch leaves batches the trainer did not mark alone."""
    r = updates[case]
    assert math.isnan(r["metrics"]["actor/pg_loss"][0])
    assert r["relative_error"] > 0.5
    assert "actor/onpolicy_old_logprob" not in r["metrics"]
