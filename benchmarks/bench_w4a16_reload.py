"""W4A16 rollout: flashrl's online-quantized in-place reload vs vLLM's own ``reload_weights``.

Two real vLLM 0.23 CPU engines serve the same W4A16 (compressed-tensors pack-quantized) tiny
Qwen3, ``VLLM_CPU_INT4_W4A8=0`` (vLLM's CPUWNA16 kernel in its W4A16 mode):

* **flashrl**: ``ASCEND_RL_FLASHRL`` = a ``fn: w4a16`` config; each update is BF16 (what the
  trainer has) and goes through ``model.load_weights``: online ``int4.quantize_pack`` +
  vLLM's loaders + the direct repack into the kernel's storage.
* **vLLM**: stock engine; each update is the *pre-packed* W4A16 checkpoint tensors (the
  quantization already done offline, for free) through vLLM's layerwise
  ``model_runner.reload_weights(weights_iterator=...)``, which re-runs CPUWNA16's
  post-processing.

``measure()`` runs the two in lockstep (round i: engine 1 reloads, then engine 2 reloads the
same weights; updates alternate B, A so every reload changes every weight), reports median
seconds and their ratio, the torch-allocator peak of one reload of each (``torch.profiler``
memory events) against the largest BF16 tensor, and checks that every reload takes effect:
after each engine reloads B (resp. A) both generate the same greedy tokens and log-probs,
different for A and B. Needs the current stack (vLLM 0.23): vLLM 0.13's CPU build serves no
W4A16.

    python benchmarks/bench_w4a16_reload.py [--rounds 9] [--group-size 128] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=4096)  # (bench_flashrl.py's model)


def _say(obj) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker(role: str, paths_json: str) -> None:
    """Engine process: reads one JSON command per line on stdin, answers on stdout."""
    sys.path.insert(0, REPO)
    from tests.features.flashrl import w4a16_engine_scenario as sc
    paths = json.loads(paths_json)
    llm = sc.make_llm(paths["bf16_a"] if role == "flashrl" else paths["w4_a"])
    model = sc._model(llm)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner \
        if hasattr(llm.llm_engine, "model_executor") else None
    if runner is None:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    if role == "flashrl":
        streams = {k: sc.stream(paths[f"bf16_{k}"]) for k in ("a", "b")}
        load = lambda s: model.load_weights(iter(s))  # noqa: E731
    else:
        streams = {k: sc.stream(paths[f"w4_{k}"]) for k in ("a", "b")}
        load = lambda s: runner.reload_weights(weights_iterator=iter(s))  # noqa: E731
    largest = max(t.numel() * t.element_size() for _, t in sc.stream(paths["bf16_b"]))
    _say({"ready": True, "largest_bf16": largest, "out_a": sc._generate(llm)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "load":
            t0 = time.perf_counter()
            load(streams[cmd["w"]])
            _say({"s": time.perf_counter() - t0})
        elif cmd["op"] == "peak":
            _say({"peak": sc.torch_peak_extra(lambda: load(streams[cmd["w"]]))})
        elif cmd["op"] == "out":
            _say({"out": sc._generate(llm)})
        elif cmd["op"] == "quit":
            _say({"bye": True})
            return


class _Engine:
    def __init__(self, role: str, paths: dict, env: dict):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", role, json.dumps(paths)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError(f"engine exited ({self.proc.wait()})")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()


def measure(rounds: int = 9, group_size: int = 128, model: dict | None = None, workdir: str | None = None,
            threads: int = 1) -> dict:
    """Reload time and peak memory, flashrl (BF16 in, online W4A16) vs vLLM reload_weights (pre-packed)."""
    sys.path.insert(0, REPO)
    from tests.features.flashrl import w4a16_engine_scenario as sc
    from tests.support.child import ENGINE_ENV
    workdir = workdir or tempfile.mkdtemp(prefix="bench_w4a16_")
    paths = sc.build_artifacts(workdir, group_size=group_size, **(model or MODEL))
    base = dict(os.environ)
    base.update(ENGINE_ENV)
    base.update(ASCEND_RL_AUTOLOAD="0", VLLM_CPU_INT4_W4A8="0", OMP_NUM_THREADS=str(threads),
                NUMBA_NUM_THREADS=str(threads))
    base.pop("ASCEND_RL_FLASHRL", None)
    engines = {"flashrl": _Engine("flashrl", paths, dict(base, ASCEND_RL_FLASHRL=paths["config"])),
               "vllm": _Engine("vllm", paths, base)}
    try:
        ready = {k: e.read() for k, e in engines.items()}
        check = {"a_equal": ready["flashrl"]["out_a"] == ready["vllm"]["out_a"]}
        for w in ("b", "a"):
            outs = {}
            for k, e in engines.items():
                e.ask(op="load", w=w)
                outs[k] = e.ask(op="out")["out"]
            check[f"{w}_equal"] = outs["flashrl"] == outs["vllm"]
            check[f"{w}_changes" if w == "b" else "a_restored"] = (outs["flashrl"] != ready["flashrl"]["out_a"]) \
                if w == "b" else outs["flashrl"] == ready["flashrl"]["out_a"]
        for k, e in engines.items():  # warm-up (numba compile, first touch)
            e.ask(op="load", w="b")
            e.ask(op="load", w="a")
        times = {k: [] for k in engines}
        for i in range(rounds):
            w = "b" if i % 2 == 0 else "a"
            for k, e in engines.items():
                times[k].append(e.ask(op="load", w=w)["s"])
        peaks = {k: e.ask(op="peak", w="b")["peak"] for k, e in engines.items()}
        for e in engines.values():
            e.ask(op="quit")
    finally:
        for e in engines.values():
            if e.proc.poll() is None:
                e.proc.kill()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [f / v for f, v in zip(times["flashrl"], times["vllm"])]
    largest = ready["flashrl"]["largest_bf16"]
    return {"model": model or MODEL, "group_size": group_size, "rounds": rounds, "threads": threads,
            "median_s": med, "ratio_median": med["flashrl"] / med["vllm"],
            "ratio_per_round": [min(ratios), max(ratios)], "peak_bytes": peaks, "largest_bf16": largest,
            "peak_over_largest": {k: v / largest for k, v in peaks.items()}, "check": check,
            "loadavg": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="the tests' tiny model instead of hidden 512 / 4 layers")
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    t0 = time.time()
    r = measure(a.rounds, a.group_size, {} if a.small else None, threads=a.threads)
    r["wall_s"] = time.time() - t0
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
