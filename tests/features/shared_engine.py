"""Real vLLM engines on CPU, built once per test session and checked by several features.

An engine costs ~20 s to build on 2 cores, so instead of one engine per feature one child
process builds one engine and runs every feature's checks on it, in the order of the step
lists below; ``tests/features/conftest.py`` runs each scenario once per session
(``shared_engine``: in-process engine, as verl 0.6's SPMD rollout and offline ``LLM`` use;
``multiprocess_engine``: the engine core in a spawned process, as under ``vllm serve`` and
verl 0.9's server rollout).

A feature takes part through a module ``tests/features/<feature>/engine_checks.py`` with

- ``ENV`` / ``MULTIPROCESS_ENV``: environment its checks need (``{workdir}`` is replaced by
  the scenario's own directory); the fixtures merge them;
- step functions ``fn(ctx) -> dict`` named in the lists below; ``ctx.llm`` is the engine
  (``None`` before it is built), ``ctx.workdir`` a private directory, and steps may leave
  values on ``ctx`` for later steps of the same feature. Their dicts are merged into
  ``results[<feature>]``.

A step that raises records its traceback under its feature, so one feature's failure does
not hide the others' results; :func:`part` turns it back into a failure of that feature's
tests. Steps that revert patches or change process-wide state come last.
"""

from __future__ import annotations

import importlib
import os
import traceback
import types

BUILD = ("engine", "build")

IN_PROCESS_STEPS = [
    ("tests.features.cpu_rms_norm.engine_checks", "before_engine"),  # transformers reference
    ("tests.features.gc_off.engine_checks", "before_engine"),  # must be the first to load vLLM's plugins
    ("tests.features.rope_registry.engine_checks", "before_engine"),  # torch.npu and flash_attn doubles
    BUILD,
    ("tests.features.rope_registry.engine_checks", "built_engine"),  # removes the torch.npu double
    ("tests.features.cpu_rms_norm.engine_checks", "with_engine"),
    ("tests.features.diagnostics.engine_checks", "records"),
    ("tests.features.gc_off.engine_checks", "in_process"),  # reverts the gc_off patches
    ("tests.features.rope_registry.engine_checks", "construction"),  # reverts the rope patch
]

MULTIPROCESS_STEPS = [
    BUILD,
    ("tests.features.gc_off.engine_checks", "multiprocess"),  # reverts gc_off in the engine core
    ("tests.features.diagnostics.engine_checks", "records"),
]

# Imported by sitecustomize (tests/features/engine_site) in every process of the
# multiprocess scenario, spawned engine core included: each module's install() runs there.
IN_EVERY_PROCESS = ["tests.features.gc_off.step_probe"]

ENGINE_ARGS = dict(enforce_eager=True, max_model_len=256, max_num_seqs=16, dtype="float32", seed=0)
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_site")


def feature_of(module: str) -> str:
    return module.split(".")[2]


def env_for(steps, workdir: str, *, multiprocess: bool) -> dict:
    """The environment the features of ``steps`` ask for."""
    env: dict[str, str] = {}
    for module in dict.fromkeys(module for module, function in steps if (module, function) != BUILD):
        wanted = getattr(importlib.import_module(module), "MULTIPROCESS_ENV" if multiprocess else "ENV", {})
        env.update({k: v.format(workdir=workdir) for k, v in wanted.items()})
    return env


def _build(ctx):
    from vllm import LLM
    return LLM(model=ctx.model, **ENGINE_ARGS)


def _run(steps, workdir: str) -> dict:
    from ascend_rl_plugins.devtools import tiny_qwen3
    ctx = types.SimpleNamespace(workdir=workdir, model=tiny_qwen3.cached(), llm=None)
    results: dict = {"pid": os.getpid()}
    for module, function in steps:
        if (module, function) == BUILD:
            ctx.llm = _build(ctx)  # no engine: the scenario fails, with this traceback
            continue
        part_result = results.setdefault(feature_of(module), {})
        try:
            part_result.update(getattr(importlib.import_module(module), function)(ctx) or {})
        except Exception:
            part_result.setdefault("errors", []).append(f"{function}:\n{traceback.format_exc()}")
    return results


def in_process(workdir: str) -> dict:
    """One in-process engine (run with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return _run(IN_PROCESS_STEPS, workdir)


def multiprocess(workdir: str) -> dict:
    """One engine whose engine core is a spawned process (run with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` and
    :data:`SITE_DIR` on ``PYTHONPATH``): there only vLLM's own plugin loading can have
    activated ascend-rl. ``results["pid"]`` is the front end's pid."""
    return _run(MULTIPROCESS_STEPS, workdir)


def in_every_process() -> None:
    for module in IN_EVERY_PROCESS:
        importlib.import_module(module).install()


def part(results: dict, feature: str) -> dict:
    """``results[feature]``; a step of that feature that raised fails the calling test."""
    got = results.get(feature)
    if got is None:
        raise AssertionError(f"no engine checks ran for {feature}")
    if got.get("errors"):
        raise AssertionError(f"engine checks of {feature} raised:\n" + "\n".join(got["errors"]))
    return got
