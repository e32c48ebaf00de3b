"""Child-process scenario of ``tests/test_packaging.py``: the package as a user's
``pip install <wheel>`` has it, never the checkout.

Run with the wheel's install directory first on ``PYTHONPATH`` and a working directory
outside the repository, so ``import ascend_rl_plugins`` finds the installed copy.
"""

from __future__ import annotations

import contextlib
import io
import os


def check_installed(site: str) -> dict:
    """Import (activating, with HDP on), load HDP's default cost model, run doctor; return
    where the package came from and what each step gave."""
    import ascend_rl_plugins
    from ascend_rl_plugins import cli
    from ascend_rl_plugins.features.hdp import cost_model

    model = cost_model.CostModel.load()  # the shipped default_cost_model.json
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        doctor_exit = cli.main(["doctor", "--json"])
    import json
    report = json.loads(out.getvalue())
    return {
        "package_file": ascend_rl_plugins.__file__,
        "from_site": os.path.realpath(ascend_rl_plugins.__file__).startswith(os.path.realpath(site) + os.sep),
        "activated_by": ascend_rl_plugins.plugin.activated_by(),
        "cost_model_path": cost_model.DEFAULT_PATH,
        "cost_model_fields": sorted(model.to_dict()),
        "doctor_exit": doctor_exit,
        "doctor_patches": len(report["patches"]),
        "doctor_problems": [r["patch"] for r in report["patches"] if r["problem"]],
    }


def engine_from_installed(site: str, model_path: str) -> dict:
    """A real in-process vLLM engine whose general-plugin loader loads the installed copy;
    one greedy generation with gc_off switched on by the environment."""
    from vllm import LLM, SamplingParams

    import ascend_rl_plugins
    llm = LLM(model=model_path, enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)
    out = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0))
    states = {s["patch"]: s["state"] for s in ascend_rl_plugins.status()}
    return {"from_site": os.path.realpath(ascend_rl_plugins.__file__).startswith(os.path.realpath(site) + os.sep),
            "activated_by": ascend_rl_plugins.plugin.activated_by(),
            "gc_off": states.get("gc_off.llm_engine_step"),
            "tokens": len(out[0].outputs[0].token_ids)}
