"""rollout_torch_compile in a fresh process: the real verl 0.6.1 ``_build_rollout`` under the
MindSpeed double (run by test_rollout_torch_compile.py through ``run_scenario``).

Real: verl's ``ActorRolloutRefWorker._build_rollout`` (config parsing, device mesh over a
1-process gloo group, dispatch registration, RNG bookkeeping, rollout class lookup in verl's
``_ROLLOUT_REGISTRY``), torch. Double: MindSpeed (tests/doubles/mindspeed_double, imported by
verl's own ``from mindspeed.megatron_adaptor import repatch``). Test pieces: the rollout class
(:class:`CompileProbeRollout`, registered in verl's rollout registry, records which
``torch.compile`` it sees while being built) and the worker's device-RNG calls: verl asks
``get_torch_device()`` for ``get_rng_state``/``manual_seed``/``set_rng_state``, which
``torch.cpu`` lacks, so the module's ``get_torch_device`` answers :class:`CpuRngDevice`.
"""

from __future__ import annotations

import os
import sys
import types

from tests.features.rollout_torch_compile.megatron_worker import MINDSPEED_DOUBLE, make_worker

PROBE = ("compile_probe", "sync")


class CpuRngDevice:
    """The RNG calls verl's worker makes on its device module, served by torch's CPU RNG."""

    @staticmethod
    def get_rng_state():
        import torch
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state):
        import torch
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        import torch
        torch.manual_seed(seed)


class CompileProbeRollout:
    """Stands where vLLMRollout is built: records ``torch.compile`` and a module copy of it
    (as MindSpeed rebinds them) at construction."""

    seen: dict = {}

    def __init__(self, config, model_config, device_mesh):
        import torch
        CompileProbeRollout.seen = {"torch.compile": torch.compile,
                                    "copy": sys.modules["compile_copy_holder"].compile}


def _tiny_config_dir(workdir: str) -> str:
    from transformers import Qwen3Config
    path = os.path.join(workdir, "tiny-config")
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, vocab_size=256,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return path


def build_rollout(workdir: str, with_mindspeed: bool) -> dict:
    import torch
    import torch.distributed as dist

    real = torch.compile
    if with_mindspeed:
        sys.path.insert(0, MINDSPEED_DOUBLE)
    dist.init_process_group("gloo")
    import ascend_rl_plugins
    ascend_rl_plugins.activate()
    import verl.workers.megatron_workers as workers  # imports mindspeed.megatron_adaptor when present
    from verl.workers.rollout import base

    holder = types.ModuleType("compile_copy_holder")  # a module holding a copy, as MindSpeed rebinds
    holder.compile = torch.compile
    sys.modules[holder.__name__] = holder
    installed = torch.compile
    base._ROLLOUT_REGISTRY[PROBE] = f"{__name__}.CompileProbeRollout"
    workers.get_torch_device = lambda: CpuRngDevice
    worker = make_worker({"rollout": {"_target_": "verl.workers.config.RolloutConfig", "name": PROBE[0],
                                      "mode": PROBE[1], "tensor_model_parallel_size": 1,
                                      "data_parallel_size": 1, "pipeline_model_parallel_size": 1},
                          "model": {"path": _tiny_config_dir(workdir), "load_tokenizer": False}},
                         _is_actor=False)
    worker._build_rollout()
    from ascend_rl_plugins.patching.core import REGISTRY
    seen = CompileProbeRollout.seen
    dist.destroy_process_group()
    return {"mindspeed_loaded": "mindspeed.patch_utils" in sys.modules,
            "replaced_at_start": installed is not real,
            "real_during_build": seen["torch.compile"] is real,
            "copy_real_during_build": seen["copy"] is real,
            "replacement_back_after": torch.compile is installed,
            "copy_back_after": holder.compile is installed,
            "patch_state": REGISTRY.patches["rollout_torch_compile.build_rollout"].outcome.state}
