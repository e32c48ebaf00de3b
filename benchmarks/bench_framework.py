"""Cost of the framework itself: plugin import time, and per-call overhead of patches.

    python benchmarks/bench_framework.py

Import time is measured in fresh interpreters (median of N runs, `-X importtime`
cumulative microseconds of the `ascend_rl_plugins` package) with every flag at its default
and with a patch armed; per-call overhead compares a pass-through function called plainly
with the same function behind each patch kind, in one run.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import timeit

RUNS = int(os.environ.get("BENCH_RUNS", "9"))


def import_us(env_extra: dict[str, str]) -> tuple[float, list[str]]:
    env = dict(os.environ, ASCEND_RL_AUTOLOAD="1", **env_extra)
    samples = []
    heavy: list[str] = []
    for _ in range(RUNS):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-c",
                               "import sys, ascend_rl_plugins; print([m for m in ('torch','vllm','verl','numpy') if m in sys.modules])"],
                              env=env, capture_output=True, text=True, check=True)
        m = re.findall(r"import time:\s+\d+ \|\s+(\d+) \| ascend_rl_plugins$", proc.stderr, re.M)
        samples.append(float(m[-1]))
        heavy = eval(proc.stdout.strip().splitlines()[-1])
    return statistics.median(samples), heavy


def startup_ms(code: str) -> float:
    env = dict(os.environ, ASCEND_RL_AUTOLOAD="1")
    samples = []
    for _ in range(RUNS):
        t = timeit.default_timer()
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        samples.append((timeit.default_timer() - t) * 1e3)
    return statistics.median(samples)


def per_call_ns() -> list[tuple[str, float]]:
    import types

    os.environ["ASCEND_RL_AUTOLOAD"] = "0"
    from ascend_rl_plugins.patching import REGISTRY, Feature, Verified

    mod = types.ModuleType("bench_target")
    exec("def f(x):\n    return x\n\nclass C:\n    def m(self, x):\n        return x\n", mod.__dict__)
    sys.modules["bench_target"] = mod
    n = 200_000
    base_f = min(timeit.repeat(lambda: mod.f(1), number=n, repeat=5)) / n * 1e9
    obj = mod.C()
    base_m = min(timeit.repeat(lambda: obj.m(1), number=n, repeat=5)) / n * 1e9
    rows = [("plain function", base_f, 1.0), ("plain method", base_m, 1.0)]
    feature = Feature("bench", "benchmark", verified=Verified())
    cases = [
        ("wrap (function)", "bench_target:f", "wrap", lambda w, i, a, k: w(*a, **k), lambda: mod.f(1), base_f),
        ("before (function)", "bench_target:f", "before", lambda i, a, k: None, lambda: mod.f(1), base_f),
        ("after (function)", "bench_target:f", "after", lambda r, i, a, k: r, lambda: mod.f(1), base_f),
        ("wrap (method)", "bench_target:C.m", "wrap", lambda w, i, a, k: w(*a, **k), lambda: obj.m(1), base_m),
    ]
    for i, (label, target, kind, impl, call, base) in enumerate(cases):
        p = feature.patch(kind, target, impl, dist=None, reason="bench", remove_when="never",
                          name=f"bench.case_{i}")
        REGISTRY.apply(p)
        t = min(timeit.repeat(call, number=n, repeat=5)) / n * 1e9
        REGISTRY.revert(p)
        rows.append((label, t, t / base))
    return rows


def main() -> None:
    print(f"python {sys.version.split()[0]}, {RUNS} fresh interpreters per figure\n")
    bare = startup_ms("pass")
    with_pkg = startup_ms("import ascend_rl_plugins")
    default_us, heavy = import_us({})
    armed_us, heavy_armed = import_us({"ASCEND_RL_DIAGNOSTICS": os.devnull})
    print("| plugin import | median | vs bare interpreter start |")
    print("|---|---|---|")
    print(f"| bare `python -c pass` | {bare:.1f} ms wall | 1.00x |")
    print(f"| `import ascend_rl_plugins` (wall) | {with_pkg:.1f} ms wall | {with_pkg / bare:.2f}x |")
    print(f"| package import, flags default (-X importtime) | {default_us / 1e3:.1f} ms | heavy modules imported: {heavy or 'none'} |")
    print(f"| package import, a patch armed (post-import hook) | {armed_us / 1e3:.1f} ms | heavy modules imported: {heavy_armed or 'none'} |")
    print()
    print("| call | ns per call | vs plain |")
    print("|---|---|---|")
    for label, ns, ratio in per_call_ns():
        print(f"| {label} | {ns:.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
