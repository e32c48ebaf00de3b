"""Child-process scenarios of tests/test_plugin.py and tests/test_cli.py (fresh interpreters:
activation is once per process)."""

from __future__ import annotations

import os
import sys

HEAVY = ("torch", "vllm", "verl", "numpy", "numba", "megatron")


def import_package() -> dict:
    """What ``import ascend_rl_plugins`` costs and does in a custom trainer."""
    import ascend_rl_plugins
    from ascend_rl_plugins.patching.core import REGISTRY
    return {"heavy": sorted(m for m in HEAVY if m in sys.modules),
            "activated": ascend_rl_plugins.plugin.activated_by(),
            "patches": len(REGISTRY.patches)}


def load_verl_entry_point() -> list:
    """verl >= 0.9 only calls ``entry_point.load()`` on the ``verl.plugins`` group."""
    from importlib.metadata import entry_points
    ep = next(e for e in entry_points(group="verl.plugins") if e.name == "ascend_rl")
    ep.load()
    import ascend_rl_plugins
    return ascend_rl_plugins.plugin.activated_by()


def import_cli() -> dict:
    """Importing the CLI module (as the console script does) must neither activate nor leave
    a private marker in the environment that child processes would inherit."""
    import ascend_rl_plugins.cli  # noqa: F401
    from ascend_rl_plugins import plugin
    return {"marker": sorted(k for k in os.environ if k.startswith("_ASCEND_RL")),
            "activated": plugin.activated_by()}


def engines_in_both_modes(model_path: str) -> dict:
    """One generation with the engine core in a subprocess (verl 0.9 server style), one
    in-process (verl 0.6 spmd style)."""
    from vllm import LLM, SamplingParams

    def run(mp: bool) -> int:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mp else "0"
        llm = LLM(model=model_path, enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)
        out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0))
        n = len(out[0].outputs[0].token_ids)
        del llm
        return n

    return {"pid": os.getpid(), "mp": run(True), "inproc": run(False)}


def vllm_plugin_loader() -> list:
    """What vLLM does first in every process it starts (the caller's, the engine core, each
    worker): ``vllm.plugins.load_general_plugins()`` loads every ``vllm.general_plugins``
    entry point and calls it. Returns who activated ascend-rl (if the process got here)."""
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import ascend_rl_plugins
    return ascend_rl_plugins.plugin.activated_by()


def cli_without(modules: list, argv: list) -> dict:
    """``ascend-rl <argv>`` in an interpreter where ``modules`` cannot be imported:
    ``sys.modules[name] = None`` is Python's own way to make ``import name`` fail (and
    ``importlib.util.find_spec(name)`` say it is absent), as on a machine without them.
    Returns the exit status and stderr, or the uncaught exception's type."""
    import contextlib
    import io
    for name in modules:
        sys.modules[name] = None
    from ascend_rl_plugins import cli
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:  # what a user would have seen as a traceback
            return {"code": None, "stderr": err.getvalue(), "uncaught": type(exc).__name__}
    return {"code": code, "stderr": err.getvalue(), "uncaught": None}
