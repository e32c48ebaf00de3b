"""Test-harness speed cache: TorchInductor's vector-ISA build checks, remembered across processes.

Not part of the product. Every fresh process that compiles with TorchInductor on CPU (a vLLM
0.23 engine's sampler warm-up does, ``tests/support/child.py``) asks which vector ISAs this CPU
can run: ``torch._inductor.cpu_vec_isa.valid_vec_isa_list()`` evaluates each candidate ISA's
``__bool__``, and each of those calls ``VecISA.check_build`` one to three times; every call
starts a fresh ``python -c "import torch; cdll.LoadLibrary(probe.so)"`` even when the compiled
probe is already on disk (about 5 s each on this 2-core VM; up to seven per process here). Only
the answer of ``check_build`` is remembered, in a small JSON file per check under
``$ASCEND_RL_CACHE/torchinductor-vec-isa/`` (the location rule of
``ascend_rl_plugins.doctor.cache_dir``), keyed by everything the answer depends on (torch
build, interpreter, CPU flags, ``ARP_TEST_CPU_ISA``, the C++ compiler torch uses and its
version, the environment that reaches the compiler and loader, and the ISA, its compiler flags
and the probe source). Torch's own ``__bool__`` logic still runs, so its side effects stay
(``_is_avx512_bf16_supported`` / ``_is_amx_fp16_supported`` decide the compiler flags, and AMX
is enabled for the process by ``torch.cpu._init_amx()``): caching the list of ISA names alone
would have lost them.

Only a successful check is remembered (a failure may be transient -- a loaded machine, a killed
child -- and is cheap to repeat where the ISA is really missing). Anything unreadable, corrupt
or from another key is ignored and the check runs as torch runs it. ``ARP_TEST_ISA_PROBE_CACHE=0``
switches the cache off (tests/test_isa_probe_cache.py compares both ways).

Lazy: :func:`install_from_env` registers a wrapt post-import hook on
``torch._inductor.cpu_vec_isa`` and imports nothing heavy, so processes that never import
torch (the plugin's import-cost tests) stay free of it."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass

ENV = "ARP_TEST_ISA_PROBE_CACHE"
HOOKED_MODULE = "torch._inductor.cpu_vec_isa"
# environment that reaches the probe's compiler or its loader (besides TORCHINDUCTOR_*)
COMPILER_ENV = ("CC", "CXX", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH",
                "LD_LIBRARY_PATH", "LD_PRELOAD")
# TorchInductor settings that only say where files go, not what a build check answers
WHERE_ONLY_ENV = ("TORCHINDUCTOR_CACHE_DIR",)


def enabled() -> bool:
    """Whether ``ARP_TEST_ISA_PROBE_CACHE`` leaves the cache on (unset or ``1``: on; ``0``: off)."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: accepted values are 1 (on, the default) and 0 (off)")
    return value != "0"


def cache_root() -> str:
    """Where the remembered checks live: ``$ASCEND_RL_CACHE`` or ``~/.cache/ascend-rl``."""
    base = os.environ.get("ASCEND_RL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ascend-rl")
    return os.path.join(base, "torchinductor-vec-isa")


def install_from_env() -> bool:
    """Install the cache in this process unless ``ARP_TEST_ISA_PROBE_CACHE=0``; returns whether
    it did. Without wrapt (an interpreter outside the reference stacks) nothing is installed:
    torch then checks as it always does."""
    global _hook_registered
    if not enabled():
        return False
    try:
        import wrapt
    except ImportError:
        return False
    if not _hook_registered:  # once per process: sitecustomize and conftest may both ask
        wrapt.register_post_import_hook(_wrap_check_build, HOOKED_MODULE)
        _hook_registered = True
    return True


_hook_registered = False


@dataclass(frozen=True)
class CheckKey:
    """Everything one ``VecISA.check_build`` answer depends on."""
    torch_version: str
    torch_git_version: str
    python: str
    python_version: str
    machine: str
    cpu_flags: str
    simulated_cpu_isa: str
    compiler: str
    compiler_version: str
    environment: str
    isa: str
    arch_flags: str
    probe_source_sha256: str

    def file_name(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest() + ".json"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features", "features"):
                    return " ".join(sorted(set(value.split())))
    except OSError:
        pass
    return ""


def _environment() -> str:
    names = sorted(n for n in os.environ if n.startswith("TORCHINDUCTOR_") and n not in WHERE_ONLY_ENV)
    names += [n for n in COMPILER_ENV if n in os.environ]
    return json.dumps({n: os.environ[n] for n in names}, sort_keys=True)


def check_key(isa, code: str) -> CheckKey:
    """The key of ``isa.check_build(code)`` in this process (torch is imported by then)."""
    import torch
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
    compiler = get_cpp_compiler()
    return CheckKey(
        torch_version=torch.__version__, torch_git_version=str(getattr(torch.version, "git_version", "")),
        python=sys.executable, python_version=sys.version, machine=platform.machine(),
        cpu_flags=_cpu_flags(), simulated_cpu_isa=os.environ.get("ARP_TEST_CPU_ISA", ""),
        compiler=compiler, compiler_version=get_compiler_version_info(compiler),
        environment=_environment(), isa=str(isa), arch_flags=str(isa._arch_flags),
        probe_source_sha256=hashlib.sha256(code.encode()).hexdigest())


def remembered_success(key: CheckKey) -> bool:
    """Whether a check with exactly ``key`` succeeded before (False: unknown, unreadable, corrupt)."""
    try:
        with open(os.path.join(cache_root(), key.file_name())) as f:
            record = json.load(f)
        return record == {"key": asdict(key), "passed": True}
    except (OSError, ValueError):
        return False


def remember_success(key: CheckKey) -> None:
    """Record that the check of ``key`` succeeded (atomically: a reader sees all or nothing)."""
    root = cache_root()
    try:
        os.makedirs(root, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"key": asdict(key), "passed": True}, f, sort_keys=True)
            os.replace(tmp, os.path.join(root, key.file_name()))
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # an unwritable cache only costs the next process the check


@dataclass
class CheckCounts:
    """How this process's ``VecISA.check_build`` calls were answered (what a test can show)."""
    from_cache: int = 0
    run_by_torch: int = 0


COUNTS = CheckCounts()  # owned by this module; one per process


def reset_counts() -> None:
    COUNTS.from_cache = COUNTS.run_by_torch = 0


def _wrap_check_build(module) -> None:
    import wrapt
    wrapt.wrap_function_wrapper(module, "VecISA.check_build", _remembering_check_build)


def _remembering_check_build(wrapped, instance, args, kwargs):
    code = args[0] if args else kwargs.get("code")
    if instance is None or not isinstance(code, str):
        return wrapped(*args, **kwargs)
    try:
        key = check_key(instance, code)
    except Exception:  # whatever torch cannot tell us, torch's own check decides
        key = None
    if key is not None and remembered_success(key):
        COUNTS.from_cache += 1
        return True
    COUNTS.run_by_torch += 1
    passed = wrapped(*args, **kwargs)
    if passed is True and key is not None:
        remember_success(key)
    return passed


def torch_vec_isa_answer() -> dict:
    """Scenario (fresh interpreter): what TorchInductor decides about this CPU's vector ISAs --
    the valid list, the picked ISA, its truth and compiler flags -- and how this process's
    build checks were answered (``installed``: whether the cache wraps ``check_build`` here)."""
    import wrapt
    from torch._inductor import cpu_vec_isa
    valid = cpu_vec_isa.valid_vec_isa_list()
    picked = cpu_vec_isa.pick_vec_isa()
    return {"valid": [str(isa) for isa in valid], "picked": str(picked), "picked_true": bool(picked),
            "picked_flags": picked.build_arch_flags(),
            "installed": isinstance(vars(cpu_vec_isa.VecISA)["check_build"], wrapt.FunctionWrapper),
            "counts": asdict(COUNTS)}


def modules_after_install() -> dict:
    """Scenario (fresh interpreter, its sitecustomize already ran): whether the cache is
    installed here and whether that imported torch."""
    return {"installed": install_from_env(), "torch_imported": "torch" in sys.modules}
