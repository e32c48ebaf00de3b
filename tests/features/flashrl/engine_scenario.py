"""Artifacts and engine-side scenarios for the flashrl engine tests (run in subprocesses).

``build_artifacts`` (no engine): a BF16 tiny Qwen3 "A", an updated copy "B" (A plus
noise on every tensor, like a training step), known power-of-two smoothing factors,
W8A8 checkpoints of A and B written by this project's quantizer, the profile derived
from (A, W8A8(A)), and a FlashRL config naming W8A8(A). The same for the *static*
activation scheme (``int8s_*``: per-tensor ``input_scale`` per linear, the same
calibration for A and B -- a weight update does not recalibrate) and for FP8.
"""

from __future__ import annotations

import json
import os

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:"]


def build_artifacts(workdir: str) -> dict:

    import torch
    from safetensors.torch import save_file

    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features.flashrl import checkpoint, config, profile
    from ascend_rl_plugins.quant import quant

    a_dir = tiny_qwen3.cached()
    paths = {k: os.path.join(workdir, k) for k in ("bf16_b", "int8_a", "int8_b", "int8s_a", "int8s_b",
                                                   "fp8_a", "fp8_b")}
    paths["bf16_a"] = a_dir
    paths["profile"] = os.path.join(workdir, "profile.pt")
    paths["config"] = os.path.join(workdir, "flashrl.yaml")
    paths["config_b"] = os.path.join(workdir, "flashrl_b.yaml")
    paths["fp8_profile"] = os.path.join(workdir, "profile_fp8.pt")
    paths["fp8_config"] = os.path.join(workdir, "flashrl_fp8.yaml")
    paths["int8s_profile"] = os.path.join(workdir, "profile_static.pt")
    paths["int8s_config"] = os.path.join(workdir, "flashrl_static.yaml")
    if os.path.exists(os.path.join(workdir, "done.json")):
        return paths
    a = profile.read_tensors(a_dir)
    g = torch.Generator().manual_seed(123)
    b = {}
    for name, t in a.items():
        noise = torch.randn(t.shape, generator=g) * (0.05 if "norm" in name else 0.02)
        b[name] = (t.float() + noise).to(t.dtype)
    os.makedirs(paths["bf16_b"], exist_ok=True)
    save_file(b, os.path.join(paths["bf16_b"], "model.safetensors"), metadata={"format": "pt"})
    tiny_qwen3.copy_model_files(a_dir, paths["bf16_b"])
    known = known_factors(a)
    shapes = checkpoint.linear_shapes(a)
    for src, dst in (("bf16_a", "int8_a"), ("bf16_b", "int8_b")):
        prof = profile.Profile.from_factors(shapes, known["norm"], known["down"])
        checkpoint.quantize_checkpoint(paths[src], paths[dst], profile=prof)
    scales = static_input_scales(shapes)
    for src, dst in (("bf16_a", "int8s_a"), ("bf16_b", "int8s_b")):
        prof = profile.Profile.from_factors(shapes, known["norm"], known["down"], scheme="static",
                                            input_scales=scales)
        checkpoint.quantize_checkpoint(paths[src], paths[dst], profile=prof, scheme="static")
    profile.derive_profile(a_dir, paths["int8s_a"]).save(paths["int8s_profile"])
    config.write_config(paths["int8s_config"], config.RolloutConfig(fn="int8", model=paths["int8s_a"],
                                                                    profile=paths["int8s_profile"]), append=False)
    for src, dst in (("bf16_a", "fp8_a"), ("bf16_b", "fp8_b")):
        prof = profile.Profile.from_factors(shapes, known["norm"], known["down"], fn="fp8_channel")
        checkpoint.quantize_checkpoint(paths[src], paths[dst], profile=prof, fn="fp8_channel")
    profile.derive_profile(a_dir, paths["fp8_a"], fn="fp8_channel").save(paths["fp8_profile"])
    config.write_config(paths["fp8_config"], config.RolloutConfig(fn="fp8_channel", model=paths["fp8_a"],
                                                                  profile=paths["fp8_profile"]), append=False)
    derived = profile.derive_profile(a_dir, paths["int8_a"])
    derived.save(paths["profile"])
    config.write_config(paths["config"], config.RolloutConfig(fn="int8", model=paths["int8_a"],
                                                              profile=paths["profile"]), append=False)
    config.write_config(paths["config_b"], config.RolloutConfig(fn="int8", model=paths["int8_b"],
                                                                profile=paths["profile"]), append=False)
    with open(os.path.join(workdir, "done.json"), "w") as fh:
        json.dump(paths, fh)
    del quant
    return paths


def known_factors(tensors) -> dict:
    """Seeded power-of-two smoothing factors for every norm and down_proj."""
    import torch

    from ascend_rl_plugins.features.flashrl import profile

    g = torch.Generator().manual_seed(7)
    norm, down = {}, {}
    for name, t in sorted(tensors.items()):
        if profile.is_quantizable_linear(name, t.shape):
            n = profile.norm_of(name)
            if n is not None and n not in norm:
                norm[n] = torch.exp2(torch.randint(-2, 3, (t.shape[1],), generator=g).float())
            if profile.gain_source(name) is not None:
                down[name] = torch.exp2(torch.randint(-2, 3, (t.shape[1],), generator=g).float())
    return {"norm": norm, "down": down}


def static_input_scales(shapes) -> dict:
    """Seeded per-tensor activation scales ([1], float32), different for every linear
    (also for the shards of a fused layer, so vLLM's max over the shards matters)."""
    import torch

    g = torch.Generator().manual_seed(11)
    return {name[: -len(".weight")]: torch.exp2(torch.randint(-6, -2, (1,), generator=g).float())
            * (1.0 + torch.rand(1, generator=g))
            for name in sorted(shapes)}


# -- engine side ----------------------------------------------------------------------

def _model(llm):
    engine = llm.llm_engine
    executor = getattr(engine, "model_executor", None)
    if executor is None:
        executor = engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner.model


def _generate(llm):
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
    out = []
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        c = o.outputs[0]
        out.append({"tokens": list(c.token_ids),
                    "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in c.logprobs],
                    "prompt_logprobs": [None if d is None else {str(k): v.logprob for k, v in d.items()}
                                        for d in o.prompt_logprobs]})
    return out


def as_bits(t):
    """FP8 tensors compared as their bytes (torch.equal has no float8 kernel on CPU)."""
    import torch
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def bits_equal(a, b) -> bool:
    import torch
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


def _processed_state(model) -> dict:
    """Every tensor the engine holds for the model (after post-processing)."""
    import torch
    state = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    for n, b in model.named_buffers():
        if b.dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn):
            state["buffer:" + n] = b.detach().clone().contiguous()
    return state


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _stream(model_dir):
    from ascend_rl_plugins.features.flashrl.profile import read_tensors
    return list(read_tensors(model_dir).items())


def run(role: str, paths: dict, out_dir: str) -> dict:
    import gc

    import torch
    from safetensors.torch import load_file, save_file

    from . import onednn_int8_double
    double = onednn_int8_double.install()
    # role "reload" / "direct" (int8, dynamic scheme), "static_*" (int8, static scheme), "fp8_*"
    fmt = {"fp8_": "fp8", "static_": "int8s"}.get(role[: role.find("_") + 1], "int8")
    role = role.split("_", 1)[1] if fmt != "int8" else role
    if fmt == "fp8":
        from . import fp8_capability_double
        fp8_capability_double.install()
    from vllm import LLM

    # the trainer-side path (BF16) is what verl passes; flashrl swaps in the W8A8 model
    model_arg = paths["bf16_a"] if role == "reload" else paths[f"{fmt}_b"]
    llm = LLM(model=model_arg, enforce_eager=True, max_model_len=256, max_num_seqs=4, dtype="bfloat16",
              seed=0, gpu_memory_utilization=0.5)
    import time
    t0 = time.perf_counter()
    model = _model(llm)
    res = {"double": double, "lm_head_dtype": str(model.lm_head.weight.dtype),
           "served": llm.llm_engine.model_config.model,
           "scheme": type(getattr(model.model.layers[0].mlp.gate_up_proj, "scheme", None)).__name__}
    if role == "direct":
        res["out"] = _generate(llm)
        save_file(_processed_state(model), os.path.join(out_dir, f"{fmt}_direct_state.safetensors"))
        return res
    from ascend_rl_plugins.features.flashrl import reload as rl
    state = rl.state_of(model)
    res["wrapped"] = state is not None
    res["out_before"] = _generate(llm)
    res["t_gen"] = time.perf_counter() - t0
    ptrs0 = {n: p.data_ptr() for n, p in model.named_parameters()}
    input_scales0 = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(".input_scale")}
    # the output type of every int8 oneDNN handler the reload builds (for static activations
    # the matmul writes that dtype straight into the activation-dtype output buffer)
    handler_types = set()
    if fmt != "fp8":
        import vllm._custom_ops as ops
        create = ops.create_onednn_scaled_mm

        def recording_create(weight, weight_scales, output_type, dynamic_quant, *args, **kwargs):
            handler_types.add(f"{output_type}/{'dynamic' if dynamic_quant else 'static'}")
            return create(weight, weight_scales, output_type, dynamic_quant, *args, **kwargs)
        ops.create_onednn_scaled_mm = recording_create
    state.keep_quantized = True
    loaded = model.load_weights(_stream(paths["bf16_b"]))
    res["loaded"] = len(loaded)
    res["stats"] = dict(state.last_stats)
    res["handler_types"] = sorted(handler_types)
    res["engine_default_dtype"] = str(state.default_dtype)
    res["default_dtype_after"] = str(torch.get_default_dtype())
    res["input_scales"] = len(input_scales0)
    res["input_scale_changed"] = sorted(n for n, p in model.named_parameters() if n in input_scales0
                                        and not torch.equal(p, input_scales0[n]))
    # bit-exact comparison of the online quantization with the offline W8A8(B) checkpoint
    offline = load_file(os.path.join(paths[f"{fmt}_b"], "model.safetensors"))
    mism = {}
    for wname, (q, s) in state.last_quantized.items():
        if not bits_equal(q, offline[wname]) or not torch.equal(s, offline[wname + "_scale"]):
            mism[wname] = int((as_bits(q) != as_bits(offline[wname])).sum())
    res["n_quantized"] = len(state.last_quantized)
    res["quant_mismatch"] = mism
    res["norm_mismatch"] = [n for n, t in _stream(paths[f"{fmt}_b"]) if n.endswith("norm.weight") and not
                            torch.equal(dict(model.named_parameters()).get(n, t).float(), t.float())]
    state.keep_quantized = False
    state.last_quantized = None
    ptrs1 = {n: p.data_ptr() for n, p in model.named_parameters()}
    res["ptr_changed"] = sorted(n for n in ptrs0 if ptrs1.get(n) != ptrs0[n])
    res["n_params"] = len(ptrs0)
    res["out_after"] = _generate(llm)
    save_file(_processed_state(model), os.path.join(out_dir, f"{fmt}_reload_state.safetensors"))
    # repeated reloads: memory must not grow
    stream_a, stream_b = _stream(paths["bf16_a"]), _stream(paths["bf16_b"])
    rss = []
    for i in range(6):
        model.load_weights(stream_a if i % 2 == 0 else stream_b)
        gc.collect()
        rss.append(_rss())
    res["rss"] = rss
    res["t_reloads"] = time.perf_counter() - t0
    res["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    res["out_final"] = _generate(llm)
    ptrs2 = {n: p.data_ptr() for n, p in model.named_parameters()}
    res["ptr_changed_final"] = sorted(n for n in ptrs0 if ptrs2.get(n) != ptrs0[n])
    # a partial update of a fused layer is refused and leaves the engine untouched
    one = [(n, t) for n, t in stream_b if n.endswith("layers.0.self_attn.q_proj.weight")]
    try:
        model.load_weights(one)
        res["partial_error"] = None
    except Exception as exc:  # noqa: BLE001
        res["partial_error"] = f"{type(exc).__name__}: {exc}"
    res["out_after_partial"] = _generate(llm)
    return res


def start_errors(model: str, values: list) -> list:
    """For each value of ``ASCEND_RL_FLASHRL``: the error an engine start on ``model`` raises
    ("Type: message"), or None when the engine starts."""
    from vllm import LLM

    from ascend_rl_plugins import flags

    from . import onednn_int8_double
    onednn_int8_double.install()  # (vLLM 0.13's CPU wheel lacks the int8 ops an INT8 start needs)
    errors = []
    for value in values:
        os.environ["ASCEND_RL_FLASHRL"] = value
        flags.reset_cache()  # flag values are parsed once per process
        try:
            LLM(model=model, enforce_eager=True, max_model_len=128, max_num_seqs=2)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - the test asserts which error
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors
