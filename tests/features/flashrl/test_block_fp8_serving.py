"""Block FP8 (128x128, slime's FP8 rollout format) in flashrl: where it is served, where refused.

* vLLM CPU: ``block_fp8_support()`` asks vLLM's own ``CPUFp8BlockScaledMMKernel.is_supported``
  (0.23: AMX needed; checked on this machine and with AMX answered "no"); vLLM 0.13 has no
  such kernel. An ``fn: fp8_block`` config is refused at engine start where vLLM does not serve
  block FP8 (real engines); where it does (0.23 with AMX) the engine starts and flashrl checks the
  served layers: a config naming a BF16 model is refused once the engine has loaded it (the
  reload itself: test_block_fp8_reload.py).
* vLLM-Ascend (cannot run here): 0.13 has no fp8 method; 0.23's keeps power-of-two block scales
  only. ``flashrl.ascend_block_fp8_refusal`` (before ``AscendFp8Config.from_config``) refuses a
  generic block-FP8 config when a flashrl quantized rollout is active: run against a double whose
  signature is compared with the real 0.23 source.
* verl 0.9.1's own FP8 rollout (``rollout.quantization=fp8``) plus a flashrl quantized config:
  refused at engine start naming both (real engine start on both stacks).
"""

import ast

import pytest

from tests.support.child import ENGINE_ENV, run_scenario
from tests.support.stacks import running_stack, source

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(running_stack() is None,
                                reason="needs the recipe (vLLM 0.13) or current (vLLM 0.23) stack")
SCENARIO = "tests.features.flashrl.w4a16_engine_scenario"
# vLLM-Ascend 0.23's fp8 config, unpacked by .ci/stack.sh under $ASCEND_RL_CACHE (stacks.source)
ASCEND_FP8_CONFIG = ("vllm_ascend", "vllm_ascend", "quantization", "fp8_config.py")
BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128]}


def _config(tmp_path, fn: str, model: str) -> str:
    from ascend_rl_plugins.features.flashrl import config
    path = str(tmp_path / f"flashrl_{fn}.yaml")
    config.write_config(path, config.RolloutConfig(fn=fn, model=model), append=False)
    return path


@pytest.fixture
def flashrl_env(monkeypatch):
    """Set ASCEND_RL_FLASHRL in this process (flag cache and the selected config reset)."""
    from ascend_rl_plugins import flags
    from ascend_rl_plugins.features import flashrl

    def set_value(value):
        if value is None:
            monkeypatch.delenv("ASCEND_RL_FLASHRL", raising=False)
        else:
            monkeypatch.setenv("ASCEND_RL_FLASHRL", value)
        # set, then delete: monkeypatch then restores the variable's state from before the
        # test, even though the engine-start check writes it again (a leaked value would reach
        # every child process this pytest process starts later)
        monkeypatch.setenv(flashrl.INDEX_ENV, "0")
        monkeypatch.delenv(flashrl.INDEX_ENV)
        flashrl._selected.clear()
        flags.reset_cache()
    yield set_value
    flashrl._selected.clear()
    flags.reset_cache()


def test_cpu_block_fp8_support_is_what_vllm_says(monkeypatch):
    from ascend_rl_plugins.features.flashrl.fp8_support import block_fp8_support
    ok, why = block_fp8_support()
    if running_stack() == "recipe":
        assert not ok and "no CPU block-FP8 kernel" in why, why
        return
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    assert ok == CPUFp8BlockScaledMMKernel.is_supported()[0], why
    if ok:
        assert "AMX" in why
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    ok, why = block_fp8_support()
    assert not ok and "requires AMX" in why, why


def test_vllm_ascend_block_fp8_and_w4a16_support_statements(monkeypatch):
    """On an NPU (vLLM-Ascend present, device npu: doubled) block FP8 and W4A16 reload are refused
    with the reason; the engine-start error names the alternatives."""
    from ascend_rl_plugins.features import flashrl
    from ascend_rl_plugins.features.flashrl import config, fp8_support
    for va, part in (("0.13.0", "no fp8 quantization method"), ("0.23.0.post1", "power-of-two")):
        monkeypatch.setattr(fp8_support, "_on_npu", lambda va=va: (True, va))
        ok, why = fp8_support.block_fp8_support()
        assert not ok and part in why, why
        ok, why = fp8_support.w4a16_support()
        assert not ok and "only for fused-MoE experts" in why, why
        with pytest.raises(config.ConfigError) as err:
            flashrl._check_low_precision(config.RolloutConfig(fn="fp8_block", model="/x"))
        for want in (part, "fp8_channel", "int8", "fn='fp8_block'"):
            assert want in str(err.value), (want, str(err.value))


def test_ascend_refusal_double_mirrors_the_real_signature():
    from . import ascend_fp8_config_double as d
    path = source("current", *ASCEND_FP8_CONFIG)  # skips, naming the path, when absent
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AscendFp8Config")
    real = {f.name: [a.arg for a in f.args.args] for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert real["from_config"] == ["cls", "config"]
    assert real["__init__"] == ["self", "ignore", "quant_format", "config"]
    import inspect
    assert list(inspect.signature(d.AscendFp8ConfigDouble.from_config.__func__).parameters) == ["cls", "config"]
    assert list(inspect.signature(d.AscendFp8ConfigDouble.__init__).parameters) == \
        ["self", "ignore", "quant_format", "config"]
    decos = [ast.unparse(x) for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "from_config"
             for x in f.decorator_list]
    assert decos == ["classmethod"]


def test_ascend_refusal_patch_on_the_double(tmp_path, flashrl_env, tiny_model_path):
    from ascend_rl_plugins.features.flashrl.config import ConfigError
    from ascend_rl_plugins.patching import REGISTRY

    from .ascend_fp8_config_double import AscendFp8ConfigDouble
    patch = REGISTRY.patches["flashrl.ascend_block_fp8_refusal"]
    assert patch.target == "vllm_ascend.quantization.fp8_config:AscendFp8Config.from_config"
    assert patch.kind == "before" and patch.dist == "vllm-ascend"

    def parse(config):  # what the framework's `before` does: hook(cls, args, kwargs), then the original
        patch.impl(AscendFp8ConfigDouble, (config,), {})
        return AscendFp8ConfigDouble.from_config(config)

    flashrl_env(_config(tmp_path, "int8", tiny_model_path))
    with pytest.raises(ConfigError) as err:
        parse(dict(BLOCK_CONFIG))
    for part in ("ASCEND_RL_FLASHRL", "weight_block_size=[128, 128]", "MXFP8", "fp8_channel", "int8"):
        assert part in str(err.value), (part, str(err.value))
    assert parse(dict(BLOCK_CONFIG, scale_fmt="ue8m0")).quant_description["scale_fmt"] == "ue8m0"
    assert parse({"quant_method": "fp8"}).quant_format is None  # no blocks: vLLM-Ascend's own business
    flashrl_env("bf16")
    assert parse(dict(BLOCK_CONFIG)).quant_description["weight_block_size"] == [128, 128]
    flashrl_env(None)
    assert parse(dict(BLOCK_CONFIG)).ignore == []


def test_engine_start_refuses_fp8_block_and_flashrl_stacked_on_verl_fp8(tmp_path, tiny_model_path):
    cfg_block = _config(tmp_path, "fp8_block", tiny_model_path)
    cfg_int8 = _config(tmp_path, "int8", tiny_model_path)
    env = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0")
    block_err, verl_err = run_scenario(SCENARIO, "start_errors", tiny_model_path, [cfg_block, cfg_int8],
                                       [{}, {"VERL_VLLM_FP8_QUANT_ENABLED": "1"}], env=env, timeout=600)
    assert block_err and block_err.startswith("ConfigError"), block_err
    from ascend_rl_plugins.features.flashrl.fp8_support import _amx
    served = running_stack() == "current" and _amx()
    for part in ("ASCEND_RL_FLASHRL", "fn='fp8_block'") + (() if served else ("fp8_channel", "int8")):
        assert part in block_err, (part, block_err)
    if running_stack() == "recipe":
        assert "no CPU block-FP8 kernel" in block_err, block_err
    elif served:  # allowed at engine start; the BF16 model it names has no block-FP8 layer
        assert "loaded no block-FP8 linear layer" in block_err and "--fn fp8-block" in block_err, block_err
    else:
        assert "requires AMX" in block_err, block_err
    assert verl_err and verl_err.startswith("ConfigError"), verl_err
    for part in ("ASCEND_RL_FLASHRL", "fn='int8'", "VERL_VLLM_FP8_QUANT_ENABLED=1", "rollout.quantization=fp8"):
        assert part in verl_err, (part, verl_err)
