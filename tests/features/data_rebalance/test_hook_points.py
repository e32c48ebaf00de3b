"""data_rebalance: the hook point, read in both verl versions' sources (no import).

verl 0.6.1 binds every worker-group method through the module global ``func_generator``
(so the patched attribute is what it calls) and dispatches ``generate_sequences`` in one call
per rollout batch; verl 0.9.1 routes each request through a least-in-flight load balancer,
which is why the feature declares it does not apply there.
"""

from __future__ import annotations

import ast

from ascend_rl_plugins.features import data_rebalance
from tests.features.upstream_source import module_path, parse, params, top_level
from tests.support import stacks


def test_verl_06_binds_worker_methods_through_the_module_global_func_generator():
    tree = parse(module_path("recipe", "verl", "verl.single_controller.ray.base"))
    assert params(top_level(tree, "func_generator")) == list(data_rebalance.BIND_PARAMS)
    binds = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("_bind_worker_method")]
    assert binds and all(isinstance(n.args[1], ast.Name) and n.args[1].id == "func_generator" for n in binds)


def test_verl_06_trainer_generates_through_the_worker_group_in_sync_mode():
    tree = parse(module_path("recipe", "verl", "verl.trainer.ppo.ray_trainer"))
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "self.actor_rollout_wg.generate_sequences" in calls


def test_verl_09_routes_requests_through_a_load_balancer_so_the_feature_does_not_apply():
    router = parse(module_path("current", "verl", "verl.workers.rollout.router"))
    assert top_level(router, "GlobalRequestLoadBalancer")
    trainer = parse(module_path("current", "verl", "verl.trainer.ppo.ray_trainer"))
    calls = {ast.unparse(n.func) for n in ast.walk(trainer) if isinstance(n, ast.Call)}
    assert "self.actor_rollout_wg.generate_sequences" not in calls
    assert "self.async_rollout_manager.generate_sequences" in calls
    assert data_rebalance.FEATURE.inapplicable(stacks.roots("current"))
    assert not data_rebalance.FEATURE.inapplicable(stacks.roots("recipe"))
