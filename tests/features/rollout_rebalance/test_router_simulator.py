"""The verl 0.9 long-tail simulator (benchmarks/bench_rollout_router.py): deterministic, every
request finishes exactly once under every policy, and the orderings the README reports hold on
a small workload. Behaviour only: no wall-clock time is measured."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
bench = pytest.importorskip("bench_rollout_router")
pytestmark = pytest.mark.stack_independent   # numpy and this package's routing code only

from ascend_rl_plugins.features.rollout_rebalance import routing  # noqa: E402

SMALL = {key: bench.quick_workload(w) for key, w in bench.SCENARIOS.items()}  # --quick
DEFAULTS = routing.RouterSettings()


def _policies(w):
    """Every policy of the table; the hand-back only where something is preempted (the 235B
    workload: on DAPO and 8K math it runs exactly as migration without it, and costs as much)."""
    return [p for p in bench.policies(w, DEFAULTS)
            if p[0] != bench.HAND_BACK or w.name == "qwen3-235b-32k-grpo"]


@pytest.fixture(scope="module")
def runs():
    """Every policy of the table on every small workload, simulated once for the module (the
    simulations are the module's whole cost): ``{workload key: {policy name: bench.SimulatedRun}}``."""
    return {key: {name: bench.simulate(w, make, pooled) for name, make, pooled in _policies(w)}
            for key, w in SMALL.items()}


@pytest.mark.parametrize("key", sorted(SMALL))
def test_every_request_finishes_exactly_once_under_every_policy(key, runs):
    batches = bench.make_batches(SMALL[key])
    for name, run in runs[key].items():
        for req, done in zip(batches, run.finished):
            assert sorted(done) == list(range(len(req.length))), name
        if "abort" in name:
            assert run.tally.aborted > 0 or run.tally.rebalances == 0


def test_the_simulation_is_deterministic(runs):
    w = SMALL["qwen3-235b-32k-grpo"]
    for name, make, pooled in _policies(w):
        assert bench.simulate(w, make, pooled) == runs["qwen3-235b-32k-grpo"][name], name


def test_migration_and_pooling_never_lose_to_verls_router_on_the_small_workloads(runs):
    """What the README's table says on the full workloads, checked on small ones: the router
    with (simulated) KV migration and the pooled engine finish no later than verl's
    least-in-flight router, and migration moves requests with their KV."""
    for key, rows in runs.items():
        lif = rows["verl least-in-flight"].seconds
        assert rows["this router + KV migration (simulated)"].seconds <= lif, key
        assert rows["pooled engine (reference)"].seconds <= lif, key
        assert rows["this router + KV migration (simulated)"].tally.moved_kv > 0, key
        if bench.HAND_BACK in rows:
            assert rows[bench.HAND_BACK].seconds <= lif and rows[bench.HAND_BACK].tally.requeued > 0, key


def test_no_policy_beats_the_models_lower_bounds_and_no_kv_is_left_on_the_link(runs):
    """The lower bounds the README quotes hold for every policy (a model or bound error would
    show as a makespan below them), and every KV transfer the migration starts lands."""
    for key, w in SMALL.items():
        bounds = bench.lower_bounds(w)
        assert bounds.best == max(bounds.alone, bounds.work, bounds.kv_steps) > 0
        for name, run in runs[key].items():
            assert run.seconds >= bounds.best, (key, name, bounds)
            assert run.in_transit == 0, (key, name)


def test_the_replicas_step_is_the_planners_step_model():
    """The simulated replica charges exactly what tail_policy.StepCostModel (what the
    migration planner reasons with) says for its batch and context."""
    w = SMALL["qwen3-235b-32k-grpo"]
    sim = bench.Simulation(w, bench.LeastInflight(0))
    sim.req = bench.make_batches(w)[0]
    r = sim.replicas[0]
    for rid in range(40):
        r._start(rid, 100)
    expected_ms = sim.step_model.step_ms(len(r.running), r.context())
    assert r.seconds(1) == pytest.approx(expected_ms / 1000)


@dataclass
class ObservedMigration:
    """One simulated batch of the shipped controller (this router + KV migration, 235B), with
    what the controller's planner was shown and what the router was told."""
    sim: object                 # bench.Simulation, after the batch
    client: object              # bench.ThisRouter
    seen_queued: list           # queued requests in the views the planner got (must be none)
    running_sizes: set          # expected_response_tokens of every running request it saw
    told: list                  # what policy.move answered for each move the controller told


@pytest.fixture(scope="module")
def observed_migration() -> ObservedMigration:
    w = SMALL["qwen3-235b-32k-grpo"]
    client = bench.ThisRouter(replace(DEFAULTS, **bench.WITH_MIGRATION), migrate_every=bench.MIGRATE_EVERY)
    sim = bench.Simulation(w, client)
    seen = ObservedMigration(sim, client, [], set(), [])
    plan, follow = client.views, client.policy.move

    def views(s):
        out = plan(s)
        seen.seen_queued.extend(r for v in out for r in v.queued)
        seen.running_sizes.update(r.expected_response_tokens for v in out for r in v.running)
        return out

    client.views = views
    client.policy.move = lambda *args: seen.told.append(follow(*args)) or seen.told[-1]
    sim.run_batch(bench.make_batches(w)[0], 0.0)
    return seen


def test_the_simulated_controller_does_only_what_the_shipped_client_can(observed_migration):
    """The table's migration is migration_client.PlannedMigration's: it cannot tell a queued
    request from a running one (no queued list, nothing moved while it waits, every move
    exports KV) and expects each request's max_tokens. The what-if controller ('full', not
    shipped) also sees the queued requests (its planner may move them without KV); an unknown
    controller is refused."""
    w = SMALL["qwen3-235b-32k-grpo"]
    tally = observed_migration.sim.tally
    assert tally.preempted > 0  # there were queued requests to see
    assert observed_migration.seen_queued == [] and tally.moved == tally.moved_kv > 0
    assert observed_migration.running_sizes == {w.max_response}
    migrating = replace(DEFAULTS, **bench.WITH_MIGRATION)
    full = bench.ThisRouter(migrating, migrate_every=bench.MIGRATE_EVERY, controller="full")
    full_sim = bench.Simulation(w, full)
    full_queued = []
    full_plan = full.views

    def full_views(s):
        out = full_plan(s)
        full_queued.extend(r for v in out for r in v.queued)
        return out

    full.views = full_views
    full_sim.run_batch(bench.make_batches(w)[0], 0.0)
    assert full_queued  # the what-if sees the requests that wait (and may move them without KV)
    with pytest.raises(ValueError, match="controller='oracle'.*client, full"):
        bench.ThisRouter(DEFAULTS, controller="oracle")


def test_the_router_follows_every_simulated_move_and_ends_with_empty_books(observed_migration):
    """As the shipped client does (MigratingLLMServerClient tells move_request when a moved
    request starts at its destination), the simulated controller tells the router of every
    move that lands: the router accepts each one, releases each request where it runs, and its
    books are empty when the batch ends (nothing released to a replica it left)."""
    told, client = observed_migration.told, observed_migration.client
    assert observed_migration.sim.tally.moved_kv > 0 and len(told) == observed_migration.sim.tally.moved_kv
    assert all(told)
    assert all(not r.inflight and not r.groups for r in client.policy.replicas.values())
    assert client.acquired == {}


def test_the_router_learns_past_steps_from_a_simulated_step_in_the_same_units():
    """History (a prompt served one step earlier) reaches the router as verl would give it: by
    serving a previous step on the simulated replicas, so its per-prompt statistics and its mean
    duration come from the same duration process as the measured step's (a fixed seconds-per-
    token conversion made past prompts look about 30 % shorter than live ones). Every prompt with
    history has its n siblings' observations, the others none; no request id of that step is
    sticky in the measured one."""
    w = replace(SMALL["math-8k"], history=0.5)
    req = bench.make_batches(w)[0]
    router = bench.ThisRouter(DEFAULTS)
    sim = bench.Simulation(w, router)
    sim.req = req
    router.begin(sim, req, 0.0)
    seen = router.policy.lengths.by_group
    groups = {str(int(g)) for g in set(req.group.tolist())}
    with_history = {str(g) for g in req.history}
    assert 0 < len(with_history) < len(groups)
    assert {g for g in groups if g in seen} == with_history
    assert all(seen[g][1] == w.n for g in with_history)
    assert not router.policy.sticky and router.policy.inflight() == 0
    # the mean duration is what the replicas' own pace gave, not tokens x a constant
    warm = bench.previous_step(w, req)
    assert router.gen_count == len(warm.length) and router.gen_sum == float(warm.length.sum())
    assert router.policy.lengths.observed == len(warm.length)


def test_the_hand_back_returns_every_preempted_request_once_and_loses_none():
    """The preemption hand-back (``RoutingPolicy.requeue``, as the shipped client drives it):
    every request a replica preempts leaves it (it is not put back in that replica's own
    queue), comes back through the router, and still finishes exactly once; the router's books
    are empty at the end. With the router admitting on the KV in use (``REQUEUE_SETTINGS``) the
    small 235B workload preempts, so the path is exercised."""
    w = SMALL["qwen3-235b-32k-grpo"]
    settings = replace(DEFAULTS, **bench.REQUEUE_SETTINGS)
    client = bench.ThisRouter(settings, migrate_every=bench.MIGRATE_EVERY, requeue_preempted=True)
    sim = bench.Simulation(w, client)
    handed_back = []
    back = client.preempted
    client.preempted = lambda s, rid, gen, replica: handed_back.append((rid, gen)) or back(s, rid, gen, replica)
    req = bench.make_batches(w)[0]
    sim.run_batch(req, 0.0)
    assert sim.tally.preempted > 0 and len(handed_back) == sim.tally.requeued == sim.tally.preempted
    # a request comes back with the tokens it had generated, resumed from them (not from scratch)
    assert any(gen > 0 for _, gen in handed_back)
    assert sorted(sim.finished) == list(range(len(req.length)))
    assert client.policy.queued == 0 and client.acquired == {}
    assert all(not r.inflight and not r.groups for r in client.policy.replicas.values())
    with pytest.raises(ValueError, match="one what-if at a time"):
        bench.ThisRouter(settings, oracle_order=True, requeue_preempted=True)
