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
   Both engines stay up and are driven in lockstep, alternating which goes first and
   alternating the update between weights B and A (so every reload changes every
   weight); medians and the median of the per-round ratios are reported, plus where each
   reload's time goes, and how much CPU other processes took during the rounds (this is
   a shared 2-core machine: a round counts as quiet below 10 %). ``--threads 1`` runs
   both engines single-threaded on the same pinned core, which other processes then
   mostly leave alone; the default is vLLM's own thread setup (all cores).

   The BF16 baseline is the cheapest BF16 reload *that takes effect*, checked by the
   benchmark itself (greedy tokens and log-probs of two prompts: initial A, after
   reloading B -- they must change --, after reloading A -- they must be restored
   exactly): on vLLM 0.23 CPU, ``UnquantizedLinearMethod.process_weights_after_loading``
   prepacks every BF16 linear into a oneDNN handler and replaces ``layer.weight`` by an
   empty tensor (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``), and
   ``lm_head`` is prepacked too (weight kept, but the logits come from the prepacked
   copy), so a plain ``model.load_weights`` raises ("Attempted to load weight ... into
   parameter (torch.Size([0]))") and would leave lm_head's prepacked copy stale anyway; the BF16
   path there is vLLM's layerwise ``model_runner.reload_weights(weights_iterator=...)``,
   which rebuilds each layer, loads it and re-runs its post-processing (the bf16
   prepack: its share of the BF16 reload is reported). On vLLM 0.13 (recipe stack) the
   CPU wheel has no oneDNN (``_supports_onednn`` False): BF16 linears and lm_head call
   ``torch.nn.functional.linear`` on the live weight, so a plain ``model.load_weights``
   is complete (outputs identical to an engine started on B) and is the baseline
   (0.13's ``reload_weights()`` only re-reads the checkpoint from disk).

   Results, with the machine and stack they come from: the feature's README
   (``ascend_rl_plugins/features/flashrl/README.md``, section Measured).
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
QUIET = 0.10  # a reload round counts as quiet when other processes used < 10 % of the machine's CPU


def bench_quantization(reps: int) -> list[dict]:
    import torch

    from ascend_rl_plugins.quant import quant as Q
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
import inspect, json, os, re, sys, time
if os.environ.get("BENCH_PIN_CPU"):  # --threads 1: both engines on the same single core
    os.sched_setaffinity(0, {{int(os.environ["BENCH_PIN_CPU"])}})
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
from vllm import LLM, SamplingParams
from ascend_rl_plugins.features.flashrl.profile import read_tensors
# (token-id prompts only: no tokenizer needed, so a tiny model cached by either stack's transformers works)
llm = LLM(model=paths["bf16_a"], enforce_eager=True, max_model_len=128, max_num_seqs=2, dtype="bfloat16",
          gpu_memory_utilization=0.5, skip_tokenizer_init=True)
eng = llm.llm_engine
ex = getattr(eng, "model_executor", None) or eng.engine_core.engine_core.model_executor
runner = ex.driver_worker.worker.model_runner
model = runner.model
streams = {{k: list(read_tensors(paths["bf16_" + k]).items()) for k in ("a", "b")}}
largest = max(t.numel() * t.element_size() for _, t in streams["b"])
state = None
post = {{"s": 0.0}}
if role == "int8":
    from ascend_rl_plugins.features.flashrl import reload as rl
    state = rl.state_of(model)
    load = lambda s: model.load_weights(s)
    baseline = "model.load_weights (flashrl: quantize + load + post-process)"
elif "weights_iterator" in inspect.signature(getattr(runner, "reload_weights", lambda: None)).parameters:
    # vLLM 0.23 CPU prepacks BF16 linears into oneDNN and drops their weights, so a bare
    # model.load_weights cannot reload them; vLLM's own layerwise reload is the BF16 path there.
    # (vLLM 0.13's reload_weights() only re-reads the checkpoint from disk; its CPU wheel has no
    # oneDNN, BF16 linears read their weight directly and a plain model.load_weights is complete.)
    load = lambda s: runner.reload_weights(weights_iterator=iter(s))
    baseline = "model_runner.reload_weights (vLLM layerwise reload)"
else:
    load = lambda s: model.load_weights(s)
    baseline = "model.load_weights"
if role == "bf16":
    # time vLLM's own post-processing of the BF16 layers inside the baseline (oneDNN bf16 prepack)
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    for cls in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        def timed(self, layer, _orig=cls.process_weights_after_loading):
            t = time.perf_counter()
            try:
                return _orig(self, layer)
            finally:
                post["s"] += time.perf_counter() - t
        cls.process_weights_after_loading = timed

def generate():
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    prompts = [{{"prompt_token_ids": [5, 17, 99, 300, 42, 7]}}, {{"prompt_token_ids": [11, 2, 3, 4]}}]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [[list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]]
            for c in (o.outputs[0] for o in outs)]

# Does the reload take effect? Greedy tokens + log-probs: initial (A), after reloading B, after reloading A.
check = {{}}
out_a = generate()
if role == "bf16":
    try:
        model.load_weights(streams["b"])
        check["plain_load_weights"] = "ran"
        check["plain_equals_baseline"] = generate()
    except Exception as exc:
        check["plain_load_weights"] = f"raised {{type(exc).__name__}}: {{str(exc)[:120]}}"
load(streams["b"])
out_b = generate()
load(streams["a"])
check["b_differs"] = out_b != out_a
check["a_restored"] = generate() == out_a
if "plain_equals_baseline" in check:
    check["plain_equals_baseline"] = check["plain_equals_baseline"] == out_b
load(streams["b"]); load(streams["a"])  # warm-up (numba compile, first touch, oneDNN primitive caches)
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

say({{"ready": True, "double": double, "largest": largest, "baseline": baseline, "check": check,
      "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}})
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "quit":
        break
    if op == "time":
        stream = streams[cmd["stream"]]
        post["s"] = 0.0
        t = time.perf_counter(); load(stream); dt = time.perf_counter() - t
        say({{"s": dt, "timing": dict(state.timing) if state is not None else {{"postprocess_s": post["s"]}}}})
    elif op == "mem":
        load_b = lambda: load(streams["b"])
        out = {{}}
        modes = ("layerwise", "rebuild_all") if state is not None else ("layerwise",)
        for mode in modes:
            if state is not None:
                state.rebuild_all = mode == "rebuild_all"
            load_b()  # settle this mode's allocations
            out["rss_" + mode] = min(rss_peak_extra(load_b) for _ in range(3))
            if state is not None:
                out["torch_" + mode], out["own_" + mode] = torch_peak_extra(load_b)
        if state is not None:
            state.rebuild_all = False
        say(out)
"""


class Engine:
    """One engine subprocess, driven over stdin/stdout."""

    def __init__(self, role: str, paths: dict, env: dict):
        code = ENGINE_CODE.format(tests=os.path.join(ROOT, "tests", "features", "flashrl"), role=role, paths=paths, mark=MARK)
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

    def ask(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps(dict(kw, op=op)) + "\n")
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


def engine_env(role: str, paths: dict, mem: bool, threads: int = 0) -> dict:
    env = dict(ENGINE_ENV)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
        if threads == 1:
            env["BENCH_PIN_CPU"] = str(max(os.sched_getaffinity(0)))
    if role == "int8":
        env["ASCEND_RL_FLASHRL"] = paths["config"]
    if mem:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    return env


def _cpu_ticks(pids, cpu: str = "") -> tuple[int, int]:
    """(busy ticks incl. steal of the machine, or of core ``cpu``; CPU ticks of ``pids`` incl. their threads)."""
    with open("/proc/stat") as fh:
        f = next([int(x) for x in line.split()[1:]] for line in fh if line.split()[0] == "cpu" + cpu)
    busy = sum(f[:8]) - f[3] - f[4]  # user nice system [idle iowait] irq softirq steal
    own = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            st = fh.read().rsplit(")", 1)[1].split()
        own += int(st[11]) + int(st[12])  # utime, stime
    return busy, own


def measure_time(paths: dict, rounds: int, threads: int = 0) -> dict:
    engines = {r: Engine(r, paths, engine_env(r, paths, mem=False, threads=threads)) for r in ("int8", "bf16")}
    hz = os.sysconf("SC_CLK_TCK")
    pids = [e.proc.pid for e in engines.values()] + [os.getpid()]
    pinned = engine_env("bf16", paths, False, threads).get("BENCH_PIN_CPU", "")  # watch that core only
    width = 1 if pinned else (os.cpu_count() or 1)
    try:
        rows = []
        for i in range(rounds):
            order = ("int8", "bf16") if i % 2 == 0 else ("bf16", "int8")
            stream = "b" if i % 2 == 0 else "a"  # every reload changes every weight
            b0, o0, t0 = *_cpu_ticks(pids[:-1] if pinned else pids, pinned), time.perf_counter()
            row = {r: engines[r].ask("time", stream=stream) for r in order}
            b1, o1, t1 = *_cpu_ticks(pids[:-1] if pinned else pids, pinned), time.perf_counter()
            # share of the machine's CPU used by *other* processes (and the hypervisor) in this round
            row["outside"] = max(0.0, ((b1 - b0) - (o1 - o0)) / (hz * (t1 - t0) * width))
            rows.append(row)
    finally:
        for e in engines.values():
            e.close()
    med = statistics.median
    int8 = [r["int8"]["s"] for r in rows]
    bf16 = [r["bf16"]["s"] for r in rows]
    postb = [r["bf16"]["timing"].get("postprocess_s", 0.0) for r in rows]
    postq = [r["int8"]["timing"].get("postprocess_quantized_s", 0.0) for r in rows]
    postu = [r["int8"]["timing"].get("postprocess_unquantized_s", 0.0) for r in rows]
    post = [a + b for a, b in zip(postq, postu)]
    quant = [r["int8"]["timing"].get("quantize_s", 0.0) for r in rows]
    ratios = [a / b for a, b in zip(int8, bf16)]
    outside = [r["outside"] for r in rows]
    quiet = [x for x, o in zip(ratios, outside) if o < QUIET]
    return {"int8_s": med(int8), "bf16_s": med(bf16), "ratio": med(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "bf16_postprocess_s": med(postb),
            "postprocess_s": med(post), "postprocess_quantized_s": med(postq),
            "postprocess_unquantized_s": med(postu), "quantize_s": med(quant),
            "rest_s": med(a - p - q for a, p, q in zip(int8, post, quant)),
            "own_ratio": med((a - p) / b for a, p, b in zip(int8, post, bf16)),
            "own_vs_own": med((a - p) / (b - pb) for a, p, b, pb in zip(int8, post, bf16, postb)),
            "post_ratio": med(p / pb for p, pb in zip(post, postb)) if all(postb) else None,
            "outside": med(outside), "outside_max": max(outside), "quiet_rounds": len(quiet),
            "quiet_ratio": med(quiet) if quiet else None,
            "rounds": rounds, "raw": rows, "baseline": engines["bf16"].info["baseline"],
            "check": {r: e.info["check"] for r, e in engines.items()},
            "double": engines["int8"].info["double"], "threads": threads or os.cpu_count()}


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
    from ascend_rl_plugins.features.flashrl import checkpoint, config, profile
    from ascend_rl_plugins.quant import quant
    a_dir = tiny_qwen3.cached(**MODEL)
    b_dir = os.path.join(workdir, "bf16_b")
    os.makedirs(b_dir, exist_ok=True)
    a = profile.read_tensors(a_dir)
    g = torch.Generator().manual_seed(1)
    save_file({k: (v.float() + torch.randn(v.shape, generator=g) * 0.01).to(v.dtype) for k, v in a.items()},
              os.path.join(b_dir, "model.safetensors"))
    tiny_qwen3.copy_model_files(a_dir, b_dir)
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
    ap.add_argument("--skip-memory", action="store_true", help="no section 2 (peak memory)")
    ap.add_argument("--threads", type=int, default=0,
                    help="section 3: OMP/numba threads per engine (default: vLLM's default, all cores); 1 also pins "
                         "both engines to the same core, which keeps other processes on a shared machine off it")
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
        mem = None if args.skip_memory else measure_memory(paths)
        tm = measure_time(paths, args.rounds, args.threads)
    if mem is not None:
        print_memory(mem)
    print_time(tm)
    if args.json:
        print(json.dumps({"quant": rows, "memory": mem, "time": tm}))
    return 0


def print_memory(mem: dict) -> None:
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


def print_time(tm: dict) -> None:
    print(f"\n## 3. reload time, {tm['rounds']} lockstep rounds, alternating B and A weights, {tm['threads']} "
          f"thread(s) per engine (median seconds)")
    print("| engine | seconds | / BF16 |")
    print("|---|---|---|")
    print(f"| BF16 engine, {tm['baseline']} | {tm['bf16_s']:.3f} | 1.00 |")
    print(f"| - of which vLLM's post-processing of the BF16 layers (oneDNN bf16 prepack where vLLM uses it) | "
          f"{tm['bf16_postprocess_s']:.3f} | {tm['bf16_postprocess_s'] / tm['bf16_s']:.2f} |")
    print(f"| INT8 engine, flashrl reload (quantize + load + post-process) | {tm['int8_s']:.3f} | "
          f"**{tm['ratio']:.2f}** (per-round median; range {tm['ratio_min']:.2f}-{tm['ratio_max']:.2f}) |")
    print(f"| - of which vLLM's post-processing of the INT8 layers (oneDNN int8 prepack, azp_adj) | "
          f"{tm['postprocess_quantized_s']:.3f} | {tm['postprocess_quantized_s'] / tm['bf16_s']:.2f} |")
    print(f"| - of which vLLM's post-processing of embedding / lm_head (oneDNN bf16 prepack, as in the BF16 "
          f"engine) | {tm['postprocess_unquantized_s']:.3f} | |")
    print(f"| - of which online quantization (this project) | {tm['quantize_s']:.3f} | |")
    print(f"| - rest: vLLM's loaders, copies, bookkeeping | {tm['rest_s']:.3f} | |")
    print(f"| INT8 reload without vLLM's post-processing / whole BF16 reload | | {tm['own_ratio']:.2f} |")
    print(f"| INT8 reload without vLLM's post-processing / BF16 reload without it | | {tm['own_vs_own']:.2f} |")
    if tm.get("post_ratio"):
        print(f"| vLLM's post-processing, INT8 engine / BF16 engine | | {tm['post_ratio']:.2f} |")
    where = "the engines' core" if tm["threads"] == 1 else "the machine"
    quiet = f"{tm['quiet_ratio']:.2f}" if tm["quiet_ratio"] else "-"
    print(f"\nCPU used by other processes during the rounds: median {tm['outside'] * 100:.0f} %, max "
          f"{tm['outside_max'] * 100:.0f} % of {where}; INT8 / BF16 over the {tm['quiet_rounds']} rounds with "
          f"< {QUIET * 100:.0f} %: {quiet}")
    print("\nDoes each reload take effect? (greedy tokens and log-probs of two prompts: A, after reloading B, "
          "after reloading A)")
    for role, c in tm["check"].items():
        line = f"* {role}: B changes the outputs: {c['b_differs']}; A restores them exactly: {c['a_restored']}"
        if "plain_load_weights" in c:
            line += f"; a plain model.load_weights(B) {c['plain_load_weights']}"
            if "plain_equals_baseline" in c:
                line += f", outputs equal to the baseline's after B: {c['plain_equals_baseline']}"
        print(line)
    if tm.get("double"):
        print("\n(recipe stack: the int8 GEMM/handler is the tests' torch double of vLLM's missing oneDNN ops; "
              "section 3 does not time vLLM's kernel there)")


if __name__ == "__main__":
    sys.exit(main())
