"""moe_reshard on verl 0.9.1 with verl's real ``MegatronEngine`` on the trainer side: the
``ascend_rl_alltoallv`` backend takes the experts from the engine's local expert shards
(SequentialMLP ``local_experts.<i>.linear_fc<N>``, legacy GroupedMLP ``weight1`` / ``weight2``)
and the dense tensors from the engine's Megatron-Bridge export (expert tasks left out), and
every rollout rank receives exactly its hosted experts, once, and every dense tensor, all
bit-identical to the checkpoint the engine was built from -- for four training layouts on 4
gloo ranks, run one after the other in the same processes: SequentialMLP at TP 1 / EP 2 /
ETP 2 and TP 2 / EP 2 / ETP 1 (dense layers tensor-parallel, row-parallel ``linear_proj``
included), GroupedMLP at TP 1 / EP 2 / ETP 1 (two expert data-parallel copies) and TP 1 /
EP 2 / ETP 2.

Real: verl 0.9.1's ``MegatronEngineWithLMHead`` built and initialized by verl through
Megatron-Bridge 0.3.1 (Megatron-Core 0.16.1 local layers), verl's ``CheckpointEngineRegistry``
building the backend on both sides. What stands in: a TransformerEngine double for
Megatron-Bridge's imports and a CPU device platform for verl (tests/support/
verl_megatron_engine.py), the harness's CPU shims (tests/support/megatron_shims.py; 8 makes
torch's gloo scatter honour strides, which Megatron-Bridge's row-parallel load needs on CPU;
4 the ``grouped_gemm`` package GroupedMLP asserts), for GroupedMLP the bridge's load made to
skip ``weight1`` / ``weight2`` (it has no mapping for them), Ray (the scenario runs verl's prepare / topology / send + receive / finalize steps); no vLLM
engine behind the rollout ranks (test_verl09_engine.py covers that hop with the harness's
model). Also pins three upstream failures of Megatron-Bridge 0.3.1 (+ verl 0.9.1).

The same engines, colocated (verl's ``naive`` sync): each trainer rank's patched export yields
every dense tensor and exactly its co-located vLLM worker's experts, once; one rank refusing
makes every rank take the stock export.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.support.child import free_port, run_group, run_scenario
from tests.support.stacks import require_installed

from .verl09_mcore_engine_scenario import (EXPERT_CLASSES, LAYOUTS, NUM_EXPERTS, REFUSING_RANK, ROLLOUTS, SYNCS,
                                           TRAINERS, MegatronTrainer, RolloutReceipt)

SCENARIO = "tests.features.moe_reshard.verl09_mcore_engine_scenario"
ENV = dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", ASCEND_RL_AUTOLOAD="0", ASCEND_RL_MOE_RESHARD="auto",
           ASCEND_RL_MOE_RESHARD_BUCKET_MB="1")
LAYERS, PROJS = 2, 3
SEQUENTIAL = [name for name, layout in LAYOUTS.items() if layout.moe == "sequential"]
GROUPED = [name for name, layout in LAYOUTS.items() if layout.moe == "grouped"]
# colocated: the experts trainer rank r's vLLM worker hosts under the scenario's rollout configs (vLLM's
# rules written out: tp 2 x ep 2 round-robin -> even ranks 0, 2 and odd ranks 1, 3; ep 4 -> rank r: r; no EP: all)
COLOCATED_HOSTED = {"tp1-ep2-etp2": {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]},
                    "tp2-ep2-etp1": {r: [r] for r in range(TRAINERS)},
                    "grouped-tp1-ep2-etp1": {r: list(range(NUM_EXPERTS)) for r in range(TRAINERS)},
                    "grouped-tp1-ep2-etp2": {r: [r] for r in range(TRAINERS)}}


@pytest.fixture(scope="module")
def synced():
    version = require_installed("torch", "megatron-core", "verl")
    if not version.startswith("0.9."):
        pytest.skip(f"the checkpoint-engine backend and MegatronEngine are verl 0.9's (this stack has verl {version})")
    require_installed("megatron-bridge")
    hf_dir = run_scenario(SCENARIO, "prepare", env=ENV, timeout=600)
    ports = [free_port() for _ in LAYOUTS]
    with concurrent.futures.ThreadPoolExecutor(1 + ROLLOUTS) as pool:
        trainers = pool.submit(run_group, SCENARIO, "trainer", TRAINERS, ports, hf_dir, env=ENV, timeout=900,
                               returns=MegatronTrainer)
        rollouts = [pool.submit(run_scenario, SCENARIO, "rollout", ports, r, hf_dir, env=ENV, timeout=900,
                                returns=RolloutReceipt) for r in range(ROLLOUTS)]
        return trainers.result(), [r.result() for r in rollouts]


def test_the_trainer_is_verls_megatron_engine_with_each_layouts_expert_module(synced):
    trainers, _ = synced
    assert [t.rank for t in trainers] == list(range(TRAINERS))
    assert SEQUENTIAL and GROUPED
    for t in trainers:
        assert list(t.layouts) == list(LAYOUTS)
        for name, run in t.layouts.items():
            assert run.engine == "MegatronEngineWithLMHead", (t.rank, name, run.engine)
            assert run.experts == [EXPERT_CLASSES[LAYOUTS[name].moe]], (t.rank, name, run.experts)
            assert run.sizes == LAYOUTS[name].sizes, (t.rank, name, run.sizes)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rollout_rank_receives_exactly_its_experts_once_and_every_dense_tensor(synced, layout):
    _, rollouts = synced
    half = NUM_EXPERTS // ROLLOUTS
    for r in rollouts:
        dense = [n for n in r.checkpoint if ".mlp.experts." not in n]
        for sync in SYNCS:
            s = r.layouts[layout][sync]
            assert s.resharded and s.reason == "", (r.rank, sync, s.reason)
            hosted = list(range(r.rank * half, (r.rank + 1) * half))
            assert s.expert_map == hosted and s.experts == hosted
            assert s.from_reshard == LAYERS * half * PROJS                 # each hosted projection once
            assert len(s.received) == len(set(s.received))
            assert sorted(n for n in s.received if ".mlp.experts." not in n) == dense
            assert s.from_broadcast == len(dense)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_everything_received_is_bit_identical_to_the_checkpoint(synced, layout):
    """At TP 2 this covers the row-parallel ``linear_proj`` (and at ETP 2 the experts'
    ``linear_fc2``) through Megatron-Bridge's own load and export."""
    _, rollouts = synced
    for r in rollouts:
        for sync in SYNCS:
            assert r.layouts[layout][sync].different == [], (r.rank, layout, sync)


def test_every_rank_agrees_on_each_layouts_plan_and_the_second_sync_takes_it_from_the_cache(synced):
    trainers, rollouts = synced
    first_keys = set()
    for layout in LAYOUTS:
        for sync in SYNCS:
            keys = ({t.layouts[layout].syncs[sync].plan_key for t in trainers}
                    | {r.layouts[layout][sync].plan_key for r in rollouts})
            assert len(keys) == 1 and keys != {""}, (layout, sync, keys)
            assert all(t.layouts[layout].syncs[sync].resharded for t in trainers)
        first_keys |= {trainers[0].layouts[layout].syncs["first"].plan_key}
        assert not any(t.layouts[layout].syncs["first"].plan_cached for t in trainers), layout
        assert all(t.layouts[layout].syncs["again"].plan_cached for t in trainers), layout
        assert all(r.layouts[layout]["again"].plan_cached for r in rollouts), layout
    assert len(first_keys) == len(LAYOUTS), first_keys          # the plan depends on the training layout


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_colocated_each_trainer_rank_yields_every_dense_tensor_and_exactly_its_vllm_workers_experts_once(synced,
                                                                                                    layout):
    """verl 0.9.1's colocated ('naive') sync: ``get_per_tensor_param`` as verl's naive
    ``update_weights`` calls it, inside the worker patch's scope, on every trainer rank at once:
    each rank's stream holds every dense tensor and exactly the experts its co-located vLLM worker
    hosts (trainer rank r -> rollout rank r % W), each projection once, all bit-identical to the
    checkpoint; the second sync takes the plan from the cache, every rank on the same key."""
    trainers, rollouts = synced
    dense = sorted(n for n in rollouts[0].checkpoint if ".mlp.experts." not in n)
    for sync in ("colocated", "colocated_again"):
        keys = set()
        for t in trainers:
            c = t.layouts[layout].colocated[sync]
            assert c.resharded and c.reason == "" and c.outcome == "ok", (t.rank, sync, c.reason, c.outcome)
            hosted = COLOCATED_HOSTED[layout][t.rank]
            assert c.expert_map == hosted, (t.rank, c.expert_map)
            want = sorted([layer, e, p] for layer in range(LAYERS) for e in hosted
                          for p in ("gate_proj", "up_proj", "down_proj"))
            assert sorted(c.experts) == want, (t.rank, sync, c.experts)          # exactly these, each once
            assert len(c.received) == len(set(c.received))
            assert sorted(n for n in c.received if ".mlp.experts." not in n) == dense
            assert c.different == [], (t.rank, sync, c.different)
            assert c.plan_cached == (sync == "colocated_again") and c.warnings == []
            keys.add(c.plan_key)
        assert len(keys) == 1 and keys != {""}, (layout, sync, keys)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_colocated_one_rank_refusing_makes_every_rank_take_the_stock_export_with_one_warning(synced, layout):
    """Rank 2 alone refuses (its rollout config turns on vLLM EPLB): every rank returns verl's
    stock export -- which, for this SequentialMLP engine at EP 2, fails as upstream failure (a),
    on every rank -- none yields a resharded expert, and each logs one WARNING naming rank 2."""
    trainers, _ = synced
    for t in trainers:
        c = t.layouts[layout].colocated["one_refuses"]
        assert not c.resharded and c.reason.startswith(f"rank {REFUSING_RANK}: setup: rollout.engine_kwargs.vllm."
                                                       "enable_eplb"), (t.rank, c.reason)
        assert c.outcome == t.layouts[layout].stock_export, (t.rank, c.outcome)   # the stock export, as pinned
        assert c.experts == [] and c.plan_key == ""
        assert c.warnings == [f"ascend-rl moe_reshard: falling back to stock weight sync: {c.reason}"], c.warnings


def test_upstream_bridge_still_loads_sequential_experts_of_ep_rank_1_from_ep_rank_0(synced):
    """Pins Megatron-Bridge 0.3.1's load of SequentialMLP experts at EP > 1 (README, (a')): on
    EP rank 1 (global experts 2-3) no expert parameter holds its HF expert, while EP rank 0's
    all do (with ETP 2 too: its ``linear_fc2`` is row-parallel over expert-TP). When this
    fails, upstream fixed it: drop ``load_global_experts``' correction and update the README."""
    trainers, _ = synced
    for layout in SEQUENTIAL:
        loaded = [(e, ok) for t in trainers for _, e, ok in t.layouts[layout].bridge_loaded_experts]
        upper = [ok for e, ok in loaded if e >= NUM_EXPERTS // 2]
        lower = [ok for e, ok in loaded if e < NUM_EXPERTS // 2]
        assert len(upper) == len(lower) == 2 * LAYERS * 2 * 2, layout   # 2 ranks x layers x 2 experts x fc1/fc2
        assert not any(upper) and all(lower), (layout, loaded)


def test_upstream_stock_export_still_fails_for_sequential_experts_over_ep(synced):
    """Pins verl 0.9.1's stock ``get_per_tensor_param`` -> Megatron-Bridge 0.3.1
    ``export_hf_weights`` on this engine (README, (a)): it cannot gather SequentialMLP experts
    over EP (it parses TEGroupedMLP's ``weight<N>`` names). When this fails, upstream fixed it
    (the backend's fallback, the full export, then works for this model too): update the README."""
    trainers, _ = synced
    for t in trainers:
        for layout in SEQUENTIAL:
            stock = t.layouts[layout].stock_export
            assert stock.startswith("ValueError: invalid literal for int()"), (layout, stock)


def test_upstream_bridge_still_has_no_mapping_for_grouped_mlp_weight1_weight2(synced):
    """Pins upstream failure (b) (README): Megatron-Bridge 0.3.1 maps no HF tensor to legacy
    GroupedMLP's ``weight1`` / ``weight2``, so (observed on each engine, the test shim off) its
    load of the checkpoint -- the call verl's ``initialize()`` makes -- fails on the first one,
    and verl 0.9.1's stock export and shard export (``delta_sharded``'s input) fail on their
    ``None`` tasks. When this fails, upstream added the mapping: drop
    ``megatron_bridge.bridge_load_skips_unmapped_params`` (and GroupedMLP's correction in
    ``load_global_experts`` once the bridge loads them right) and update the README."""
    trainers, _ = synced
    for t in trainers:
        for layout in GROUPED:
            g = t.layouts[layout].grouped
            assert g is not None, layout
            assert sorted(g.expert_params) == [f"decoder.layers.{i}.mlp.experts.weight{w}"
                                               for i in range(LAYERS) for w in (1, 2)], g.expert_params
            assert g.unmapped == g.expert_params, (layout, g.unmapped)
            assert g.stock_load == "AttributeError: 'NoneType' object has no attribute 'megatron_module'", g
            assert g.shard_export == "AttributeError: 'NoneType' object has no attribute 'mapping'", g
            stock = t.layouts[layout].stock_export
            assert stock == "AttributeError: 'NoneType' object has no attribute 'mapping'", (layout, stock)
