"""Child-process scenarios of tests/features/sam/test_wiring.py (each activates ascend-rl or
installs doubles, so it runs in a fresh interpreter)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace


def _config(model="sam", k=3, max_model_len=256):
    """The parts of a VllmConfig a SAM proposer reads."""
    spec = SimpleNamespace(model=model, method="ngram", num_speculative_tokens=k,
                           prompt_lookup_min=None, prompt_lookup_max=None)
    return SimpleNamespace(speculative_config=spec,
                           model_config=SimpleNamespace(max_model_len=max_model_len))


def _settings(drafter) -> dict:
    return {"k": drafter.k, "group": drafter.group, "min_match": drafter.min_match,
            "adaptive": drafter.adaptive, "recent_len": drafter.recent_len,
            "batch_threshold": drafter.batch_threshold, "max_model_len": drafter.max_model_len}


def kernel_compiled_when_proposer_built() -> dict:
    """Is the decode-step kernel compiled before / right after a SAM proposer is built?"""
    from ascend_rl_plugins.features.sam import automaton
    from ascend_rl_plugins.features.sam.vllm_proposer import sam_proposer_class

    class PristineNgramProposer:  # stands in for the runner's NgramProposer base class
        pass

    before = automaton._ENTRY[1] is not None
    proposer = sam_proposer_class(PristineNgramProposer)(_config())
    return {"before": before, "after": automaton._ENTRY[1] is not None, "k": proposer.sam.k}


def proposer_built_on_a_cold_numba_cache() -> dict:
    """Build a SAM proposer where numba's cache is empty (the environment points
    NUMBA_CACHE_DIR at a fresh directory): what the ascend-rl logger said meanwhile."""
    import logging

    from ascend_rl_plugins.features.sam.vllm_proposer import sam_proposer_class

    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append((record.levelname, record.getMessage()))

    logger = logging.getLogger("ascend_rl_plugins")
    logger.addHandler(Keep())
    logger.setLevel(logging.WARNING)  # the default ASCEND_RL_LOG_LEVEL

    class PristineNgramProposer:  # stands in for the runner's NgramProposer base class
        pass

    sam_proposer_class(PristineNgramProposer)(_config())
    return {"said": said}


# --- vLLM-Ascend: doubles of the NPU-only modules (signatures as read in 0.13 / 0.23) ---------------

def _install_ascend_doubles(flavour: str) -> None:
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer as VllmNgram
    ngram_mod_double = types.ModuleType("vllm_ascend.spec_decode.ngram_proposer")
    if flavour == "0.13":
        iface_double = types.ModuleType("vllm_ascend.spec_decode.interface")

        class SpecDcodeType_double:
            NGRAM = 0
        iface_double.SpecDcodeType = SpecDcodeType_double
        sys.modules["vllm_ascend.spec_decode.interface"] = iface_double

        class NgramProposer_double(VllmNgram):  # 0.13: (vllm_config, device, runner)
            def __init__(self, vllm_config, device, runner):
                raise AssertionError("base constructor must not run")
        ngram_mod_double.NgramProposer = NgramProposer_double
    else:
        class AscendNgramProposer_double(VllmNgram):  # 0.23: (vllm_config, runner)
            def __init__(self, vllm_config, runner):
                raise AssertionError("base constructor must not run")
        ngram_mod_double.AscendNgramProposer = AscendNgramProposer_double
    for name in ("vllm_ascend", "vllm_ascend.spec_decode"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["vllm_ascend.spec_decode.ngram_proposer"] = ngram_mod_double  # replaces the other flavour's


class InputBatch_double:
    def __init__(self):
        import numpy as np
        self.req_ids = ["a", "b"]
        self.num_tokens_no_spec = np.array([8, 5], np.int32)
        self.num_prompt_tokens = np.array([3, 3], np.int32)
        self.token_ids_cpu = np.zeros((2, 64), np.int32)
        self.token_ids_cpu[0, :8] = [1, 2, 3, 4, 1, 2, 3, 4]
        self.token_ids_cpu[1, :5] = [7, 7, 7, 7, 7]
        self.spec_decode_unsupported_reqs = set()


class NPUModelRunner_double:
    def __init__(self, model):
        self.vllm_config = _config(model, max_model_len=64)
        self.device = "npu:0"
        self.input_batch = InputBatch_double()


def ascend_get_drafter() -> dict:
    """``sam.ascend_select_sam_proposer`` (looked up by its public name) against a double of
    NPUModelRunner and of the Ascend n-gram proposer module of each vLLM-Ascend version; real
    SAM drafter code runs."""
    from ascend_rl_plugins import plugin
    plugin.activate("test")
    return {flavour: _ascend_get_drafter(flavour) for flavour in ("0.13", "0.23")}


def _ascend_get_drafter(flavour: str) -> dict:
    _install_ascend_doubles(flavour)
    from ascend_rl_plugins.patching.core import REGISTRY
    wrapper = REGISTRY.patches["sam.ascend_select_sam_proposer"].impl

    def original_get_drafter():  # wrapt passes the bound original
        return "original ngram drafter"

    runner = NPUModelRunner_double("sam")
    drafter = wrapper(original_get_drafter, runner, (), {})
    out = {"type": type(drafter).__name__, "mro": [c.__name__ for c in type(drafter).__mro__],
           "settings": _settings(drafter.sam)}
    if flavour == "0.13":
        out["drafts"] = drafter.generate_token_ids([[4], [7]], None, None)
    else:
        out["drafts"] = drafter.propose([[4], [7]], None, None, slot_mappings=None)
        runner.input_batch.num_tokens_no_spec[:] = [9, 6]
        runner.input_batch.token_ids_cpu[0, 8] = 1
        runner.input_batch.token_ids_cpu[1, 5] = 7
        out["drafts_other_vllm"] = drafter.propose(3, [[1], [7]])
    out["plain"] = wrapper(original_get_drafter, NPUModelRunner_double("ngram"), (), {})
    return out



# --- history: only requests that finished by themselves (real vLLM SamplingParams) ------------------

@dataclass
class KeptResponses:
    """After the steps of :func:`history_keeps_only_finished_requests`: the responses the
    proposer's history kept per request's prompt (oldest first), and the stop conditions read
    from each request's sampling parameters."""
    kept: dict[str, list[list[int]]]
    stop_token_ids: dict[str, list[int]]
    max_tokens: dict[str, int]


class _RunnerWithRequests:
    """The runner parts the proposer reads: ``input_batch``, and ``requests`` (request id ->
    state holding ``sampling_params``, as vLLM's ``CachedRequestState``); ``drafter`` for the
    ``propose_draft_token_ids`` hook."""

    def __init__(self, drafter, params: dict):
        self.drafter = drafter
        self.requests = {r: SimpleNamespace(sampling_params=p) for r, p in params.items()}
        self.input_batch = None

    def step(self, rows: dict, prompt_len: int) -> None:
        """The batch of a step: ``rows`` (request id -> its tokens so far), in that order. As
        vLLM's runner does, the state of a request no longer in the batch is dropped first."""
        import numpy as np
        for r in [r for r in self.requests if r not in rows]:
            del self.requests[r]
        batch = SimpleNamespace(req_ids=list(rows), spec_decode_unsupported_reqs=set())
        batch.token_ids_cpu = np.zeros((len(rows), 64), np.int32)
        for i, tokens in enumerate(rows.values()):
            batch.token_ids_cpu[i, : len(tokens)] = tokens
        batch.num_tokens_no_spec = np.array([len(t) for t in rows.values()], np.int32)
        batch.num_prompt_tokens = np.full(len(rows), prompt_len, np.int32)
        self.input_batch = batch


def history_keeps_only_finished_requests() -> KeptResponses:
    """The SAM proposer in vLLM 0.23's calling convention, its runner bound by the
    ``sam.bind_input_batch`` hook, three steps. A ends at its EOS (the runner holds one token
    past it: the rest of an accepted draft), B (``ignore_eos``) at its ``max_tokens``; C leaves
    the batch before its end (aborted, preempted or moved); D still runs. Sampling parameters
    are vLLM's, completed as its input processor does (``update_from_generation_config`` with
    the model's EOS)."""
    import numpy as np
    from vllm.sampling_params import SamplingParams

    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.features.sam.vllm_proposer import (sam_proposer_class,
                                                               stop_conditions_of_params)
    from ascend_rl_plugins.patching.core import REGISTRY

    plugin.activate("test")
    eos, prompt_len = 2, 4

    def params(**kw):
        p = SamplingParams(**kw)
        p.update_from_generation_config({}, eos)
        return p

    class PristineNgramProposer:  # stands in for the runner's NgramProposer base class
        pass

    proposer = sam_proposer_class(PristineNgramProposer)(_config(k=2, max_model_len=64))
    requests = {"A": params(max_tokens=20), "B": params(max_tokens=3, ignore_eos=True),
                "C": params(max_tokens=20), "D": params(max_tokens=20, stop_token_ids=[9])}
    runner = _RunnerWithRequests(proposer, requests)
    prompts = {r: [100 + i, 5, 6, 7] for i, r in enumerate(requests)}
    outputs = [{"A": [40], "B": [50], "C": [60], "D": [70]},
               {"A": [40, 41, eos, 43], "B": [50, eos, 52, 53], "C": [60, 61], "D": [70, 71]},
               {"D": [70, 71, 72]}]
    hook = REGISTRY.patches["sam.bind_input_batch"].impl
    for out in outputs:
        runner.step({r: prompts[r] + tokens for r, tokens in out.items()}, prompt_len)
        hook(runner, (), {})
        batch = runner.input_batch
        proposer.propose([[1]] * len(out), batch.num_tokens_no_spec, batch.token_ids_cpu,
                         slot_mappings=None)
    history = proposer.sam.history
    conditions = {r: stop_conditions_of_params(p) for r, p in requests.items()}
    return KeptResponses(
        kept={r: [x.tolist() for x in history.responses(np.array(p, np.int32).tobytes())]
              for r, p in prompts.items()},
        stop_token_ids={r: sorted(c.stop_token_ids) for r, c in conditions.items()},
        max_tokens={r: c.max_tokens for r, c in conditions.items()})
