"""FlashRL W8A8 rollout: online quantization throughput, reload memory and reload time.

Run: ``python benchmarks/bench_flashrl.py`` (with the current stack's python for vLLM's
real oneDNN int8 kernel; on the recipe stack the tests' torch double of the missing
oneDNN ops is used, so section 3 there times a double, not vLLM's kernel).

1. Online quantization, GB/s of BF16 input: this project's fused per-channel INT8
   quantizer (numba on CPU; it also computes the scales), its device-agnostic blocked
   torch path, the FP8 E4M3 per-channel quantizer (blocked torch), vs FlashRL's
   ``linear_quantize`` formula written naively in torch (fixed profiled scales,
   full-size float temporaries).
2. Peak extra memory of a full-model reload in a real vLLM engine, *including vLLM's own
   post-processing*: (a) RSS high-water mark of the engine process (``VmHWM`` reset through
   ``/proc/self/clear_refs`` just before the reload, minus RSS before it), which sees
   every allocator -- torch, oneDNN's prepacked weights, numba, Python; the engine runs
   with ``MALLOC_MMAP_THRESHOLD_=131072`` so glibc maps every block >= 128 KiB afresh and
   unmaps it on free (otherwise freed blocks are reused without touching RSS and the peak
   is under-reported); (b) the torch CPU allocator's own peak (torch.profiler memory
   events), also with each quant-method post-processing call collapsed to its net effect.
   Layer by layer (this project) vs rebuilding every layer's checkpoint-layout parameters
   before processing any (FlashRL's approach), and vLLM's BF16 layerwise reload, against
   the largest single BF16 weight tensor of the update.
3. Reload time: the INT8 engine (online quantization + load + the quant methods'
   post-processing) vs a BF16 engine of the same model reloading the same BF16 tensors.
   Both engines stay up and are driven in lockstep, alternating which goes first, so
   load from other processes on the machine hits both alike; medians and the median of
   the per-round ratios are reported, plus where the INT8 reload's time goes.
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
              "TOKENIZERS_PARALLELISM": "false", "ASCEND_RL_AUTOLOAD": "0", "ASCEND_RL_FLASHRL_LOGGING_LEVEL": "warning"}
MARK = "@@BENCH@@"
MIB = 2 ** 20


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
        fp8 = best(lambda: Q.quantize_fp8_rows(w, col))
        naive = best(lambda: Q.flashrl_formula_int8(w, in_scale, out_scale))
        gb = w.numel() * 2 / 1e9
        rows.append({"shape": f"{n}x{k}", "ours_gbs": gb / ours, "torch_blocked_gbs": gb / torch_blocked,
                     "fp8_gbs": gb / fp8, "flashrl_gbs": gb / naive, "ratio": naive / ours})
    return rows


ENGINE_CODE = r"""
import json, os, re, sys, time
sys.path.insert(0, {tests!r})
MARK = {mark!r}
def say(obj):
    print(MARK + json.dumps(obj), flush=True)
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
runner = ex.driver_worker.worker.model_runner
model = runner.model
stream = list(read_tensors(paths["bf16_b"]).items())
largest = max(t.numel() * t.element_size() for _, t in stream)
state = None
if role == "int8":
    from ascend_rl_plugins.features.flashrl import reload as rl
    state = rl.state_of(model)
    load = lambda: model.load_weights(stream)
    baseline = "model.load_weights (flashrl: quantize + load + post-process)"
elif hasattr(runner, "reload_weights"):
    # vLLM 0.23 CPU prepacks BF16 linears into oneDNN and drops their weights, so a bare
    # model.load_weights cannot reload them; vLLM's own layerwise reload is the BF16 path there.
    load = lambda: runner.reload_weights(weights_iterator=iter(stream))
    baseline = "model_runner.reload_weights (vLLM layerwise reload)"
else:
    load = lambda: model.load_weights(stream)
    baseline = "model.load_weights"

def status():
    s = open("/proc/self/status").read()
    return {{k: int(re.search(k + r":\s+(\d+)", s).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}}

def rss_peak_extra(fn):
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    before = status()["VmRSS"]
    fn()
    return status()["VmHWM"] - before

def torch_peak_extra(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((m.start_ns(), m.nbytes()) for m in prof.profiler.kineto_results.events()
                    if m.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    # the same with each quant-method post-processing call collapsed to its net effect
    windows = [(e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
               if e.name() == "flashrl.quant_method_postprocess"]
    collapsed = []
    for t, nbytes in events:
        w = next(((a, b) for a, b in windows if a <= t <= b), None)
        collapsed.append((w[1] if w else t, nbytes))
    cur = own = 0
    for t, nbytes in sorted(collapsed):
        cur += nbytes
        own = max(own, cur)
    return peak, own

load(); load()  # warm-up (numba compile, first touch, oneDNN primitive caches)
say({{"ready": True, "double": double, "largest": largest, "baseline": baseline,
      "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}})
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "quit":
        break
    if op == "time":
        t = time.perf_counter(); load(); dt = time.perf_counter() - t
        say({{"s": dt, "timing": dict(state.timing) if state is not None else {{}}}})
    elif op == "mem":
        out = {{}}
        modes = ("layerwise", "rebuild_all") if state is not None else ("layerwise",)
        for mode in modes:
            if state is not None:
                state.rebuild_all = mode == "rebuild_all"
            load()  # settle this mode's allocations
            out["rss_" + mode] = min(rss_peak_extra(load) for _ in range(3))
            if state is not None:
                out["torch_" + mode], out["own_" + mode] = torch_peak_extra(load)
        if state is not None:
            state.rebuild_all = False
        say(out)
"""


class Engine:
    """One engine subprocess, driven over stdin/stdout."""

    def __init__(self, role: str, paths: dict, env: dict):
        code = ENGINE_CODE.format(tests=os.path.join(ROOT, "tests", "flashrl"), role=role, paths=paths, mark=MARK)
        full = dict(os.environ)
        full.update(env)
        self.role = role
        self.err = tempfile.TemporaryFile(mode="w+")  # (a pipe nobody reads could fill and block the engine)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=full, cwd=ROOT)
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        code = self.proc.wait()
        self.err.seek(0)
        raise RuntimeError(f"{self.role} engine exited ({code}):\n{self.err.read()[-4000:]}")

    def ask(self, op: str) -> dict:
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(60)
        except Exception:  # noqa: BLE001
            self.proc.kill()
        self.err.close()


def engine_env(role: str, paths: dict, mem: bool) -> dict:
    env = dict(ENGINE_ENV)
    if role == "int8":
        env["ASCEND_RL_FLASHRL"] = paths["config"]
    if mem:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    return env


def measure_time(paths: dict, rounds: int) -> dict:
    engines = {r: Engine(r, paths, engine_env(r, paths, mem=False)) for r in ("int8", "bf16")}
    try:
        rows = []
        for i in range(rounds):
            order = ("int8", "bf16") if i % 2 == 0 else ("bf16", "int8")
            row = {r: engines[r].ask("time") for r in order}
            rows.append(row)
    finally:
        for e in engines.values():
            e.close()
    int8 = [r["int8"]["s"] for r in rows]
    bf16 = [r["bf16"]["s"] for r in rows]
    postq = [r["int8"]["timing"].get("postprocess_quantized_s", 0.0) for r in rows]
    postu = [r["int8"]["timing"].get("postprocess_unquantized_s", 0.0) for r in rows]
    post = [a + b for a, b in zip(postq, postu)]
    quant = [r["int8"]["timing"].get("quantize_s", 0.0) for r in rows]
    return {"int8_s": statistics.median(int8), "bf16_s": statistics.median(bf16),
            "ratio": statistics.median(a / b for a, b in zip(int8, bf16)),
            "ratio_min": min(a / b for a, b in zip(int8, bf16)), "ratio_max": max(a / b for a, b in zip(int8, bf16)),
            "postprocess_s": statistics.median(post), "postprocess_quantized_s": statistics.median(postq),
            "postprocess_unquantized_s": statistics.median(postu), "quantize_s": statistics.median(quant),
            "rest_s": statistics.median(a - p - q for a, p, q in zip(int8, post, quant)),
            "own_ratio": statistics.median((a - p) / b for a, p, b in zip(int8, post, bf16)),
            "rounds": rounds, "raw": rows, "baseline": engines["bf16"].info["baseline"],
            "double": engines["int8"].info["double"]}


def measure_memory(paths: dict) -> dict:
    out = {}
    for role in ("int8", "bf16"):
        e = Engine(role, paths, engine_env(role, paths, mem=True))
        try:
            out[role] = dict(e.ask("mem"), largest=e.info["largest"], baseline=e.info["baseline"])
        finally:
            e.close()
    return out


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
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the quantization timings")
    ap.add_argument("--rounds", type=int, default=9, help="lockstep reload rounds (section 3)")
    ap.add_argument("--skip-engine", action="store_true", help="only the quantization throughput")
    ap.add_argument("--json", action="store_true", help="also print every measurement as JSON")
    args = ap.parse_args()
    print(f"# bench_flashrl  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  python {sys.version.split()[0]}  "
          f"cpus={os.cpu_count()}  load average {os.getloadavg()[0]:.2f}")
    rows = bench_quantization(args.reps)
    print("\n## 1. online quantization throughput (GB/s of BF16 input, best of %d)" % args.reps)
    print("| weight | INT8 ours (fused, CPU kernel) | INT8 ours (blocked torch, any device) | FP8 ours (blocked torch) "
          "| FlashRL INT8 formula (naive torch) | speed-up (INT8 fused) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['ours_gbs']:.2f} | {r['torch_blocked_gbs']:.2f} | {r['fp8_gbs']:.2f} | "
              f"{r['flashrl_gbs']:.2f} | {r['ratio']:.1f}x |")
    if args.skip_engine:
        return 0
    with tempfile.TemporaryDirectory() as wd:
        paths = build(wd)
        mem = measure_memory(paths)
        tm = measure_time(paths, args.rounds)
    lt = mem["int8"]["largest"]
    print(f"\n## 2. peak extra memory of a full reload, vLLM's post-processing included (model "
          f"{MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, intermediate "
          f"{MODEL['intermediate_size']}, vocab {MODEL['vocab_size']})")
    print("| approach | RSS high-water, MiB (all allocators) | / largest | torch allocator peak, MiB | / largest "
          "| torch, quant-method transients collapsed, MiB | / largest |")
    print("|---|---|---|---|---|---|---|")
    for name, key in (("INT8, layer by layer (ascend-rl)", "layerwise"),
                      ("INT8, rebuild every layer first (FlashRL)", "rebuild_all")):
        m = mem["int8"]
        print(f"| {name} | {m['rss_' + key] / MIB:.2f} | {m['rss_' + key] / lt:.2f} | {m['torch_' + key] / MIB:.2f} "
              f"| {m['torch_' + key] / lt:.2f} | {m['own_' + key] / MIB:.2f} | {m['own_' + key] / lt:.2f} |")
    b = mem["bf16"]
    print(f"| BF16, {b['baseline']} | {b['rss_layerwise'] / MIB:.2f} | {b['rss_layerwise'] / lt:.2f} | | | | |")
    print(f"| largest single BF16 weight tensor of the update | {lt / MIB:.2f} | 1.00 | | | | |")
    print(f"\n## 3. reload time, {tm['rounds']} lockstep rounds (median seconds)")
    print("| engine | seconds | / BF16 |")
    print("|---|---|---|")
    print(f"| BF16 engine, {tm['baseline']} | {tm['bf16_s']:.3f} | 1.00 |")
    print(f"| INT8 engine, flashrl reload (quantize + load + post-process) | {tm['int8_s']:.3f} | "
          f"{tm['ratio']:.2f} (per-round median; range {tm['ratio_min']:.2f}-{tm['ratio_max']:.2f}) |")
    print(f"| - of which vLLM's post-processing of the INT8 layers (oneDNN int8 prepack, azp_adj) | "
          f"{tm['postprocess_quantized_s']:.3f} | {tm['postprocess_quantized_s'] / tm['bf16_s']:.2f} |")
    print(f"| - of which vLLM's post-processing of embedding / lm_head (oneDNN bf16 prepack, as in the BF16 "
          f"engine) | {tm['postprocess_unquantized_s']:.3f} | |")
    print(f"| - of which online quantization (this project) | {tm['quantize_s']:.3f} | |")
    print(f"| - rest: vLLM's loaders, copies, bookkeeping | {tm['rest_s']:.3f} | |")
    print(f"| INT8 reload without vLLM's post-processing / BF16 reload | | {tm['own_ratio']:.2f} |")
    if tm.get("double"):
        print("\n(recipe stack: the int8 GEMM/handler is the tests' torch double of vLLM's missing oneDNN ops; "
              "section 3 does not time vLLM's kernel there)")
    if args.json:
        print(json.dumps({"quant": rows, "memory": mem, "time": tm}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
