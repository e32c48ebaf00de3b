"""The one real vLLM engine run of tests/engine_patches, shared by its test modules.

Engines cost ~20 s to build on 2 cores, so one subprocess runs every scenario that needs a
real engine and emits all results; ``engine_result`` is session-scoped.
"""

from __future__ import annotations

import os

import pytest

from helpers import ENGINE_ENV, run_python

ENGINE_SCRIPT = r"""
import gc, os
import ast, inspect
import vllm.v1.engine.core as core_mod
from vllm.v1.engine.core import EngineCore

# 1) statically: EngineCore.__init__ loads general plugins before it binds step_fn
src = inspect.getsource(EngineCore.__init__)
lines = src.splitlines()
load_line = next(i for i, l in enumerate(lines) if "load_general_plugins()" in l)
bind_line = next(i for i, l in enumerate(lines) if "self.step_fn" in l and "=" in l)

# 2) at run time, in a process where nothing activated the plugin yet: the plugin loading
# done by EngineCore.__init__ itself wraps EngineCore.step (construction is stopped right
# after the plugin call by a config object that raises on first use)
class _StopHere(Exception):
    pass
class _Config:
    def __getattr__(self, name):
        raise _StopHere(name)
before = hasattr(EngineCore.step, "__wrapped__")
try:
    EngineCore(_Config(), None, False)
except _StopHere:
    pass
from ascend_rl_plugins.plugin import activated_by
out = {"load_before_bind": load_line < bind_line, "wrapped_before": before,
       "wrapped_after": hasattr(EngineCore.step, "__wrapped__"), "activated_by": activated_by()}

from ascend_rl_plugins.patching.core import REGISTRY
from ascend_rl_plugins.features import gc_off
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.core.sched.scheduler import Scheduler
out["states"] = {n: p.outcome.state for n, p in REGISTRY.patches.items() if n.startswith("gc_off.")}

# -- sleep: the real patched EngineCore.sleep on an instance with a recording executor
sleep_calls = []
class _Executor:
    is_sleeping = False
    def sleep(self, level):
        sleep_calls.append(["sleep", level])
sleeping_core = EngineCore.__new__(EngineCore)
sleeping_core.model_executor = _Executor()
sleeping_core.pause_scheduler = lambda **kw: None  # vLLM 0.23 pauses scheduling first
collections_before_sleep = gc_off.GUARD.idle_collections
EngineCore.sleep(sleeping_core, 1)
out["sleep_calls"] = sleep_calls
out["sleep_collections"] = gc_off.GUARD.idle_collections - collections_before_sleep
original_threshold = gc.get_threshold()
out["threshold_before_exception"] = list(original_threshold)

# -- exceptions: the real patched EngineCore.step on an instance whose scheduler raises
class _Boom(Exception):
    pass
class _RaisingScheduler:
    def has_requests(self):
        out["threshold_in_raising_step"] = gc.get_threshold()[0]
        raise _Boom()
fake_core = EngineCore.__new__(EngineCore)
fake_core.scheduler = _RaisingScheduler()
try:
    EngineCore.step(fake_core)
except _Boom:
    out["raised"] = True
out["threshold_after_exception"] = list(gc.get_threshold())

# -- probes: young collections inside steps, threshold inside a step. A step is marked
# from Scheduler.schedule() entry to the exit of the last call the scenario's wrapped
# method makes (OutputProcessor.process_outputs for LLMEngine.step, Scheduler.
# update_from_output for EngineCore.step), so nothing of the probe's own wrapping counts.
from vllm.v1.engine.output_processor import OutputProcessor
probe = {"in_step": False, "young": 0, "steps": 0, "thresholds": [], "end_at": "process_outputs"}
def on_gc(phase, info):
    if phase == "start" and probe["in_step"] and info["generation"] < 2:
        probe["young"] += 1
gc.callbacks.append(on_gc)
pristine_schedule = Scheduler.schedule
def schedule(self, *a, **k):
    probe["in_step"] = True
    probe["steps"] += 1
    probe["thresholds"].append(gc.get_threshold()[0])
    return pristine_schedule(self, *a, **k)
Scheduler.schedule = schedule
def ending(cls, name, label):
    pristine = getattr(cls, name)
    def ended(*a, **k):
        try:
            return pristine(*a, **k)
        finally:
            if probe["end_at"] == label:
                probe["in_step"] = False
    setattr(cls, name, ended)
ending(Scheduler, "update_from_output", "update_from_output")
ending(OutputProcessor, "process_outputs", "process_outputs")

# RoPE registry, in the same engine: a torch.npu double and a flash_attn double package
# are visible while the model is built (see test_rope_registry.py)
import sys, types, torch
sys.path.insert(0, os.environ["FLASH_ATTN_DOUBLE"])
torch.npu = types.ModuleType("torch_npu_double")

from vllm import LLM, SamplingParams
llm = LLM(model=os.environ["TINY_MODEL"], enforce_eager=True, max_model_len=256, max_num_seqs=16,
          dtype="bfloat16", seed=0)
core = llm.llm_engine.engine_core.engine_core
del torch.npu
model = core.model_executor.driver_worker.worker.model_runner.model
rotary = [m for m in model.modules() if type(m).__name__ == "ApplyRotaryEmb"]
out["rope"] = {"state": REGISTRY.patches["rope_registry.find_spec"].outcome.state,
               "instances": len(rotary),
               "flash_attn_picked": [m.apply_rotary_emb_flash_attn is not None for m in rotary]}
out["step_fn_is_patched"] = hasattr(type(core).step, "__wrapped__") and \
    getattr(core.step_fn, "__wrapped__", None) is not None
params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0)
prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 400 for j in range(24)]} for i in range(16)]

# warm-up: the first sampling compiles a kernel with torch.compile, and dynamo calls
# gc.collect(1) explicitly; explicit collections are not what the patch is about.
llm.generate(prompts[:2], params, use_tqdm=False)
# A low threshold makes automatic collections frequent whenever the collector is on, so
# the baseline below is sure to see some; the patch must restore exactly this value.
gc.set_threshold(100, 10, 10)
out["threshold_before"] = list(gc.get_threshold())

def run(name):
    probe.update(young=0, steps=0, thresholds=[])
    idle_before = gc_off.GUARD.idle_collections
    llm.generate(prompts, params, use_tqdm=False)
    out[name] = {"young": probe["young"], "steps": probe["steps"],
                 "thresholds": sorted(set(probe["thresholds"])),
                 "threshold_after": list(gc.get_threshold()),
                 "idle_collections": gc_off.GUARD.idle_collections - idle_before}

# full: both wrappers; a step ends with the offline output processing
run("full")

# core_only: revert the offline wrapper; the step is EngineCore.step (bound step_fn)
REGISTRY.revert(REGISTRY.patches["gc_off.llm_engine_step"])
probe["end_at"] = "update_from_output"
run("core_only")

# baseline: no gc_off patch at all; rebind step_fn as a fresh EngineCore would
for name in ("gc_off.engine_core_step", "gc_off.engine_core_step_with_batch_queue"):
    REGISTRY.revert(REGISTRY.patches[name])
core.step_fn = core.step
run("baseline")
emit(out)
"""


FLASH_ATTN_DOUBLE = os.path.join(os.path.dirname(__file__), "doubles", "flash_attn_double")


@pytest.fixture(scope="session")
def engine_result(tiny_model_path):
    """The one real engine of tests/engine_patches (gc_off + rope_registry use it)."""
    env = dict(ENGINE_ENV, TINY_MODEL=tiny_model_path, ASCEND_RL_GC_OFF="1",
               ASCEND_RL_GC_OFF_IDLE_COLLECT="1", FLASH_ATTN_DOUBLE=FLASH_ATTN_DOUBLE)
    return run_python(ENGINE_SCRIPT, env=env, timeout=600)
