"""What vLLM's CPU backend can run in this interpreter, and how to see it as an AVX2-only CPU would.

vLLM 0.23's x86 CPU wheel ships three kernel libraries and loads one of them, chosen by asking
torch about the CPU (``CpuPlatform.import_kernels``): ``_C`` (AVX-512 with BF16, AMX),
``_C_AVX512`` or ``_C_AVX2``. ``_C_AVX2`` has no ``cpu_gemm_wna16`` (the W4A16 matmul of
``CPUWNA16LinearKernel``) and no ``prepack_moe_weight`` (without it ``CPUFusedMOE`` falls back to
its torch path). Tests decide from what the loaded library offers (:func:`vllm_cpu_ops`), never
from the CPU flags of the machine they were written on.

``ARP_TEST_CPU_ISA=avx2`` (read by tests/conftest.py, tests/support/child.py and the engine
site hook) makes every test process answer torch's ISA probes as an AVX2-only x86-64 CPU does
(no AVX-512, no AMX) before vLLM loads its kernels: vLLM then loads its real ``_C_AVX2`` library
and picks the kernels it picks on such a CPU. Only vLLM's choice changes; torch's own kernels
still use the host's ISA. This is how an AMX development machine reproduces the AVX2-only CI
failures (README of tests, issue 25):

    ARP_TEST_CPU_ISA=avx2 python -m pytest tests/features/moe_reshard/test_engine.py
"""

from __future__ import annotations

import functools
import os

ENV = "ARP_TEST_CPU_ISA"
SIMULATED = ("avx2",)


def simulate_avx2_only() -> None:
    """Make torch report an AVX2-only x86-64 CPU (no AVX-512, no AVX-512 BF16, no AMX) in this
    process. Must run before vLLM imports its kernel library (its platform asks these probes).

    Lazy: the probes are replaced when torch is imported (a wrapt post-import hook; at once if it
    already is), so a process that never imports torch stays free of it and of this package --
    the tests that hold the plugin to importing no torch run under the simulation too.

    TorchInductor asks the same probes and then generates AVX2 code; sharing its cache with
    processes of the real CPU crashed a simulated engine (SIGBUS in a cached kernel of vLLM's
    compiled sampler, reproducibly), and separate caches do not. So simulated processes compile
    into their own TorchInductor and vLLM caches, under ASCEND_RL_CACHE (the location rule of
    ``ascend_rl_plugins.doctor.cache_dir``, not imported here for the reason above)."""
    import wrapt
    cache = os.environ.get("ASCEND_RL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ascend-rl")
    root = os.path.join(cache, "simulated-cpu", "avx2")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "torchinductor")
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(root, "vllm")
    wrapt.register_post_import_hook(_answer_probes_as_avx2_only, "torch")


def _answer_probes_as_avx2_only(torch) -> None:
    for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, probe):
            setattr(torch.cpu, probe, _answer_no)


def _answer_no() -> bool:
    return False


def apply_from_env() -> str | None:
    """Apply the simulation ``ARP_TEST_CPU_ISA`` asks for (None: the real CPU); returns its value."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in SIMULATED:
        raise ValueError(f"{ENV}={value!r}: accepted values are {', '.join(SIMULATED)} (or unset)")
    simulate_avx2_only()
    return value


def probe_vllm_cpu_ops(ops: list) -> dict:
    """Scenario (fresh interpreter): load vLLM's CPU kernel library as an engine would, and say
    which of ``ops`` ``torch.ops._C`` has, plus whether torch reports AMX."""
    import torch
    from vllm.platforms import current_platform
    current_platform.import_kernels()
    found = {op: hasattr(torch.ops._C, op) for op in ops}
    return {"ops": found, "amx": bool(torch.cpu._is_amx_tile_supported()), "library": loaded_vllm_cpu_library()}


# vLLM's x86 CPU kernel libraries, and how each converts fp32 results to bf16: ``_C`` with the
# AVX-512 BF16 instruction (round to nearest even); ``_C_AVX512``, without it, by dropping the low
# 16 bits (truncation toward zero: measured on its W4A16 matmul, rollout_mismatch README).
# ``_C_AVX2`` (no W4A16 matmul at all, so nothing here reads its rounding) is assumed to round
# as ``_C_AVX512`` does, lacking the same instruction.
VLLM_CPU_LIBRARIES = {"_C": "nearest", "_C_AVX512": "truncate", "_C_AVX2": "truncate"}


def loaded_vllm_cpu_library() -> str | None:
    """The vLLM CPU kernel library this process has loaded (a key of :data:`VLLM_CPU_LIBRARIES`),
    read from the process's memory map (vLLM imports ``_C_AVX512``/``_C_AVX2`` under the module
    name ``_C``, so ``sys.modules`` cannot tell them apart); None when none is loaded."""
    import re
    with open("/proc/self/maps") as fh:
        names = set(re.findall(r"/vllm/(_C(?:_AVX512|_AVX2)?)\.[^/\s]*\.so$", fh.read(), re.MULTILINE))
    if len(names) > 1:
        raise RuntimeError(f"several vLLM CPU kernel libraries are loaded: {sorted(names)}")
    return names.pop() if names else None


# the vLLM CPU ops whose absence changes what a test can run (one probe per session asks for all)
PROBED_OPS = ("cpu_gemm_wna16", "prepack_moe_weight")


@functools.lru_cache(maxsize=1)
def _vllm_cpu_probe() -> dict:
    from tests.support.child import run_scenario
    return run_scenario("tests.support.cpu_isa", "probe_vllm_cpu_ops", list(PROBED_OPS), timeout=300)


def vllm_cpu_ops() -> dict:
    """``{op: present}`` for ``torch.ops._C.<op>`` of every op in :data:`PROBED_OPS`, after vLLM
    loads its CPU kernels in a fresh interpreter of this stack (with this process's
    ``ARP_TEST_CPU_ISA``); asked once per test session."""
    return _vllm_cpu_probe()["ops"]


def vllm_cpu_library() -> str | None:
    """The kernel library vLLM's engines of this stack load on this CPU (a key of
    :data:`VLLM_CPU_LIBRARIES`; None on a vLLM build with one library), from the same probe."""
    return _vllm_cpu_probe()["library"]


# How far a request's log-probs may move when it decodes in another batch (a migrated or resumed
# request joins other batches than it would have unmoved), by kernel library: bit for bit where the
# library's kernels give a row the same numbers whatever the batch (seen on _C and _C_AVX512: the
# verl migration tests compared equal); on _C_AVX2 they do not, and a moved request's log-probs
# differed in the last bits (4.8e-7 on a 2-core AMD EPYC, AVX2 only, with identical tokens).
BATCH_VARIANCE_TOLERANCE = {"_C": 0.0, "_C_AVX512": 0.0, "_C_AVX2": 1e-5}


def log_prob_tolerance() -> float:
    """The largest log-prob difference a request decoded in another batch may show here (0.0:
    bit-identical); tokens must be identical whatever this says."""
    return BATCH_VARIANCE_TOLERANCE.get(vllm_cpu_library(), 0.0)


def log_probs_match(got: list, want: list) -> tuple[bool, list]:
    """Whether rows of log-probs match under :func:`log_prob_tolerance`, and the largest absolute
    difference per row (for the failure message)."""
    diffs = [max((abs(a - b) for a, b in zip(x, y)), default=0.0) for x, y in zip(got, want)]
    tol = log_prob_tolerance()
    same_shape = len(got) == len(want) and all(len(x) == len(y) for x, y in zip(got, want))
    return same_shape and (got == want if tol == 0.0 else all(d <= tol for d in diffs)), diffs


def missing_vllm_cpu_op(op: str, used_by: str) -> str | None:
    """The skip reason when the installed vLLM CPU build lacks ``torch.ops._C.<op>`` on this CPU
    (``used_by``: what calls it), else None. ``op`` must be one of :data:`PROBED_OPS`."""
    if vllm_cpu_ops()[op]:
        return None
    simulated = os.environ.get(ENV)
    cpu = f"this CPU as {ENV}={simulated} simulates it" if simulated else "this CPU"
    return (f"the installed vLLM CPU build has no torch.ops._C.{op} on {cpu} (vLLM's AVX2 kernel library "
            f"lacks it); {used_by} cannot run here")
