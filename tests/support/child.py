"""Run a scenario -- a function in an importable test module -- in a fresh interpreter.

Tests that patch global state, start a vLLM engine or form a gloo group run in child
processes so that the pytest process stays pristine and one test cannot leak patches into
another. The child code is an ordinary module (linted, importable, with real tracebacks),
never Python source held in a string: ``run_scenario("tests.features.gc_off.scenario",
"server_path", arg, env=...)`` runs ``python -m tests.support.child`` which imports the
module, calls the function with the JSON-decoded arguments and prints its JSON-able return
value behind a marker line.

``run_group`` does the same in N processes forming a ``torch.distributed`` gloo group
(torchrun-style environment); every rank tears the group down together at the end, since
a rank that left while its peers still talked to it (rank 0 also hosts the rendezvous
store) was seen to abort at exit after emitting a correct result.

A scenario may return a dataclass (nested dataclasses, lists, dicts and ``X | None`` of them
included): it crosses as JSON and ``run_scenario(..., returns=ThatClass)`` rebuilds it, so a
test reads fields, not keys, and a failing assertion still prints every number.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

from tests.support.ports import free_port  # noqa: F401  (the scenarios' rendezvous ports; re-exported)

MARK = "@@ARP_TEST_RESULT@@"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Environment for child processes that build a vLLM engine on CPU.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "2",
}

# For engines that only decode greedily: vLLM 0.23's CPU sampler wraps its random-sampling
# helper (``topk_topp_sampler.compiled_random_sample``) in ``torch.compile``, and the engine's
# warm-up (a dummy sampler run, random sampling) compiles it with inductor in every process,
# enforce_eager or not. Profiled (cProfile, one in-process engine, tiny Qwen3, this 2-core VM
# with Inductor's on-disk cache warm): 22 s of a 26 s engine build, 20 s of them Inductor
# checking which vector ISAs this CPU can run (it starts a fresh Python that imports torch per
# ISA, in every process; TORCHINDUCTOR_VEC_ISA_OK skips only the first of these checks).
# Those checks are now remembered across processes (tests/support/isa_probe_cache.py), so
# only the first compiling process on a machine pays them; the compile itself remains.
# Greedy requests never call that helper; with torch.compile off the warm-up runs it eagerly.
# The same switch leaves vLLM's compiled log-prob rank helper eager (identical integer counts).
# Only for processes whose every request is greedy: engines that sample keep the compiled path.
GREEDY_ENGINE_ENV = {"TORCH_COMPILE_DISABLE": "1"}


def _child_env(env: dict | None, path_first: str | None = None) -> dict:
    full = dict(os.environ)
    if "ARP_TEST_PARENT_VERL_PLUGINS" in full:  # undo what tests/conftest.py did to the parent
        parent = full.pop("ARP_TEST_PARENT_VERL_PLUGINS")
        if parent:
            full["VERL_USE_EXTERNAL_PLUGINS"] = parent
        else:
            full.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    full.update(env or {})
    path = full.get("PYTHONPATH", "")
    full["PYTHONPATH"] = os.pathsep.join(p for p in (path_first, REPO, path) if p)
    return full


def _command(module: str, function: str, args: tuple, python: str | None, group: bool) -> list[str]:
    payload = json.dumps({"module": module, "function": function, "args": list(args), "group": group})
    return [python or sys.executable, "-m", "tests.support.child", payload]


def _result(out: str) -> tuple[bool, Any]:
    got = [line[len(MARK):] for line in out.splitlines() if line.startswith(MARK)]
    return (True, json.loads(got[-1])) if got else (False, None)


def rebuild(kind: Any, data: Any) -> Any:
    """``data`` (decoded JSON) as the annotated type ``kind``: dataclasses field by field
    (their annotations resolved in their own module), ``list[X]``, ``dict[str, X]`` and
    ``X | None`` recursively; anything else as JSON gave it."""
    if data is None:
        return None
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return kind(**{f.name: rebuild(hints[f.name], data[f.name])
                       for f in dataclasses.fields(kind) if f.name in data})
    origin, parts = typing.get_origin(kind), typing.get_args(kind)
    if origin is list or origin is collections.deque:   # a deque crosses as a list (_sequence_as_list)
        return [rebuild(parts[0], item) for item in data]
    if origin is dict:
        return {key: rebuild(parts[1], value) for key, value in data.items()}
    if origin in (typing.Union, types.UnionType):
        options = [p for p in parts if p is not type(None)]
        return rebuild(options[0], data) if len(options) == 1 else data
    return data


def run_scenario(module: str, function: str, *args: Any, env: dict | None = None,
                 timeout: float = 900, python: str | None = None, cwd: str | None = None,
                 path_first: str | None = None, returns: type | None = None) -> Any:
    """``module.function(*args)`` in a fresh interpreter; returns its (JSON) result, rebuilt
    as ``returns`` (a dataclass) where given.

    ``path_first`` goes on ``PYTHONPATH`` before the repository (an installed copy of the
    package that must win over the checkout); ``cwd`` defaults to the repository.
    A non-zero exit or a missing result raises AssertionError with the output tails."""
    proc = subprocess.run(_command(module, function, args, python, False), env=_child_env(env, path_first),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO)
    ok, result = _result(proc.stdout)
    if proc.returncode != 0 or not ok:
        raise AssertionError(f"{module}.{function} failed in a child process (exit {proc.returncode})\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return rebuild(returns, result) if returns is not None else result


@dataclass
class Exited:
    """How a scenario's interpreter ended, for scenarios that are expected to stop early
    (a bad flag at plugin load): its exit status, its output, and its result if it got
    that far."""

    returncode: int
    stdout: str
    stderr: str
    finished: bool  # the scenario function returned (its result was printed)
    result: Any = None


def run_scenario_to_exit(module: str, function: str, *args: Any, env: dict | None = None,
                         timeout: float = 900, python: str | None = None) -> Exited:
    """Like :func:`run_scenario`, but any exit status is an answer, not a failure."""
    proc = subprocess.run(_command(module, function, args, python, False), env=_child_env(env),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    ok, result = _result(proc.stdout)
    return Exited(proc.returncode, proc.stdout, proc.stderr, ok, result)


def run_group(module: str, function: str, world: int, *args: Any, env: dict | None = None,
              timeout: float = 600, python: str | None = None, returns: type | None = None) -> list:
    """``module.function(*args)`` on every rank of a ``world``-process gloo group (the group is
    initialized before the call); returns the results by rank, each rebuilt as ``returns`` (a
    dataclass) where given."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = _child_env(env)
        e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(_command(module, function, args, python, True), env=e, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results, failures = [], []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            failures.append(f"rank {rank} timed out\n{err[-3000:]}")
            results.append(None)
            continue
        ok, got = _result(out)
        if p.returncode != 0 or not ok:
            failures.append(f"rank {rank} exit {p.returncode}\n--- stdout ---\n{out[-2000:]}\n"
                            f"--- stderr ---\n{err[-5000:]}")
        results.append(got)
    if failures:
        raise AssertionError(f"{module}.{function} on {world} ranks:\n" + "\n\n".join(failures))
    return [rebuild(returns, r) for r in results] if returns is not None else results


def _sequence_as_list(value: Any) -> Any:
    """JSON for what ``dataclasses.asdict`` leaves inside a record: a bounded ``deque`` (the verl
    client's move history) becomes a list, the dataclasses in it dicts."""
    from collections import deque
    if isinstance(value, deque):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _main(payload: str) -> None:
    from tests.support import cpu_isa
    cpu_isa.apply_from_env()  # ARP_TEST_CPU_ISA: vLLM loads the kernels of the simulated CPU
    spec = json.loads(payload)
    if spec["group"]:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    fn = getattr(importlib.import_module(spec["module"]), spec["function"])
    result = fn(*spec["args"])
    if spec["group"]:
        dist.barrier()
        dist.destroy_process_group()
    if dataclasses.is_dataclass(result):
        result = dataclasses.asdict(result)
    print(MARK + json.dumps(result, default=_sequence_as_list), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
