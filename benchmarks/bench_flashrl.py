"""FlashRL INT8 rollout: online quantization throughput, reload memory and reload time.

Run: ``python benchmarks/bench_flashrl.py`` (with the current stack's python for vLLM's
real oneDNN int8 kernel; on the recipe stack the tests' torch double of the missing
oneDNN ops is used and its fp32 weight copies inflate nothing torch does not allocate).

1. Online quantization, GB/s of BF16 input: this project's fused per-channel quantizer
   (numba on CPU; it also computes the scales) vs FlashRL's ``linear_quantize`` formula
   written naively in torch (fixed profiled scales, full-size float temporaries).
2. Peak extra memory (torch allocator, measured with torch.profiler) of a full-model
   reload in a real vLLM engine: layer-by-layer (this project) vs rebuilding every layer's
   checkpoint-layout parameters before processing any (FlashRL's approach), compared with
   the largest single BF16 weight tensor.
3. Reload time of the INT8 engine (quantize + load + reprocess) vs a plain BF16
   ``model.load_weights`` in a BF16 engine of the same model.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODEL = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=4096)
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR",
              "TOKENIZERS_PARALLELISM": "false", "ASCEND_RL_AUTOLOAD": "0"}


def bench_quantization(reps: int) -> list[dict]:
    import torch

    from ascend_rl_plugins.features.flashrl import quant as Q
    shapes = [(2048, 2048), (5632, 2048), (2048, 5632)]
    rows = []
    g = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        col = Q.power_of_two(torch.rand(k, generator=g) + 0.5)
        in_scale = col.view(1, k)
        out_scale = torch.rand(n, 1, generator=g) + 0.5
        Q.quantize_int8_rows(w, col)  # compile / warm up
        Q.flashrl_formula_int8(w, in_scale, out_scale)

        def best(f):
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                f()
                times.append(time.perf_counter() - t)
            return min(times)
        ours = best(lambda: Q.quantize_int8_rows(w, col))
        torch_blocked = best(lambda: Q.quantize_int8_rows_torch(w, col))
        naive = best(lambda: Q.flashrl_formula_int8(w, in_scale, out_scale))
        gb = w.numel() * 2 / 1e9
        rows.append({"shape": f"{n}x{k}", "ours_gbs": gb / ours, "torch_blocked_gbs": gb / torch_blocked,
                     "flashrl_gbs": gb / naive, "ratio": naive / ours})
    return rows


ENGINE_CODE = r"""
import json, os, statistics, sys, time
sys.path.insert(0, {tests!r})
import torch
role, paths = {role!r}, {paths!r}
try:
    import onednn_int8_double
    double = onednn_int8_double.install()
except Exception:
    double = False
from vllm import LLM
from ascend_rl_plugins.features.flashrl.profile import read_tensors
llm = LLM(model=paths["bf16_a"], enforce_eager=True, max_model_len=128, max_num_seqs=2, dtype="bfloat16",
          gpu_memory_utilization=0.5)
eng = llm.llm_engine
ex = getattr(eng, "model_executor", None) or eng.engine_core.engine_core.model_executor
model = ex.driver_worker.worker.model_runner.model
stream = list(read_tensors(paths["bf16_b"]).items())
largest = max(t.numel() * t.element_size() for _, t in stream)

def peak_extra(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # raw allocator events: +bytes on allocation, -bytes on free, in time order
    events = sorted((m.start_ns(), m.nbytes()) for m in prof.profiler.kineto_results.events()
                    if m.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    # the same, with each quant-method post-processing call collapsed to its net effect:
    # what the reload itself holds, without the kernel's own temporaries (which the
    # initial model load pays too)
    windows = [(e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
               if e.name() == "flashrl.quant_method_postprocess"]
    collapsed, i = [], 0
    for t, nbytes in events:
        w = next(((a, b) for a, b in windows if a <= t <= b), None)
        collapsed.append((w[1] if w else t, nbytes))
    cur = own = 0
    for t, nbytes in sorted(collapsed):
        cur += nbytes
        own = max(own, cur)
    return peak, own

res = {{"double": double, "largest_tensor": largest, "baseline": "model.load_weights"}}
load = lambda: model.load_weights(stream)
runner = ex.driver_worker.worker.model_runner
if role == "bf16" and hasattr(runner, "reload_weights"):
    # vLLM 0.23 CPU prepacks BF16 linears into oneDNN and drops their weights, so a bare
    # model.load_weights cannot reload them; vLLM's own layerwise reload is the BF16 path there.
    load = lambda: runner.reload_weights(weights_iterator=iter(stream))
    res["baseline"] = "model_runner.reload_weights (vLLM layerwise reload)"
load()  # warm-up (numba compile, first-touch)
times = []
for _ in range({reps}):
    t = time.perf_counter(); load(); times.append(time.perf_counter() - t)
res["reload_s"] = statistics.median(times)
if role == "int8":
    from ascend_rl_plugins.features.flashrl import reload as rl
    state = rl.state_of(model)
    res["peak_layerwise"], res["own_layerwise"] = peak_extra(lambda: model.load_weights(stream))
    state.rebuild_all = True
    res["peak_rebuild_all"], res["own_rebuild_all"] = peak_extra(lambda: model.load_weights(stream))
    state.rebuild_all = False
emit(res)
"""


def run_engine(role: str, paths: dict, reps: int) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import run_python
    env = dict(ENGINE_ENV)
    if role == "int8":
        env["ASCEND_RL_FLASHRL"] = paths["config"]
    code = ENGINE_CODE.format(tests=os.path.join(ROOT, "tests", "flashrl"), role=role, paths=paths, reps=reps)
    return run_python(code, env=env, timeout=900)


def build(workdir: str) -> dict:
    import torch
    from safetensors.torch import save_file

    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features.flashrl import checkpoint, config, profile, quant
    a_dir = tiny_qwen3.cached(**MODEL)
    b_dir = os.path.join(workdir, "bf16_b")
    os.makedirs(b_dir, exist_ok=True)
    a = profile.read_tensors(a_dir)
    g = torch.Generator().manual_seed(1)
    save_file({k: (v.float() + torch.randn(v.shape, generator=g) * 0.01).to(v.dtype) for k, v in a.items()},
              os.path.join(b_dir, "model.safetensors"))
    for f in os.listdir(a_dir):
        if not f.endswith(".safetensors") and os.path.isfile(os.path.join(a_dir, f)):
            with open(os.path.join(a_dir, f), "rb") as src, open(os.path.join(b_dir, f), "wb") as dst:
                dst.write(src.read())
    shapes = checkpoint.linear_shapes(a)
    norm = {profile.norm_of(n): quant.power_of_two(torch.rand(s[1], generator=g) * 2 + 0.25)
            for n, s in shapes.items() if profile.norm_of(n)}
    down = {n: quant.power_of_two(torch.rand(s[1], generator=g) * 2 + 0.25)
            for n, s in shapes.items() if profile.gain_source(n)}
    prof = profile.Profile.from_factors(shapes, norm, down)
    int8_dir = checkpoint.quantize_checkpoint(a_dir, os.path.join(workdir, "int8_a"), profile=prof)
    prof_path = os.path.join(workdir, "profile.pt")
    profile.derive_profile(a_dir, int8_dir).save(prof_path)
    cfg = os.path.join(workdir, "flashrl.yaml")
    config.write_config(cfg, config.RolloutConfig(fn="int8", model=int8_dir, profile=prof_path), append=False)
    return {"bf16_a": a_dir, "bf16_b": b_dir, "int8_a": int8_dir, "config": cfg}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-engine", action="store_true", help="only the quantization throughput")
    args = ap.parse_args()
    print(f"# bench_flashrl  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  python {sys.version.split()[0]}  "
          f"cpus={os.cpu_count()}")
    rows = bench_quantization(args.reps)
    print("\n## 1. online INT8 quantization throughput (GB/s of BF16 input, best of %d)" % args.reps)
    print("| weight | ours (fused, CPU kernel) | ours (blocked torch, any device) | FlashRL formula (naive torch) | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['ours_gbs']:.2f} | {r['torch_blocked_gbs']:.2f} | {r['flashrl_gbs']:.2f} | "
              f"{r['ratio']:.1f}x |")
    if args.skip_engine:
        return 0
    with tempfile.TemporaryDirectory() as wd:
        paths = build(wd)
        int8 = run_engine("int8", paths, args.reps)
        bf16 = run_engine("bf16", paths, args.reps)
    mib = 2 ** 20
    print(f"\n## 2. peak extra memory of a full reload (torch allocator; model {MODEL['num_hidden_layers']} layers, "
          f"hidden {MODEL['hidden_size']}, intermediate {MODEL['intermediate_size']}, vocab {MODEL['vocab_size']})")
    print("| approach | peak extra MiB (all) | / largest BF16 tensor | without the quant method's own "
          "temporaries, MiB | / largest |")
    print("|---|---|---|---|---|")
    lt = int8["largest_tensor"]
    for name, key in (("layer by layer (ascend-rl)", "layerwise"), ("rebuild every layer (FlashRL)", "rebuild_all")):
        allb, own = int8["peak_" + key], int8["own_" + key]
        print(f"| {name} | {allb / mib:.2f} | {allb / lt:.2f} | {own / mib:.2f} | {own / lt:.2f} |")
    print(f"| largest single BF16 weight tensor | {lt / mib:.2f} | 1.00 | | |")
    print("(on vLLM CPU the int8 kernel's post-processing computes azp_adj with weight.sum(dtype=float32),"
          " a float32 copy of the layer's weight: 4x the int8 layer, paid by the initial load as well)")
    print("\n## 3. reload time (median of %d)" % args.reps)
    print("| engine | seconds | ratio |")
    print("|---|---|---|")
    print(f"| BF16 engine, {bf16['baseline']} | {bf16['reload_s']:.3f} | 1.00 |")
    print(f"| INT8 engine, online quantize + reload | {int8['reload_s']:.3f} | {int8['reload_s'] / bf16['reload_s']:.2f} |")
    if int8.get("double"):
        print("\n(recipe stack: the int8 GEMM/handler is the tests' torch double of vLLM's missing oneDNN ops)")
    print(json.dumps({"quant": rows, "int8": int8, "bf16": bf16}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
