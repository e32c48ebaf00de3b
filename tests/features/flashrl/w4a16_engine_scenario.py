"""Artifacts and engine-side scenarios for the W4A16 flashrl tests and benchmark (run in child processes).

``build_artifacts`` (no engine): the tiny BF16 Qwen3 "A" (every linear's dims are multiples
of 32, as vLLM's CPUWNA16 kernel needs), an updated copy "B" (A plus noise, like a training
step), compressed-tensors W4A16 ``pack-quantized`` checkpoints of A and B written *offline*
by the project's converter (``checkpoint.quantize_checkpoint_w4a16``, what ``ascend-rl
flashrl quantize --fn w4a16`` runs), and a FlashRL config naming W4A16(A) with ``fn: w4a16``.

The checkpoint layout is the one vLLM's ``CompressedTensorsWNA16`` reads: per linear
``weight_packed`` int32 ``[out, in/8]``, ``weight_scale`` (model dtype) ``[out, in/G]``,
``weight_shape`` int64 ``[2]``; ``lm_head`` left in BF16.
"""

from __future__ import annotations

import json
import os

from .engine_scenario import _generate, _model, _processed_state, bits_equal
from .verl_scenario import verl_update

GROUP_SIZE = 64


def build_artifacts(workdir: str, group_size: int = GROUP_SIZE, **model_overrides) -> dict:

    import torch
    from safetensors.torch import save_file

    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features.flashrl import checkpoint, config, profile

    a_dir = tiny_qwen3.cached(**model_overrides)
    paths = {k: os.path.join(workdir, k) for k in ("bf16_b", "w4_a", "w4_b")}
    paths["bf16_a"] = a_dir
    paths["config"] = os.path.join(workdir, "flashrl_w4a16.yaml")
    paths["group_size"] = group_size
    if os.path.exists(os.path.join(workdir, "done.json")):
        return paths
    a = profile.read_tensors(a_dir)
    g = torch.Generator().manual_seed(321)
    b = {n: (t.float() + torch.randn(t.shape, generator=g) * (0.05 if "norm" in n else 0.02)).to(t.dtype)
         for n, t in a.items()}
    os.makedirs(paths["bf16_b"], exist_ok=True)
    save_file(b, os.path.join(paths["bf16_b"], "model.safetensors"), metadata={"format": "pt"})
    tiny_qwen3.copy_model_files(a_dir, paths["bf16_b"])
    # the offline converter (`ascend-rl flashrl quantize --fn w4a16 --group-size G --scope all`)
    checkpoint.quantize_checkpoint_w4a16(a_dir, paths["w4_a"], group_size=group_size, scope="all", preset="ct")
    checkpoint.quantize_checkpoint_w4a16(paths["bf16_b"], paths["w4_b"], group_size=group_size, scope="all",
                                         preset="ct")
    config.write_config(paths["config"], config.RolloutConfig(fn="w4a16", model=paths["w4_a"]), append=False)
    with open(os.path.join(workdir, "done.json"), "w") as fh:
        json.dump(paths, fh)
    return paths


# -- engine side ----------------------------------------------------------------------

VERL_EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"


def without_warm_up_forward() -> None:
    """Start engines in this process without the CPU model runner's warm-up forward.

    For a vLLM CPU build that lacks the W4A16 matmul (``torch.ops._C.cpu_gemm_wna16``: vLLM's
    AVX2 kernel library): the warm-up would call it and the engine would never start, although
    everything the reload tests check -- the scheme and kernel vLLM selects, its weight
    post-processing, flashrl's online quantization into the kernel's storage, the refusals --
    runs without a matmul. flashrl refuses a ``fn: w4a16`` engine start on such a build
    (``fp8_support.cpu_w4a16_matmul_missing``, tested by
    ``test_w4a16_refused_at_engine_start_without_the_cpu_matmul``); an engine that never runs
    a forward never calls the matmul, so here that check is doubled to answer "present".
    Nothing else of the engine start changes; the callers generate nothing in this mode."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from ascend_rl_plugins.features.flashrl import fp8_support

    def warming_up_model_skipped(self) -> None:
        return None
    CPUModelRunner.warming_up_model = warming_up_model_skipped
    fp8_support.cpu_w4a16_matmul_missing = _matmul_never_called


def _matmul_never_called() -> None:
    """Double of ``fp8_support.cpu_w4a16_matmul_missing`` for engines without a forward."""
    return None


def make_llm(model: str, **kwargs):
    from vllm import LLM
    return LLM(model=model, enforce_eager=True, max_model_len=256, max_num_seqs=4, dtype="bfloat16", seed=0,
               gpu_memory_utilization=0.5, **kwargs)


def stream(model_dir: str) -> list:
    from ascend_rl_plugins.features.flashrl.profile import read_tensors
    return list(read_tensors(model_dir).items())


def torch_peak_extra(fn) -> int:
    """Peak bytes the torch CPU allocator held above its level at the start of ``fn()``
    (torch.profiler memory events: every tensor allocated and freed inside, vLLM's included)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((m.start_ns(), m.nbytes()) for m in prof.profiler.kineto_results.events()
                    if m.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak


def _wna16_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if n.endswith((".weight_packed", ".weight_scale"))}


def run(role: str, paths: dict, out_dir: str, verl_src: str | None = None, forward: bool = True) -> dict:
    """role "reload": serve W4A16(A) (flashrl swaps it in for A's BF16 path), reload BF16 B
    online (checked against the offline W4A16(B) bit for bit), then BF16 A again. With
    ``verl_src`` (verl 0.9.1's unpacked source) the engine carries verl's worker extension and
    B arrives through verl's bucketed update path (flashrl's session hook); A through
    ``model.load_weights``.
    role "direct": serve W4A16(B) with stock vLLM (its own post-processing).
    ``forward=False`` (a build without the W4A16 matmul): the engines start without their
    warm-up forward and generate nothing (every ``out*`` is None); the rest is checked alike."""
    import torch
    from safetensors.torch import load_file, save_file

    if not forward:
        without_warm_up_forward()

    def generate(llm):
        return _generate(llm) if forward else None

    extra = {}
    if verl_src and role == "reload":
        import importlib

        import zmq

        from .verl_scenario import install_verl_scaffolding
        os.environ.setdefault("VERL_RAY_JOB_ID", f"ascendrlw4{os.getpid()}")
        install_verl_scaffolding(verl_src)
        # imported before the engine (as verl's server does): vLLM copies the extension's methods
        # into its worker class, so the flashrl session hook must be on the class by then
        importlib.import_module("verl.workers.rollout.vllm_rollout.utils")
        zmq.Context.instance().setsockopt(zmq.RCVTIMEO, 20_000)
        extra["worker_extension_cls"] = VERL_EXTENSION
    llm = make_llm(paths["bf16_a"] if role == "reload" else paths["w4_b"], **extra)
    model = _model(llm)
    layer = model.model.layers[0].mlp.gate_up_proj
    res = {"served": llm.llm_engine.model_config.model,
           "scheme": type(getattr(layer, "scheme", getattr(layer.quant_method, "scheme", None))).__name__,
           "kernel": type(getattr(getattr(layer, "scheme", None) or layer.quant_method.scheme, "kernel", None)).__name__,
           "use_w4a8": bool(getattr(layer, "use_w4a8", True))}
    if role == "direct":
        res["out"] = generate(llm)
        save_file(_processed_state(model), os.path.join(out_dir, "w4_direct_state.safetensors"))
        return res
    from ascend_rl_plugins.features.flashrl import reload as rl
    state = rl.state_of(model)
    res["wrapped"] = state is not None
    res["spec"] = [state.int4_spec.group_size, state.int4_spec.preset] if state else None
    res["out_a"] = generate(llm)
    state_a = _processed_state(model)
    ptrs0 = {n: p.data_ptr() for n, p in model.named_parameters()}
    res["n_wna16_params"] = len(_wna16_params(model))
    stream_a, stream_b = stream(paths["bf16_a"]), stream(paths["bf16_b"])
    res["largest_bf16"] = max(t.numel() * t.element_size() for _, t in stream_b)
    res["largest_quantized_bf16"] = max(t.numel() * t.element_size() for n, t in stream_b
                                        if (state.module_of(n)[0] or rl._NO).quantized)
    state.keep_quantized = True
    if extra:
        res["verl_errors"] = verl_update(llm, stream_b)
    else:
        model.load_weights(stream_b)
    res["stats"] = dict(state.last_stats)
    res["open_session"] = state.update is not None
    offline = load_file(os.path.join(paths["w4_b"], "model.safetensors"))
    mism = []
    for wname, (packed, scale) in state.last_quantized.items():
        if not torch.equal(packed, offline[wname + "_packed"]) or not bits_equal(scale, offline[wname + "_scale"]):
            mism.append(wname)
    res["n_quantized"] = len(state.last_quantized)
    res["quant_mismatch"] = mism
    state.keep_quantized = False
    state.last_quantized = None
    res["out_b"] = generate(llm)
    save_file(_processed_state(model), os.path.join(out_dir, "w4_reload_state.safetensors"))
    res["ptr_changed_b"] = sorted(n for n, p in model.named_parameters() if p.data_ptr() != ptrs0.get(n))
    res["peak_a"] = torch_peak_extra(lambda: model.load_weights(stream_a))
    res["out_a2"] = generate(llm)
    now = _processed_state(model)
    res["state_a_diff"] = sorted(k for k in state_a if not bits_equal(state_a[k], now[k]))
    res["ptr_changed_a"] = sorted(n for n, p in model.named_parameters() if p.data_ptr() != ptrs0.get(n))
    # a partial update of a fused layer is refused and leaves the engine as it was
    one = [(n, t) for n, t in stream_b if n.endswith("layers.0.self_attn.q_proj.weight")]
    try:
        model.load_weights(one)
        res["partial_error"] = None
    except Exception as exc:  # noqa: BLE001
        res["partial_error"] = f"{type(exc).__name__}: {exc}"
    after_partial = _processed_state(model)
    res["state_after_partial_diff"] = sorted(k for k in now if not bits_equal(now[k], after_partial[k]))
    res["out_after_partial"] = generate(llm)
    return res


def start_errors(model: str, values: list, extra_env: list | None = None, forward: bool = True) -> list:
    """For each value of ``ASCEND_RL_FLASHRL`` (with the matching dict of extra environment
    variables): the error an engine start on ``model`` raises ("Type: message"), or None.
    ``forward=False``: engines start without their warm-up forward (:func:`without_warm_up_forward`)."""
    from vllm import LLM
    if not forward:
        without_warm_up_forward()

    from ascend_rl_plugins import flags
    errors = []
    for i, value in enumerate(values):
        extra = (extra_env or [{}] * len(values))[i]
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        os.environ["ASCEND_RL_FLASHRL"] = value
        flags.reset_cache()
        try:
            LLM(model=model, enforce_eager=True, max_model_len=128, max_num_seqs=2)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - the test asserts which error
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return errors
