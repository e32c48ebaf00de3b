"""Engine-step time with and without gc-off, on a real CPU vLLM engine, in one run.

Many concurrent long requests keep the batch full; every ``LLMEngine.step`` is timed, and
gc.callbacks count the collections (young = generations 0/1, full = 2) and the time the
collector spent while a step ran. Rounds alternate baseline / gc-off on the *same* engine
(the gc_off patches are reverted and re-applied between rounds, and the engine core's
bound ``step_fn`` is rebound like a fresh engine would; the order flips every round), so
machine noise and warm-up effects hit both.

    python benchmarks/bench_gc_off.py [--requests 48] [--prompt-len 64] [--max-tokens 96] [--rounds 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["ASCEND_RL_GC_OFF"] = "1"
os.environ.setdefault("ASCEND_RL_GC_OFF_IDLE_COLLECT", "0")


class GcProbe:
    """Counts collections and collector time while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.young = 0
        self.full = 0
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if not self.active:
            return
        if phase == "start":
            self._start = time.perf_counter()
            if info["generation"] < 2:
                self.young += 1
            else:
                self.full += 1
        else:
            self.seconds += time.perf_counter() - self._start

    def reset(self) -> None:
        self.young = self.full = 0
        self.seconds = 0.0


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main() -> None:
    with open("/proc/cpuinfo", encoding="utf-8") as fh:  # the machine, as lscpu names it
        cpu_model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "?")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48, help="concurrent requests (= max_num_seqs)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96, help="generated tokens per request")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per mode (alternating)")
    args = ap.parse_args()

    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.patching.core import REGISTRY

    plugin.activate("benchmark")
    from vllm import LLM, SamplingParams
    import vllm

    gc_patches = [REGISTRY.patches[n] for n in ("gc_off.llm_engine_step", "gc_off.engine_core_step",
                                               "gc_off.engine_core_step_with_batch_queue")]
    llm = LLM(model=tiny_qwen3.cached(), enforce_eager=True, dtype="bfloat16", seed=0,
              max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=args.requests,
              max_num_batched_tokens=max(2048, args.requests * args.prompt_len))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0)
    probe = GcProbe()

    def set_mode(gc_off: bool) -> None:
        for p in gc_patches:
            if gc_off:
                REGISTRY.apply(p)
            elif p.outcome.state == "applied":
                REGISTRY.revert(p)
        core.step_fn = core.step if core.batch_queue is None else core.step_with_batch_queue

    def run_round(tag: str):
        for i in range(args.requests):
            prompt = [1 + (31 * i + j) % 500 for j in range(args.prompt_len)]
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
        times = []
        probe.reset()
        while engine.has_unfinished_requests():
            probe.active = True
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            probe.active = False
        return times, probe.young, probe.full, probe.seconds

    set_mode(True)
    run_round("warmup")  # torch.compile of the sampler etc.
    results = {False: [[], 0, 0, 0.0], True: [[], 0, 0, 0.0]}
    for r in range(args.rounds):
        for mode in ((False, True) if r % 2 == 0 else (True, False)):  # neither mode always goes first
            set_mode(mode)
            times, young, full, gc_s = run_round(f"r{r}-{int(mode)}")
            acc = results[mode]
            acc[0] += times
            acc[1] += young
            acc[2] += full
            acc[3] += gc_s

    import torch
    print(f"\n# gc-off benchmark: vLLM {vllm.__version__}, torch {torch.__version__}, python "
          f"{sys.version.split()[0]}, {cpu_model} x {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("# command: python " + " ".join(sys.argv))
    print(f"# {args.requests} concurrent requests x ({args.prompt_len} prompt + {args.max_tokens} "
          f"generated) tokens, {args.rounds} rounds per mode, tiny Qwen3 on CPU\n")
    header = ("mode", "steps", "p50 ms", "p99 ms", "max ms", "mean ms", "young GCs in steps",
              "full GCs in steps", "GC ms in steps")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    summary = {}
    for mode in (False, True):
        times, young, full, gc_s = results[mode]
        ms = [t * 1e3 for t in times]
        row = dict(p50=percentile(ms, 50), p99=percentile(ms, 99), max=max(ms), mean=statistics.fmean(ms))
        summary[mode] = row
        print(f"| {'gc-off' if mode else 'baseline'} | {len(ms)} | {row['p50']:.2f} | {row['p99']:.2f} | "
              f"{row['max']:.2f} | {row['mean']:.2f} | {young} | {full} | {gc_s * 1e3:.1f} |")
    print("\nratio gc-off / baseline: " + ", ".join(
        f"{k} {summary[True][k] / summary[False][k]:.3f}" for k in ("p50", "p99", "max", "mean")))


if __name__ == "__main__":
    main()
