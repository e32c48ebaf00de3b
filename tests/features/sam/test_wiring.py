"""Config rewrite, proposer selection (vLLM, and vLLM-Ascend against a runner double),
flags, and static conformance of the SAM patches."""

from __future__ import annotations

import pytest

from helpers import run_python, stack_name

from ascend_rl_plugins.features.sam.vllm_proposer import rewrite_speculative_dict


def test_rewrite_speculative_dict():
    assert rewrite_speculative_dict({"method": "sam", "num_speculative_tokens": 3}) == \
        {"method": "ngram", "model": "sam", "num_speculative_tokens": 3}
    same = {"method": "ngram", "num_speculative_tokens": 3}
    assert rewrite_speculative_dict(same) is same
    assert rewrite_speculative_dict(None) is None
    with pytest.raises(ValueError, match="method='sam' takes no draft model"):
        rewrite_speculative_dict({"method": "sam", "model": "org/draft"})


def test_flags_validate():
    code = r'''
import os
os.environ["ASCEND_RL_SAM_MIN_MATCH"] = "0"
from ascend_rl_plugins import flags, plugin
try:
    plugin.activate("test")
    emit("no error")
except flags.FlagError as e:
    emit(str(e))
'''
    msg = run_python(code, env={"ASCEND_RL_AUTOLOAD": "0"})
    assert "ASCEND_RL_SAM_MIN_MATCH" in msg and "below the minimum" in msg
    code = r'''
from ascend_rl_plugins import plugin
from ascend_rl_plugins.features import sam
plugin.activate("test")
emit([sam.BATCH_THRESHOLD.value, sam.GROUP.value])
'''
    assert run_python(code, env={"ASCEND_RL_AUTOLOAD": "0",
                                 "VLLM_SPECULATIVE_BATCH_SIZE_THRE": "8"}) == [8, True]


def test_proposer_compiles_the_step_kernel_when_built():
    """The numba kernel is compiled (seconds on a cold cache) when an engine builds its
    proposer, not in the first decode step: a fresh process has no compiled entry point until
    a SAM proposer is constructed, and has it right after."""
    code = r'''
from types import SimpleNamespace
from ascend_rl_plugins.features.sam import automaton
from ascend_rl_plugins.features.sam.vllm_proposer import sam_proposer_class

class PristineNgramProposer:  # stands in for the runner's NgramProposer base class
    pass

cfg = SimpleNamespace(
    speculative_config=SimpleNamespace(model="sam", num_speculative_tokens=3,
                                       prompt_lookup_min=None, prompt_lookup_max=None),
    model_config=SimpleNamespace(max_model_len=256))
before = automaton._ENTRY[0] is not None
proposer = sam_proposer_class(PristineNgramProposer)(cfg)
emit({"before": before, "after": automaton._ENTRY[0] is not None, "k": proposer.sam.k})
'''
    out = run_python(code, env={"ASCEND_RL_AUTOLOAD": "0"})
    assert out == {"before": False, "after": True, "k": 3}


@pytest.mark.skipif(stack_name() is None, reason="needs vLLM")
def test_vllm_config_accepts_sam_and_selects_the_sam_proposer():
    """Real vLLM config objects: EngineArgs -> SpeculativeConfig with method 'sam' passes vLLM's
    validation as ngram/sam, and the (patched) NgramProposer returns the SAM proposer."""
    code = r'''
from ascend_rl_plugins import plugin
plugin.activate("test")
from vllm.engine.arg_utils import EngineArgs
from ascend_rl_plugins.devtools import tiny_qwen3
args = EngineArgs(model=tiny_qwen3.cached(), max_model_len=256, enforce_eager=True,
                  speculative_config={"method": "sam", "num_speculative_tokens": 4})
cfg = args.create_engine_config()
spec = cfg.speculative_config
from vllm.v1.spec_decode import ngram_proposer
from vllm.v1.worker import gpu_model_runner
# 0.13's runner calls its from-imported copy; 0.23's imports the module attribute at use
cls = getattr(gpu_model_runner, "NgramProposer", ngram_proposer.NgramProposer)
p = cls(cfg)
emit({"method": spec.method, "model": spec.model, "k": spec.num_speculative_tokens,
      "type": type(p).__name__, "isinstance": isinstance(p, cls),
      "same_object": cls is ngram_proposer.NgramProposer, "k_drafter": p.sam.k})
'''
    out = run_python(code, env={"ASCEND_RL_AUTOLOAD": "0", "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out == {"method": "ngram", "model": "sam", "k": 4, "type": "SamNgramProposer",
                   "isinstance": True, "same_object": True, "k_drafter": 4}


ASCEND_DOUBLE = r'''
import sys, types
import numpy as np
from ascend_rl_plugins import plugin
plugin.activate("test")

# --- doubles of the NPU-only vLLM-Ascend modules (signatures as read in va13 / va23) ----------
FLAVOUR = "{flavour}"
from vllm.v1.spec_decode.ngram_proposer import NgramProposer as VllmNgram
ngram_mod_double = types.ModuleType("vllm_ascend.spec_decode.ngram_proposer")
if FLAVOUR == "0.13":
    iface_double = types.ModuleType("vllm_ascend.spec_decode.interface")
    class SpecDcodeType_double:
        NGRAM = 0
    iface_double.SpecDcodeType = SpecDcodeType_double
    sys.modules["vllm_ascend.spec_decode.interface"] = iface_double
    class NgramProposer_double(VllmNgram):        # va13: (vllm_config, device, runner)
        def __init__(self, vllm_config, device, runner):
            raise AssertionError("base constructor must not run")
    ngram_mod_double.NgramProposer = NgramProposer_double
else:
    class AscendNgramProposer_double(VllmNgram):  # va23: (vllm_config, runner)
        def __init__(self, vllm_config, runner):
            raise AssertionError("base constructor must not run")
    ngram_mod_double.AscendNgramProposer = AscendNgramProposer_double
for name in ("vllm_ascend", "vllm_ascend.spec_decode"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["vllm_ascend.spec_decode.ngram_proposer"] = ngram_mod_double

from ascend_rl_plugins.features import sam
wrapper = sam._ascend_get_drafter

class InputBatch_double:
    def __init__(self):
        self.req_ids = ["a", "b"]
        self.num_tokens_no_spec = np.array([8, 5])
        self.num_prompt_tokens = np.array([3, 3])
        self.token_ids_cpu = np.zeros((2, 64), np.int32)
        self.token_ids_cpu[0, :8] = [1, 2, 3, 4, 1, 2, 3, 4]
        self.token_ids_cpu[1, :5] = [7, 7, 7, 7, 7]
        self.spec_decode_unsupported_reqs = set()

class NPUModelRunner_double:
    def __init__(self, model):
        spec = types.SimpleNamespace(model=model, method="ngram", num_speculative_tokens=3,
                                     prompt_lookup_min=5, prompt_lookup_max=5)
        self.vllm_config = types.SimpleNamespace(speculative_config=spec,
                                                 model_config=types.SimpleNamespace(max_model_len=64))
        self.device = "npu:0"
        self.input_batch = InputBatch_double()

def original_get_drafter():  # wrapt passes the bound original
    return "original ngram drafter"

out = {{}}
runner = NPUModelRunner_double("sam")
drafter = wrapper(original_get_drafter, runner, (), {{}})
out["type"] = type(drafter).__name__
out["mro"] = [c.__name__ for c in type(drafter).__mro__]
if FLAVOUR == "0.13":
    out["drafts"] = drafter.generate_token_ids([[4], [7]], None, None)
else:
    out["drafts"] = drafter.propose([[4], [7]], None, None, slot_mappings=None)
    out["drafts_other_vllm"] = drafter.propose(3, [[4], [7]])
out["plain"] = wrapper(original_get_drafter, NPUModelRunner_double("ngram"), (), {{}})
emit(out)
'''


@pytest.mark.skipif(stack_name() is None, reason="needs vLLM")
@pytest.mark.parametrize("flavour", ["0.13", "0.23"])
def test_ascend_get_drafter_selects_sam(flavour):
    """Selection logic against a double of NPUModelRunner and of the Ascend n-gram proposer
    module (vllm_ascend cannot be imported without torch_npu): real SAM drafter code runs."""
    out = run_python(ASCEND_DOUBLE.format(flavour=flavour),
                     env={"ASCEND_RL_AUTOLOAD": "0", "VLLM_LOGGING_LEVEL": "ERROR"})
    base = "NgramProposer_double" if flavour == "0.13" else "AscendNgramProposer_double"
    assert out["type"] == "AscendSamProposer" and base in out["mro"]
    assert out["drafts"] == [[1, 2, 3], [7, 7, 7]]
    assert out["plain"] == "original ngram drafter"


def test_patch_targets_resolve_statically():
    """Every SAM patch target exists in the sources of each stack whose version is in range."""
    import os
    from ascend_rl_plugins.features import sam
    from ascend_rl_plugins.patching.static import resolve_static
    checked = set()
    for stack in ("recipe", "current"):
        src = f"/root/.cache/ascend-rl/stacks/{stack}/src"
        if not os.path.isdir(src):
            pytest.skip("stack sources not present")
        roots = [os.path.join(src, d) for d in sorted(os.listdir(src))]
        for p in sam.FEATURE.patches:
            state, version, why = p.version_state(roots=roots)
            if state != "ok":
                continue
            res = resolve_static(p.target, roots)
            assert res.found, (stack, p.target, res.why)
            if p.params and res.params is not None:
                assert set(p.params) <= set(res.params), (stack, p.target, res.params)
            checked.add((stack, p.name))
    names = {n for _, n in checked}
    assert "sam.ascend_select_sam_proposer" in names  # the vLLM-Ascend target, both va versions
    assert ("recipe", "cpu_spec_decode.cpu_runner_allows_spec_decode") in checked
    assert ("current", "cpu_spec_decode.recovered_tokens_fp64_gumbel") in checked
