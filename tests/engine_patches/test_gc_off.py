"""gc-off decode in a real vLLM engine on CPU (both stacks).

The engine run lives in conftest.py (``engine_result``, shared with the RoPE test):
one subprocess, one engine, three scenarios on the same engine:
  full      - both patches (LLMEngine.step and EngineCore.step) active;
  core_only - the LLMEngine.step patch reverted: only the engine-core one (bound into
              EngineCore.step_fn at construction) keeps GC off -> the server path;
  baseline  - every gc_off patch reverted and step_fn rebound to the pristine method.
Young-generation collections are counted with gc.callbacks while a step runs, and the
collector threshold is sampled inside the step (in Scheduler.schedule).
"""

from __future__ import annotations

import os

import pytest

from helpers import vllm_version

pytestmark = pytest.mark.skipif(vllm_version() is None, reason="vLLM is not installed in this interpreter")


def test_patches_apply_in_the_engine_process(engine_result):
    states = engine_result["states"]
    for name in ("gc_off.llm_engine_step", "gc_off.engine_core_step",
                 "gc_off.engine_core_step_with_batch_queue"):
        assert states[name] == "applied", states
    assert engine_result["step_fn_is_patched"], "EngineCore bound step_fn before the patch"


def test_no_young_collection_inside_offline_steps(engine_result):
    full = engine_result["full"]
    assert full["steps"] > 5
    assert full["young"] == 0, full
    assert full["thresholds"] == [0], full


def test_engine_core_path_alone_keeps_gc_off(engine_result):
    core_only = engine_result["core_only"]
    assert core_only["steps"] > 5
    assert core_only["young"] == 0, core_only
    assert core_only["thresholds"] == [0], core_only


def test_baseline_without_patch_collects_inside_steps(engine_result):
    """The same probes see collections once the patches are gone: the test has teeth."""
    baseline = engine_result["baseline"]
    assert baseline["young"] > 0, baseline
    assert baseline["thresholds"] == [engine_result["threshold_before"][0]], baseline


def test_threshold_restored_after_steps_and_after_an_exception(engine_result):
    before = engine_result["threshold_before"]
    assert before[0] > 0
    assert engine_result["raised"]
    assert engine_result["threshold_in_raising_step"] == 0
    assert engine_result["threshold_after_exception"] == engine_result["threshold_before_exception"]
    for scenario in ("full", "core_only", "baseline"):
        assert engine_result[scenario]["threshold_after"] == before, scenario


def test_idle_collection_runs_once_when_the_engine_drains(engine_result):
    assert engine_result["full"]["idle_collections"] == 1
    assert engine_result["core_only"]["idle_collections"] == 1
    assert engine_result["baseline"]["idle_collections"] == 0


def test_engine_core_init_loads_the_plugin_before_binding_step_fn(engine_result):
    """Nothing activates the plugin in the script before EngineCore.__init__ does."""
    assert engine_result["load_before_bind"]
    assert engine_result["wrapped_before"] is False
    assert engine_result["activated_by"] == ["vllm.general_plugins"]
    assert engine_result["wrapped_after"] is True


def test_sleep_triggers_one_full_collection(engine_result):
    assert engine_result["sleep_calls"] == [["sleep", 1]]
    assert engine_result["sleep_collections"] == 1
    assert engine_result["states"]["gc_off.collect_after_enginecore_sleep"] == "applied"


# Installed as sitecustomize in every process of the engine (front end, spawned engine
# core, workers): counts young collections between Scheduler.schedule() entry and
# Scheduler.update_from_output() exit -- which only the engine-core process runs -- and
# rewrites probe_<pid>.json after every step.
PROBE_SITECUSTOMIZE = r"""
import gc, json, os
_dir = os.environ["ASCEND_RL_GC_PROBE_DIR"]
_probe = {"pid": os.getpid(), "in_step": False, "young": 0, "steps": 0, "thresholds": []}

def _on_gc(phase, info):
    if phase == "start" and _probe["in_step"] and info["generation"] < 2:
        _probe["young"] += 1

def _instrument(module):
    cls = module.Scheduler
    schedule, update = cls.schedule, cls.update_from_output
    def marked_schedule(self, *a, **k):
        if not _probe.get("measuring") and os.path.exists(os.path.join(_dir, "measure")):
            # the driver finished its warm-up run (torch.compile calls gc.collect itself)
            _probe.update(measuring=True, young=0, steps=0, thresholds=[])
            # frequent collections whenever the collector is on (with the patch this runs
            # inside a step, so the patch's restore of the saved threshold wins)
            gc.set_threshold(100, 10, 10)
        _probe["in_step"] = True
        _probe["steps"] += 1
        _probe["thresholds"].append(gc.get_threshold()[0])
        return schedule(self, *a, **k)
    def marked_update(self, *a, **k):
        try:
            return update(self, *a, **k)
        finally:
            _probe["in_step"] = False
            if _probe.get("measuring") and _probe["steps"] == 1:
                _probe["young"] = 0  # the first measured step lowered the threshold mid-step
            state = dict(_probe, thresholds=sorted(set(_probe["thresholds"][1:])))
            try:
                from ascend_rl_plugins.plugin import activated_by, status
                state["activated_by"] = activated_by()
                state["states"] = {s["patch"]: s["state"] for s in status() if s["patch"].startswith("gc_off.")}
            except Exception as exc:
                state["error"] = repr(exc)
            path = os.path.join(_dir, f"probe_{os.getpid()}.json")
            with open(path + ".tmp", "w") as fh:  # atomic: the driver may be reading
                json.dump(state, fh)
            os.replace(path + ".tmp", path)
    cls.schedule, cls.update_from_output = marked_schedule, marked_update

gc.callbacks.append(_on_gc)
import wrapt
wrapt.register_post_import_hook(_instrument, "vllm.v1.core.sched.scheduler")
"""

SERVER_PATH_SCRIPT = r"""
import glob, json, os
from vllm import LLM, SamplingParams
llm = LLM(model=os.environ["TINY_MODEL"], enforce_eager=True, max_model_len=256, max_num_seqs=16,
          dtype="bfloat16", seed=0)
params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0)
prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 400 for j in range(24)]} for i in range(16)]
llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
open(os.path.join(os.environ["ASCEND_RL_GC_PROBE_DIR"], "measure"), "w").close()
llm.generate(prompts, params, use_tqdm=False)
probes = [json.load(open(p)) for p in glob.glob(os.path.join(os.environ["ASCEND_RL_GC_PROBE_DIR"], "probe_*.json"))]
emit({"front_end_pid": os.getpid(), "probes": probes})
"""

SERVER_PATH_GC_OFF = os.environ.get("ASCEND_RL_TEST_SERVER_PATH_GC_OFF", "1")


def test_server_path_engine_core_process_runs_steps_without_gc(tiny_model_path, tmp_path):
    """A real multiprocess engine: the engine core is a separate *spawned* process, where
    only vLLM's own plugin loading (in EngineCore.__init__) can have applied the patch.
    (ASCEND_RL_TEST_SERVER_PATH_GC_OFF=0 runs the same probe without the patch, which must
    then see collections; not part of the default suite to save an engine start.)"""
    from helpers import ENGINE_ENV, run_python
    gc_off = SERVER_PATH_GC_OFF
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PROBE_SITECUSTOMIZE)
    pythonpath = os.pathsep.join([str(site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = dict(ENGINE_ENV, TINY_MODEL=tiny_model_path, ASCEND_RL_GC_OFF=gc_off,
               VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_WORKER_MULTIPROC_METHOD="spawn",
               ASCEND_RL_GC_PROBE_DIR=str(tmp_path), PYTHONPATH=pythonpath)
    out = run_python(SERVER_PATH_SCRIPT, env=env, timeout=600)
    stepping = [p for p in out["probes"] if p.get("measuring") and p["steps"] > 0]
    assert len(stepping) == 1, out
    result = stepping[0]
    assert result["pid"] != out["front_end_pid"]
    assert "vllm.general_plugins" in result["activated_by"]
    assert result["steps"] > 5
    if gc_off == "1":
        assert result["states"]["gc_off.engine_core_step"] == "applied"
        assert result["young"] == 0, result
        assert result["thresholds"] == [0], result
    else:  # the same probe sees collections without the patch: the test has teeth
        assert result["young"] > 0, result
        assert result["thresholds"] == [100], result
