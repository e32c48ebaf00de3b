"""``ascend-rl selftest``: the device-side checks of every feature, on the machine you train on.

Why: every figure of this project was measured on CPUs, where the quantizers run numba
kernels; on an NPU or GPU they run other code (the compiled or eager torch paths, device
buffers for collectives). An owner of such a machine runs one command, in minutes, and sees
for each feature that has a device-side part whether it is **bit-identical** to the CPU
reference on this device, how fast it is against the formula it replaces and against the
measured copy bandwidth, and whether it refuses bad input. One rich table on the terminal,
the same rows as JSON (``--json``), exit status 1 on any mismatch (speed targets are
reported, and fail the run only with ``--strict``).

A feature takes part by exposing ``selftest_checks(ctx) -> list[CheckResult]`` in its
package (imported lazily; the checks themselves import torch). The tests and the
benchmarks call the same check functions.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class CheckResult:
    """One row of the self-test: ``ok`` is the correctness verdict (None: not run, ``detail``
    says why); ``metrics`` are measurements (milliseconds, ratios, bytes) on this device;
    ``target`` a speed/size goal in words and ``target_met`` whether it was reached."""
    feature: str
    check: str
    ok: bool | None
    detail: str = ""
    metrics: dict = field(default_factory=dict)
    target: str = ""
    target_met: bool | None = None


@dataclass
class SelftestContext:
    """What every check gets: the device, how thorough to be, and the timing helpers."""
    device: Any                  # torch.device
    quick: bool
    reps: int

    def synchronize(self) -> None:
        import torch
        backend = getattr(torch, self.device.type, None)
        sync = getattr(backend, "synchronize", None)
        if self.device.type != "cpu" and sync is not None:
            sync()

    def seconds(self, fn: Callable[[], Any], reps: int | None = None, warmup: int = 1) -> float:
        """Median wall time of ``fn()`` on this device over ``reps`` runs (the device is
        synchronized around each run; CUDA events where available)."""
        import torch
        reps = reps or self.reps
        for _ in range(warmup):
            fn()
        self.synchronize()
        times = []
        if self.device.type == "cuda":
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                self.synchronize()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def host_seconds(self, fn: Callable[[], Any], reps: int = 50) -> float:
        """Mean wall time of ``fn()`` over ``reps`` back-to-back calls, the device synchronized
        once at the end: what a call costs when the host queues work ahead of the device (on a
        tiny input: the host's own time per call). No warm-up call: warm ``fn`` first."""
        self.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        self.synchronize()
        return (time.perf_counter() - t0) / reps

    def copy_bandwidth(self, nbytes: int) -> float:
        """Measured device copy bandwidth in bytes/s (bytes read + bytes written)."""
        import torch
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        t = self.seconds(lambda: dst.copy_(src), reps=max(3, self.reps))
        return 2 * nbytes / t


def pick_device(name: str):
    """``auto``: an NPU (torch_npu), else CUDA, else XPU, else the CPU; or the named device."""
    import torch
    if name != "auto":
        if name.startswith("npu"):
            importlib.import_module("torch_npu")
        return torch.device(name)
    try:
        importlib.import_module("torch_npu")
        if torch.npu.is_available():  # type: ignore[attr-defined]
            return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    except ImportError:
        pass
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return torch.device("xpu", xpu.current_device())
    return torch.device("cpu")


def describe(device) -> str:
    """The device in words, for the report (a GPU stands in for an NPU only as 'a non-CPU device')."""
    import platform
    import torch
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda), torch {torch.__version__}"
    if device.type == "npu":
        return f"{torch.npu.get_device_name(device)} (npu), torch {torch.__version__}"  # type: ignore[attr-defined]
    return f"{platform.processor() or platform.machine()} (cpu), torch {torch.__version__}"


def feature_checks() -> list[tuple[str, Callable]]:
    """``(feature, selftest_checks)`` of every feature package that has device-side checks."""
    from . import features
    return features.modules_with("selftest_checks")


def unknown_features(only, checks) -> str | None:
    """The error for names in ``only`` that no feature of ``checks`` (``feature_checks()``)
    answers to, naming the accepted ones; None when every name is known. Why: an unknown name
    used to select nothing, and an empty table exits 0 -- a typo read as a passing run."""
    accepted = [name for name, _ in checks]
    unknown = [name for name in only if name not in accepted]
    if not unknown:
        return None
    return (f"unknown --feature {', '.join(map(repr, unknown))}; the features with device checks are: "
            f"{', '.join(accepted)}")


def run(device, *, quick: bool, only: tuple[str, ...] = (), progress=None, done=None) -> list[CheckResult]:
    """Every feature's checks on ``device`` (a check that raises becomes a failed row), or only
    those of the features named in ``only`` (``ValueError`` for a name no feature has).
    ``progress(feature)`` is called before and ``done(results so far)`` after each feature."""
    checks = feature_checks()
    error = unknown_features(only, checks)
    if error is not None:
        raise ValueError(error)
    ctx = SelftestContext(device=device, quick=quick, reps=3 if quick else 10)
    results: list[CheckResult] = []
    for name, fn in checks:
        if only and name not in only:
            continue
        if progress is not None:
            progress(name)
        try:
            results.extend(fn(ctx))
        except Exception as exc:  # noqa: BLE001 - a crashing check is a failed check, reported
            results.append(CheckResult(name, "selftest_checks", False, f"raised {type(exc).__name__}: {exc}"))
        if done is not None:
            done(results)
    return results


def _fmt_metrics(metrics: dict) -> str:
    parts = []
    for key, value in metrics.items():
        parts.append(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}")
    return ", ".join(parts)


def render(results: list[CheckResult], title: str, width: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title, show_lines=False)
    for col in ("feature", "check", "result", "measured", "target"):
        table.add_column(col, overflow="fold")
    for r in results:
        verdict = {True: "[green]ok[/green]", False: "[red]MISMATCH[/red]", None: "[yellow]not run[/yellow]"}[r.ok]
        if r.detail:
            verdict += f" {r.detail}"
        target = r.target
        if r.target_met is not None:
            target += " [green](met)[/green]" if r.target_met else " [red](not met)[/red]"
        table.add_row(r.feature, r.check, verdict, _fmt_metrics(r.metrics), target)
    Console(width=width).print(table)


def main(args) -> int:
    """The ``ascend-rl selftest`` command (arguments parsed by :mod:`.cli`); exit status 2 for
    an unknown ``--feature``."""
    error = unknown_features(tuple(args.feature or ()), feature_checks())
    if error is not None:
        print(f"ascend-rl selftest: {error}", file=sys.stderr)
        return 2
    device = pick_device(args.device)
    title = f"ascend-rl selftest on {describe(device)}{' (quick)' if args.quick else ''}"
    from rich.console import Console
    console = Console(stderr=True)

    def write_json(results):  # after each feature, so an interrupted run still leaves its rows
        if args.json:
            report = {"device": describe(device), "device_type": device.type, "quick": bool(args.quick),
                      "time_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "results": [dataclasses.asdict(r) for r in results]}
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=2)

    with console.status("selftest ...") as status:
        results = run(device, quick=args.quick, only=tuple(args.feature or ()),
                      progress=lambda name: status.update(f"selftest: {name} on {device} ..."), done=write_json)
    render(results, title)
    mismatches = [r for r in results if r.ok is False]
    missed = [r for r in results if r.target_met is False]
    if mismatches:
        print(f"ascend-rl selftest: {len(mismatches)} check(s) failed: "
              + "; ".join(f"{r.feature}/{r.check}" for r in mismatches), file=sys.stderr)
        return 1
    if args.strict and missed:
        print(f"ascend-rl selftest: {len(missed)} target(s) not met (--strict)", file=sys.stderr)
        return 1
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("selftest", help="device-side checks of every feature on this machine's accelerator "
                                        "(bit identity vs the CPU reference, speed vs the replaced formulas)")
    p.add_argument("--device", default="auto", help="auto (npu, else cuda, else xpu, else cpu) or a torch device")
    p.add_argument("--quick", action="store_true", help="small tensors, few repetitions (seconds; what CI runs)")
    p.add_argument("--feature", action="append",
                   help="only this feature's checks (repeatable; an unknown name exits 2, listing the features)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--strict", action="store_true", help="exit 1 when a speed target is not met")
    p.set_defaults(func=main)
