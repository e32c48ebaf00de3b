"""moe_reshard's verl hooks.

verl 0.6.1 (recipe stack): ``per_tensor_generator`` stock vs patched on a real Megatron-Core MoE
model on 4 gloo processes, TP2 x EP2 with Megatron's default ETP = TP = 2 (verl06_scenario.py): the dense tensors are bit-identical to stock's,
each rank gets exactly the experts its rollout rank hosts, bit-identical to stock's tensors of
the same name, where stock sends every expert to every rank; a plan that fails validation, or no
reachable rollout, falls back to stock on every rank with a one-line reason; a GroupedMLP model
(which stock verl 0.6.1 cannot name) syncs its hosted experts exactly.

verl 0.9.1 (current stack): what the checkpoint-engine backend and its hand-off patch rely on is
read in the real source here; the backend itself runs in test_verl09_backend.py.
"""

from __future__ import annotations

import pytest

from ascend_rl_plugins.features import moe_reshard as feature
from tests.support.child import run_group
from tests.support.stacks import require_installed

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0",
       "ASCEND_RL_MOE_RESHARD": "auto"}


@pytest.fixture(scope="module")
def ranks():
    if not require_installed("torch", "megatron-core", "verl").startswith("0.6."):
        pytest.skip("the per_tensor_generator hook is for verl 0.6.x (this stack has verl " + require_installed("torch", "megatron-core", "verl") + ")")
    return run_group("tests.features.moe_reshard.verl06_scenario", "stock_vs_patched", 4, 2, env=ENV, timeout=900)


def test_the_patch_is_applied_and_rebinds_the_module_attribute(ranks):
    for r in ranks:
        assert r["patch_state"] == "applied" and r["rebound"], r


def test_dense_tensors_are_bit_identical_to_stock(ranks):
    for r in ranks:
        assert r["dense_bit_identical"], r
        assert r["patched_dense_names"] == r["stock_dense_names"]
        assert "model.layers.1.mlp.gate.weight" in r["stock_dense_names"]


def test_each_rank_gets_exactly_its_hosted_experts_identical_to_stocks(ranks):
    for r in ranks:
        assert r["stock_expert_ids"] == [0, 1, 2, 3]  # stock: every expert on every rank
        assert r["stock_expert_names"] == 2 * 4 * 3
        want = sorted(f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"
                      for layer in (0, 1) for e in r["hosted"] for p in ("gate_proj", "up_proj", "down_proj"))
        assert sorted(r["patched_expert_names"]) == want  # each exactly once
        assert len(r["patched_expert_names"]) == len(set(r["patched_expert_names"]))
        assert r["experts_equal_stock"], r
        assert r["expert_bytes"]["patched"] * 4 == r["expert_bytes"]["stock"]
    # round-robin over 4 rollout ranks: rank r hosts expert r; expert 1 is trained on EP rank 0,
    # its rows split over the two ETP ranks, so rank 1 assembles it from ranks it does not share
    assert [r["hosted"] for r in ranks] == [[0], [1], [2], [3]]


def test_an_invalid_plan_falls_back_to_stock_on_every_rank_with_a_reason(ranks):
    for r in ranks:
        assert r["fallback_equals_stock"] and r["no_rollout_equals_stock"] and r["mixed_equals_stock"], r
        # only rank 0 could take part: every rank took the stock path, naming a rank that could not
        assert r["mixed_log"] and r["mixed_log"][0].startswith("ascend-rl moe_reshard: falling back to stock weight sync: rank 1: ")
    logs = [m for r in ranks for m in r["fallback_log"]]
    assert logs and all(m.startswith("ascend-rl moe_reshard: falling back to stock weight sync: ") for m in logs)
    assert any("host 1 of 4 experts" in m for m in logs)
    assert any("no vLLM MoE model" in m for r in ranks for m in r["no_rollout_log"])


def test_grouped_mlp_experts_sync_where_stock_verl_cannot_name_them(ranks):
    for r in ranks:
        g = r["grouped"]
        assert g["stock"].startswith("NotImplementedError: Unsupported parameter name") and "weight1" in g["stock"]
        want = sorted(f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"
                      for layer in (0, 1) for e in g["hosted"] for p in ("gate_proj", "up_proj", "down_proj"))
        assert g["expert_names"] == want
        assert g["wrong"] == []
        assert g["dense"] == len(r["stock_dense_names"])


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    if not require_installed("torch", "megatron-core", "verl").startswith("0.6."):
        pytest.skip("the hybrid-engine chain is verl 0.6.x's (this stack has verl " + require_installed("torch", "megatron-core", "verl") + ")")
    from tests.support.child import ENGINE_ENV
    env = {**ENGINE_ENV, **ENV, "ASCEND_RL_MOE_RESHARD": "on"}  # on: a fallback would raise
    out = str(tmp_path_factory.mktemp("moe-reshard-chain"))
    return run_group("tests.features.moe_reshard.verl06_scenario", "hybrid_engine_chain", 1, out,
                     env=env, timeout=900)[0]


def test_the_colocated_chain_syncs_through_the_live_vllm_model_like_stock(chain):
    """verl's real update_weights(per_tensor_generator(...)) into a real vLLM 0.13 engine in the
    same process: the generator found the live model (expert map, rollout rank) that the
    update_weights patch published, and every vLLM parameter and the greedy tokens equal stock's."""
    assert set(chain["states"].values()) == {"applied"} and len(chain["states"]) == 3
    assert chain["generator_saw_live_model"] == [True]
    assert chain["stock_tokens"] != chain["w0_tokens"]
    assert chain["patched_tokens"] == chain["stock_tokens"]
    assert chain["params"] > 0 and chain["different"] == []


# -- verl 0.9.1: what the checkpoint-engine backend relies on, read in the source (no import) ----

def test_verl_09_exports_through_megatron_bridge_and_the_feature_applies_through_a_backend():
    """Read in verl 0.9.1's source: the Megatron engine's export goes through the bridge (experts
    gathered; no per_tensor_generator to hook); the feature declares verl 0.9 as applying through
    the checkpoint-engine registry, with one patch (the engine hand-off) in that range, and does
    not claim 0.7 / 0.8."""
    import ast

    from tests.support.stacks import source
    path = source("current", "verl", "verl", "workers", "engine", "megatron", "transformer_impl.py")
    tree = ast.parse(open(path).read())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MegatronEngine")
    method = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "get_per_tensor_param")
    text = ast.unparse(method)
    assert "export_hf_weights" in text and "per_tensor_generator" not in text
    na = feature.FEATURE.not_applicable
    assert len(na) == 1 and na[0].dist == "verl" and na[0].versions_text == ">=0.7,<0.9"
    (point,) = feature.FEATURE.extension_points
    assert point.versions_text == feature.VERL09 and "custom_backend_module" in point.point
    assert feature.BACKEND_MODULE in point.how()
    by_range = {}
    for p in feature.FEATURE.patches:
        by_range.setdefault(p.versions_text, []).append(p.name)
    assert by_range[feature.VERL09] == ["moe_reshard.hand_training_engine", "moe_reshard.colocated_export"]
    assert len(by_range[feature.VERL06]) == 3


def _method(path: str, cls: str, name: str):
    import ast
    tree = ast.parse(open(path).read())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def test_verl_09_hands_only_delta_sharded_the_training_engine_and_builds_engines_from_config_alone():
    """What the backend and its one patch rely on, read in verl 0.9.1's source (no import): a
    backend registered through ``custom_backend_module`` (imported on both sides before the
    registry builds the engine) is built from ``bucket_size`` / ``is_master`` / ``engine_kwargs``;
    stock hands every backend but ``delta_sharded`` ``engine.get_per_tensor_param()`` --
    Megatron-Bridge's HF export, experts already gathered -- which is why the feature's patch
    hands the engine itself to a backend that asks for it, as verl does for ``delta_sharded``;
    the rollout side's engine never sees the server adapter, which is why the rollout ranks' expert
    maps come from the backend's ``engine_kwargs`` (vLLM's placement rule per replica). If any of
    this changes upstream, this test fails: revisit the backend (README, "verl 0.9")."""
    from tests.support.stacks import source
    workers = source("current", "verl", "verl", "workers", "engine_workers.py")
    update = ast_text(_method(workers, "ActorRolloutRefWorker", "update_weights"))
    assert "if effective_mode == 'delta_sharded':" in update
    assert "await self.checkpoint_engine.send_weights(self.actor.engine" in update
    assert "per_tensor_param, _ = self.actor.engine.get_per_tensor_param()" in update
    assert "await self.checkpoint_engine.send_weights(per_tensor_param" in update
    init = ast_text(_method(workers, "ActorRolloutRefWorker", "init_model"))
    assert "import_external_libs(checkpoint_engine_config.custom_backend_module or None)" in init
    assert "CheckpointEngineRegistry.new(backend, is_master=torch.distributed.get_rank() == 0, " \
           "bucket_size=bucket_size, **engine_kwargs)" in init
    base = source("current", "verl", "verl", "checkpoint_engine", "base.py")
    rollout_side = ast_text(_method(base, "CheckpointEngineWorker", "__init__"))
    assert "import_external_libs(self.rollout_config.checkpoint_engine.custom_backend_module or None)" in rollout_side
    assert "CheckpointEngineRegistry.new(backend, bucket_size=bucket_size, **engine_kwargs)" in rollout_side
    receive = ast_text(_method(base, "CheckpointEngineWorker", "update_weights"))
    assert "self.checkpoint_engine.receive_weights(global_steps=global_steps)" in receive
    manager = ast_text(_method(base, "CheckpointEngineManager", "build_process_group"))
    # trainer workers' metadata first, then the rollout workers' (build_topology's metadata[0])
    assert "actor_wg.execute_checkpoint_engine(['prepare'] * actor_wg.world_size) + " \
           "rollout.execute_checkpoint_engine(['prepare'] * rollout.world_size)" in manager


def test_verl_09_colocated_sync_streams_the_engines_export_from_trainer_rank_r_to_rollout_rank_r_mod_w():
    """What the colocated path (verl09_colocated.py) relies on, read in verl 0.9.1's source: the
    naive branch of ``ActorRolloutRefWorker.update_weights`` (no checkpoint engine) streams
    ``actor.engine.get_per_tensor_param(layered_summon=..., base_sync_done=True)`` into
    ``self.rollout.update_weights`` -- the one call inside the worker patch's scope -- while the
    other branch calls the export with no arguments, outside it; in hybrid mode replica k holds
    trainer workers ``[k*W, (k+1)*W)`` and the ``ServerAdapter`` of trainer rank ``RANK`` is
    rollout rank ``RANK % W`` of replica ``RANK // W``, sending to the node-local socket of that
    vLLM worker. If this changes upstream, this test fails: revisit the colocated mapping."""
    from tests.support.stacks import source
    workers = source("current", "verl", "verl", "workers", "engine_workers.py")
    update = ast_text(_method(workers, "ActorRolloutRefWorker", "update_weights"))
    assert "if effective_mode != 'naive':" in update
    assert ("per_tensor_param, peft_config = self.actor.engine.get_per_tensor_param(layered_summon=self.layered_"
            "summon, base_sync_done=True)") in update
    assert "await self.rollout.update_weights(per_tensor_param, peft_config=peft_config" in update
    rollout = source("current", "verl", "verl", "workers", "rollout", "vllm_rollout", "vllm_rollout.py")
    adapter = ast_text(_method(rollout, "ServerAdapter", "__init__"))
    assert "self.replica_rank = rank // rollout_world_size" in adapter
    assert "self.rollout_rank = rank % rollout_world_size" in adapter
    assert "local_rank = self.rollout_rank % local_world_size" in adapter
    assert "-replica-{self.replica_rank}-rank-{local_rank}.sock" in adapter
    replica = source("current", "verl", "verl", "workers", "rollout", "replica.py")
    hybrid = ast_text(_method(replica, "RolloutReplica", "init_hybrid"))
    assert "worker_group.workers[self.world_size * self.replica_rank:self.world_size * (self.replica_rank + 1)]" in hybrid


def ast_text(node) -> str:
    import ast
    return ast.unparse(node)


def _class(path: str, name: str):
    import ast
    tree = ast.parse(open(path).read())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _defined(klass) -> set[str]:
    """Methods a class body defines and attributes its methods assign on ``self``."""
    import ast
    names = {n.name for n in klass.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(klass):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def _backend_engine_attributes() -> tuple[str, ...]:
    """``TrainingSource.ENGINE_ATTRIBUTES`` read from the backend's source (importing the backend
    imports verl and torch; this test stays static)."""
    import ast
    import os
    path = os.path.join(os.path.dirname(feature.__file__), "verl09_backend.py")
    source_cls = _class(path, "TrainingSource")
    (value,) = [n.value for n in source_cls.body if isinstance(n, ast.Assign)
                and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["ENGINE_ATTRIBUTES"]]
    return ast.literal_eval(value)


def test_verl_09_on_an_npu_the_mindspeed_engine_exports_through_the_megatron_engines_methods():
    """Which export path verl 0.9.1 takes on an NPU with MindSpeed, read in its source (MindSpeed,
    torch_npu and an NPU are absent here): the engine registry picks by device, MindSpeed's engine
    is the one registered for ``megatron`` on ``npu``, it is a ``MegatronEngineWithLMHead`` (a
    ``MegatronEngine``) that only re-patches MindSpeed before the parallel groups and adds FP8
    buffer handling on ``to``: the export (``get_per_tensor_param`` through Megatron-Bridge, and
    ``get_per_tensor_param_shard``) and the attributes the backend reads (``module``,
    ``tf_config``) are MegatronEngine's, unchanged. verl 0.9.1 has no separate MindSpeed-Bridge
    export (verl #7335 is not in this release): when one lands, this test fails -- re-check the
    backend's inputs on it (README, "verl 0.9", NPU export path)."""
    import os

    from tests.features.upstream_source import python_files
    from tests.support.stacks import source
    root = source("current", "verl", "verl")
    base = ast_text(_method(os.path.join(root, "workers", "engine", "base.py"), "EngineRegistry",
                            "get_engine_cls"))
    assert "device = get_device_name()" in base
    package = open(os.path.join(root, "workers", "engine", "__init__.py")).read()
    assert "from .mindspeed import MindspeedEngineWithLMHead" in package
    mindspeed = os.path.join(root, "workers", "engine", "mindspeed", "transformer_impl.py")
    megatron = os.path.join(root, "workers", "engine", "megatron", "transformer_impl.py")
    npu_engine = _class(mindspeed, "MindspeedEngineWithLMHead")
    assert [ast_text(b) for b in npu_engine.bases] == ["MegatronEngineWithLMHead"]
    assert [ast_text(d) for d in npu_engine.decorator_list] == [
        "EngineRegistry.register(model_type='language_model', backend='megatron', device='npu')"]
    assert _defined(npu_engine) == {"__init__", "_init_device_mesh", "to"}
    lm_head = _class(megatron, "MegatronEngineWithLMHead")
    assert [ast_text(b) for b in lm_head.bases] == ["MegatronEngine"]
    reads = set(_backend_engine_attributes()) | {"get_per_tensor_param_shard"}
    assert reads <= _defined(_class(megatron, "MegatronEngine"))
    assert not reads & (_defined(lm_head) | _defined(npu_engine))
    # every MindSpeed module verl 0.9.1 imports: the adaptor's repatch (the engine above), FP8
    # buffer reuse (its ``to``), CP batch helpers, the checkpoint merger, torch_functional's patch
    # manager -- no bridge, no weight export of MindSpeed's own
    assert _mindspeed_imports(root, python_files) == {
        "mindspeed.core.context_parallel.get_batch_utils", "mindspeed.utils", "mindspeed.megatron_adaptor",
        "mindspeed.te.pytorch.fp8.reuse", "mindspeed.patch_utils"}


def _mindspeed_imports(root: str, python_files) -> set[str]:
    import ast
    found = set()
    for path in python_files(root):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "mindspeed":
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "mindspeed"}
    return found


# -- the rollout side's expert maps --------------------------------------------------------------

def _fused(expert_map, experts=4, local=None, inter=2, hidden=3):
    """A module carrying what vLLM's FusedMoE exposes to the reshard (the attribute names and
    shapes read in vLLM 0.13 / 0.23: ``_expert_map`` with -1 for experts hosted elsewhere,
    ``w13_weight [E_local, 2I, H]``, ``w2_weight [E_local, H, I]``)."""
    torch = pytest.importorskip("torch")
    module = torch.nn.Module()
    n = experts if local is None else local
    module.w13_weight = torch.nn.Parameter(torch.zeros(n, 2 * inter, hidden), requires_grad=False)
    module.w2_weight = torch.nn.Parameter(torch.zeros(n, hidden, inter), requires_grad=False)
    module.global_num_experts = experts
    module._expert_map = None if expert_map is None else torch.tensor(expert_map)
    return module


def _model(*layers):
    torch = pytest.importorskip("torch")
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for fused in layers:
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.experts = fused
        model.layers.append(block)
    return model


def test_expert_maps_are_read_as_global_ids_in_local_slot_order():
    from ascend_rl_plugins.features.moe_reshard import vllm_side
    assert vllm_side.expert_map_of(_fused(None)) == (0, 1, 2, 3)
    assert vllm_side.expert_map_of(_fused([-1, 1, -1, 0], local=2)) == (3, 1)
    with pytest.raises(ValueError, match="holes"):
        vllm_side.expert_map_of(_fused([-1, 2, -1, 0], local=2))
    model = _model(_fused([0, -1, 1, -1], local=2), _fused([0, -1, 1, -1], local=2))
    assert vllm_side.local_expert_map(model) == (0, 2)
    with pytest.raises(ValueError, match="per-layer"):
        vllm_side.local_expert_map(_model(_fused([0, -1, 1, -1], local=2), _fused([1, -1, 0, -1], local=2)))


def test_a_pre_narrowed_slice_goes_to_its_slot_and_rows_and_a_wrong_layout_is_refused():
    torch = pytest.importorskip("torch")
    from ascend_rl_plugins.features.moe_reshard import vllm_side
    fused = _fused([-1, 1, -1, 0], local=2)
    model = _model(fused)
    gate, up, down = torch.full((2, 3), 1.0), torch.full((2, 3), 2.0), torch.full((3, 2), 3.0)
    for proj, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        vllm_side.load_pre_narrowed(model, f"model.layers.0.mlp.experts.1.{proj}.weight", t)
    assert torch.equal(fused.w13_weight[1], torch.cat([gate, up])) and torch.equal(fused.w2_weight[1], down)
    assert not fused.w13_weight[0].any() and not fused.w2_weight[0].any()
    with pytest.raises(ValueError, match="not hosted"):
        vllm_side.load_pre_narrowed(model, "model.layers.0.mlp.experts.2.gate_proj.weight", gate)
    with pytest.raises(ValueError, match="does not fit"):
        vllm_side.load_pre_narrowed(model, "model.layers.0.mlp.experts.3.gate_proj.weight", torch.ones(3, 3))
    assert vllm_side.checkpoint_layout(model, hidden=3)
    fused.w13_weight = torch.nn.Parameter(fused.w13_weight.data.transpose(1, 2).contiguous(), requires_grad=False)
    assert not vllm_side.checkpoint_layout(model, hidden=3)  # as vLLM-Ascend leaves it after loading


# -- every fallback is collective: exactly one rank of four refuses -----------------------------

@pytest.fixture(scope="module")
def one_refuses():
    if not require_installed("torch", "megatron-core", "verl").startswith("0.6."):
        pytest.skip("the per_tensor_generator hook is for verl 0.6.x")
    return run_group("tests.features.moe_reshard.verl06_scenario", "one_rank_refuses", 4, 2, env=ENV, timeout=600)


@pytest.mark.parametrize("case,says", [
    ("validation", "rank 1: plan: rank 1 receives 1 bytes, minimum 0 (injected)"),
    ("planner", "rank 2: plan: moe ffn hidden 8 is not divisible by etp 3 (injected)"),
    ("exception", "rank 3: plan: RuntimeError: expert parameters unreadable (injected)"),
    ("setup_exception", "rank 0: setup: KeyError: 'num_moe_experts (injected)'"),
    ("digest", "ranks would plan from different inputs (2 plan digests: "),
])
def test_one_rank_refusing_makes_every_rank_take_the_stock_path_with_one_warning(one_refuses, case, says):
    """A plan that fails validation, a planner refusal, an exception while preparing, an
    exception while reading the layouts, a flag set differently: on one rank of four only. Every
    rank syncs exactly stock's tensors (no partial sync), none deadlocks (the group's timeout),
    and each logs one WARNING naming the refusing rank and its reason."""
    for r in one_refuses:
        got = r[case]
        assert got["equals_stock"] and got["tensors"] == r["stock_tensors"], (case, r["rank"], got)
        assert len(got["log"]) == 1, got["log"]
        assert got["log"][0].startswith("WARNING ascend-rl moe_reshard: falling back to stock weight sync: " + says), got
    # without a refusal the same ranks reshard (fewer tensors than stock), before and after
    for r in one_refuses:
        assert r["healthy"]["tensors"] < r["stock_tensors"] and r["after"] == r["healthy"]


def test_after_an_expert_map_change_each_rank_receives_exactly_what_it_hosts_now(one_refuses):
    """verl #7086's failure mode (stale expert ids after EPLB / a wake-up): the map of this sync
    is part of the plan key, so a changed map is planned afresh instead of reusing the cached
    plan; every rank gets exactly its newly hosted expert (each projection of each layer once),
    equal to stock's tensor, and the old plan stays cached beside the new one."""
    for r in one_refuses:
        m = r["moved"]
        assert m["expert_ids"] == m["hosted"] == [(r["rank"] + 1) % 4], m
        assert m["names"] == 2 * 3 and m["equal_stock"], m
        assert m["plans_cached"] == 2
