"""verl 0.6.1's real vLLM rollout on the recipe stack, in one fresh process, checked by three
features (run once per test session by ``verl_rollout.results()``):

1. ``compat`` (verl_vllm_compat): in the pristine process verl's vLLM rollout does not import;
   with the LoRA alias only, the rollout imports and the async server still does not; with
   every patch it does, and the moved names are the very objects of their new modules.
2. ``engine`` (rollout_engine_options, rollout_progress_bar): a real ``vLLMRollout`` (tiny
   random Qwen3 built here with this stack's transformers, vLLM 0.13 on CPU, in-process engine
   behind verl's ``external_launcher`` over a 1-process gloo group) with SAM speculative
   decoding from ``engine_kwargs.vllm``; ``generate_sequences`` runs for real. Drafted tokens are
   counted at the engine's scheduler output; stderr is captured for progress bars.
3. ``options`` (rollout_engine_options): the real ``vLLMRollout.__init__`` with ``vllm.LLM``
   replaced in verl's module by a recorder (an engine per configuration would cost ~20 s each,
   and graph mode does not build on CPU), and verl's real ``validate_config`` on a trainer
   config composed from verl's own ``ppo_megatron_trainer.yaml``.
4. ``revert`` (verl_vllm_compat): reverting the LoRA alias takes ``vllm.lora.models`` away again.

A stage that raises records its traceback and the next stages still run.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback

LORA_PATCH = "verl_vllm_compat.lora_models_module"
SPMD = "verl.workers.rollout.vllm_rollout.vllm_rollout_spmd"
ASYNC = "verl.workers.rollout.vllm_rollout.vllm_async_server"
SPEC = {"method": "sam", "num_speculative_tokens": 3}
PROMPTS = [([5, 6, 7, 8, 9] * 12)[:60], ([300, 301, 302, 303] * 15)[:60]]
PROMPT_LEN, RESPONSE_LEN = 64, 24
BAR = "Processed prompts"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _try_import(name: str) -> str | None:
    import importlib
    try:
        importlib.import_module(name)
    except ImportError as exc:
        return _error(exc)
    return None


def compat(ctx: dict) -> dict:
    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.patching.core import REGISTRY

    out = {"stock_spmd_error": _try_import(SPMD)}
    plugin.load_features()
    REGISTRY.activate(only=[REGISTRY.patches[LORA_PATCH]])
    out["lora_only_state"] = REGISTRY.patches[LORA_PATCH].outcome.state
    out["lora_only_spmd_error"] = _try_import(SPMD)
    out["lora_only_async_error"] = _try_import(ASYNC)
    plugin.activate("verl_rollout_scenario")
    out["spmd_error"] = _try_import(SPMD)
    out["async_error"] = _try_import(ASYNC)
    import vllm.lora
    import vllm.lora.lora_model as lora_model
    import vllm.utils
    from vllm.utils import argparse_utils, network_utils

    import verl.utils.vllm.utils as verl_vllm_utils
    out["same_lora_class"] = vllm.lora.models.LoRAModel is lora_model.LoRAModel
    out["verl_holds_lora_class"] = verl_vllm_utils.LoRAModel is lora_model.LoRAModel
    out["alias_in_sys_modules"] = sys.modules.get("vllm.lora.models") is vllm.lora.models
    out["same_parser"] = vllm.utils.FlexibleArgumentParser is argparse_utils.FlexibleArgumentParser
    out["async_server_tcp_uri"] = sys.modules[ASYNC].get_tcp_uri is network_utils.get_tcp_uri
    out["states"] = {p: REGISTRY.patches[p].outcome.state for p in REGISTRY.patches
                     if p.startswith("verl_vllm_compat.")}
    return out


def _tiny_model(workdir: str) -> str:
    from ascend_rl_plugins.devtools import tiny_qwen3
    return tiny_qwen3.build(os.path.join(workdir, "tiny-qwen3"))  # this stack's transformers writes the tokenizer


def _rollout_config(**over):
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    base = dict(name="vllm", mode="sync", tensor_model_parallel_size=1, prompt_length=PROMPT_LEN,
                response_length=RESPONSE_LEN, dtype="float32", free_cache_engine=False, enforce_eager=True,
                max_num_seqs=8, max_num_batched_tokens=512, load_format="dummy", ignore_eos=True,
                engine_kwargs={"vllm": {}})
    base.update(over)
    return omega_conf_to_dataclass(OmegaConf.create(base), RolloutConfig)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", mesh_shape=(1, 1, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])


def _prompts():
    import torch

    from verl import DataProto
    ids = torch.tensor([[0] * (PROMPT_LEN - len(p)) + p for p in PROMPTS])  # left padded, pad id 0
    mask = (ids != 0).long()
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               meta_info={"eos_token_id": 0, "do_sample": False})


class DraftCounter:
    """Draft tokens the engine's scheduler hands to the model, per generate call."""

    def __init__(self, scheduler):
        self.total = 0
        schedule = scheduler.schedule

        def counting(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self.total += sum(len(v) for v in out.scheduled_spec_decode_tokens.values())
            return out
        scheduler.schedule = counting

    def take(self) -> int:
        n, self.total = self.total, 0
        return n


def _generate(rollout, counter) -> dict:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out = rollout.generate_sequences(_prompts())
    return {"drafted": counter.take(), "bar": BAR in err.getvalue(),
            "bar_rank": "rollout rank 0" in err.getvalue(), "shape": list(out.batch["responses"].shape)}


def engine(ctx: dict) -> dict:
    import torch.distributed as dist

    from verl.workers.config import HFModelConfig
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMRollout
    path = _tiny_model(ctx["workdir"])
    model = omega_conf_to_dataclass({"path": path}, HFModelConfig)
    rollout = vLLMRollout(_rollout_config(engine_kwargs={"vllm": {"speculative_config": dict(SPEC)}}), model, _mesh())
    ctx["rollout"] = rollout
    llm = rollout.inference_engine
    core = llm.llm_engine.engine_core.engine_core
    counter = DraftCounter(core.scheduler)
    out = {"logprobs": rollout.sampling_params.logprobs,
           "spec_model": getattr(llm.llm_engine.vllm_config.speculative_config, "model", None)}
    out["patched"] = _generate(rollout, counter)
    rollout.sampling_params.logprobs = 0  # what stock verl 0.6.1 asks for
    out["stock_logprobs"] = _generate(rollout, counter)
    rollout.sampling_params.logprobs = None

    from vllm import SamplingParams
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # an LLM.generate call outside a rollout call
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    out["outside_rollout_bar"] = BAR in err.getvalue()
    real_rank = dist.get_rank
    dist.get_rank = lambda *a, **k: 1  # this process plays global rank 1 (ASCEND_RL_..._RANKS=first)
    try:
        out["rank1"] = _generate(rollout, counter)
    finally:
        dist.get_rank = real_rank
    return out


class RecordingLLM:
    """Stands where verl's rollout module builds ``vllm.LLM``: records the keyword arguments."""

    calls: list = []

    def __init__(self, **kwargs):
        RecordingLLM.calls.append(kwargs)


def _set_flags(**values) -> None:
    from ascend_rl_plugins import flags
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    flags.reset_cache()


def _built_kwargs(config, model) -> dict:
    from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMRollout
    RecordingLLM.calls.clear()
    rollout = vLLMRollout(config, model, _mesh())
    kwargs = RecordingLLM.calls[-1]
    return {k: kwargs.get(k) for k in ("compilation_config", "additional_config", "speculative_config",
                                       "enforce_eager")} | {"logprobs": rollout.sampling_params.logprobs}


def _refused(fn) -> str | None:
    from ascend_rl_plugins.features.rollout_engine_options.options import EngineOptionsError
    try:
        fn()
    except EngineOptionsError as exc:
        return str(exc)
    return None


def options(ctx: dict) -> dict:
    import importlib

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    spmd = importlib.import_module(SPMD)
    model = omega_conf_to_dataclass({"path": os.path.join(ctx["workdir"], "tiny-qwen3")}, HFModelConfig)
    real_llm, spmd.LLM = spmd.LLM, RecordingLLM
    out = {}
    try:
        graph = dict(enforce_eager=False, cudagraph_capture_sizes=[1, 2, 4])
        out["capture_sizes"] = _built_kwargs(_rollout_config(**graph), model)
        out["capture_sizes_with_mode"] = _built_kwargs(_rollout_config(
            **graph, engine_kwargs={"vllm": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}}), model)
        out["speculative"] = _built_kwargs(_rollout_config(engine_kwargs={"vllm": {"speculative_config": SPEC}}), model)
        _set_flags(ASCEND_RL_ROLLOUT_ENGINE_OPTIONS_NPUGRAPH_EX="1", NPUGRAPH_EX_ENABLE_STATIC_KERNEL="True")
        out["npugraph_ex"] = _built_kwargs(_rollout_config(enforce_eager=False), model)
        out["npugraph_ex_eager_refused"] = _refused(lambda: _built_kwargs(_rollout_config(), model))
        _set_flags(ASCEND_RL_ROLLOUT_ENGINE_OPTIONS_NPUGRAPH_EX=None, NPUGRAPH_EX_ENABLE_STATIC_KERNEL=None)
        out["bad_method_refused_at_build"] = _refused(lambda: _built_kwargs(_rollout_config(
            engine_kwargs={"vllm": {"speculative_config": {"method": "samm", "num_speculative_tokens": 3}}}), model))
        out["llm_calls_when_refused"] = len(RecordingLLM.calls)
    finally:
        spmd.LLM = real_llm
    out["validate_config"] = _validate_trainer_configs()
    return out


def _trainer_config(*extra: str):
    import verl
    from hydra import compose, initialize_config_dir
    overrides = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=sync",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1", "trainer.n_gpus_per_node=1",
                 "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", *extra]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose(config_name="ppo_megatron_trainer", overrides=overrides)


def _validate_trainer_configs() -> dict:
    from verl.utils.config import validate_config
    spec = "+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config"
    good = _trainer_config(f"{spec}.method=sam", f"{spec}.num_speculative_tokens=3")
    validate_config(good, use_reference_policy=False, use_critic=False)
    bad = _trainer_config(f"{spec}.method=sam", f"{spec}.num_speculative_tokens=3",
                          "actor_rollout_ref.rollout.calculate_log_probs=True")
    return {"good_passed": True,
            "bad_refused": _refused(lambda: validate_config(bad, use_reference_policy=False, use_critic=False))}


def revert(ctx: dict) -> dict:
    from ascend_rl_plugins.patching.core import REGISTRY
    import vllm.lora
    REGISTRY.revert(REGISTRY.patches[LORA_PATCH])
    return {"alias_gone": "vllm.lora.models" not in sys.modules and not hasattr(vllm.lora, "models"),
            "reimport_error": _try_import("vllm.lora.models")}


def run(workdir: str) -> dict:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    ctx, results = {"workdir": workdir}, {}
    for stage in (compat, engine, options, revert):
        try:
            results[stage.__name__] = stage(ctx)
        except BaseException as exc:  # noqa: BLE001 - reported to the stage's tests
            results[stage.__name__] = {"error": _error(exc), "traceback": traceback.format_exc()}
    return results
