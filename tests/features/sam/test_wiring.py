"""Config rewrite, flags -> drafter, vLLM-Ascend proposer selection against a runner double,
and compiling the kernel when the proposer is built. The vLLM side (method 'sam' through
vLLM's validation, the runner's NgramProposer, the flags in the engine's drafter) runs in a
real engine in test_engine.py; patch targets are resolved against both reference stacks by
tests/test_conformance.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ascend_rl_plugins import flags
from ascend_rl_plugins.features import sam
from ascend_rl_plugins.features.sam.vllm_proposer import build_drafter, rewrite_speculative_dict
from tests.features.sam.wiring_scenario import KeptResponses
from tests.support.child import run_scenario
from tests.support.stacks import running_stack

CHILD_ENV = {"ASCEND_RL_AUTOLOAD": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
# every SAM flag away from its default (the alias spells the threshold)
FLAGS = {"ASCEND_RL_SAM_GROUP": "0", "ASCEND_RL_SAM_MIN_MATCH": "3", "ASCEND_RL_SAM_ADAPTIVE": "1",
         "ASCEND_RL_SAM_RECENT_LEN": "5", "VLLM_SPECULATIVE_BATCH_SIZE_THRE": "7"}
FLAG_SETTINGS = {"group": False, "min_match": 3, "adaptive": True, "recent_len": 5, "batch_threshold": 7}


def test_rewrite_speculative_dict():
    assert rewrite_speculative_dict({"method": "sam", "num_speculative_tokens": 3}) == \
        {"method": "ngram", "model": "sam", "num_speculative_tokens": 3}
    same = {"method": "ngram", "num_speculative_tokens": 3}
    assert rewrite_speculative_dict(same) is same
    assert rewrite_speculative_dict(None) is None
    with pytest.raises(ValueError, match="method='sam' takes no draft model"):
        rewrite_speculative_dict({"method": "sam", "model": "org/draft"})


def test_a_bad_flag_value_is_refused_by_name(flag_env):
    flag_env(ASCEND_RL_SAM_MIN_MATCH="0")
    with pytest.raises(flags.FlagError, match="ASCEND_RL_SAM_MIN_MATCH.*below the minimum"):
        flags.validate_all()


def test_build_drafter_takes_every_flag(flag_env):
    flag_env(**FLAGS)
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=2),
                          model_config=SimpleNamespace(max_model_len=300))
    d = build_drafter(cfg)
    assert {key: getattr(d, key) for key in FLAG_SETTINGS} == FLAG_SETTINGS
    assert (d.k, d.max_model_len) == (2, 300)
    flag_env(**{name: None for name in FLAGS})
    d = build_drafter(cfg)
    assert (d.group, d.min_match, d.adaptive, d.recent_len, d.batch_threshold) == (
        sam.GROUP.default, sam.MIN_MATCH.default, sam.ADAPTIVE.default, sam.RECENT_LEN.default,
        sam.BATCH_THRESHOLD.default)


def test_proposer_compiles_the_step_kernel_when_built():
    """The numba kernel is compiled (seconds on a cold cache) when an engine builds its
    proposer, not in the first decode step: a fresh process has no compiled entry point until
    a SAM proposer is constructed, and has it right after."""
    out = run_scenario("tests.features.sam.wiring_scenario", "kernel_compiled_when_proposer_built",
                       env=CHILD_ENV)
    assert out == {"before": False, "after": True, "k": 3}


def test_a_cold_kernel_compile_says_what_it_is_doing_at_the_default_log_level(tmp_path):
    """15-25 s of numba compilation on a fresh machine are announced while they run (and
    their end), at WARNING so the default level shows them."""
    out = run_scenario("tests.features.sam.wiring_scenario", "proposer_built_on_a_cold_numba_cache",
                       env=dict(CHILD_ENV, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache")))
    messages = [m for level, m in out["said"] if level == "WARNING"]
    assert any(m.startswith("ascend-rl sam: compiling the drafter's numba kernel") and m.endswith(" ...")
               for m in messages), out
    assert any(": done in " in m for m in messages), out


@pytest.fixture(scope="module")
def ascend_drafters():
    if running_stack() is None:
        pytest.skip("needs vLLM (recipe or current stack): the doubles subclass its NgramProposer")
    return run_scenario("tests.features.sam.wiring_scenario", "ascend_get_drafter", env=CHILD_ENV)


@pytest.mark.parametrize("flavour", ["0.13", "0.23"])
def test_ascend_get_drafter_selects_sam(ascend_drafters, flavour):
    """Selection logic against a double of NPUModelRunner and of the Ascend n-gram proposer
    module (vllm_ascend cannot be imported without torch_npu): real SAM drafter code runs."""
    out = ascend_drafters[flavour]
    base = "NgramProposer_double" if flavour == "0.13" else "AscendNgramProposer_double"
    assert out["type"] == "AscendSamProposer" and base in out["mro"]
    assert out["settings"]["max_model_len"] == 64 and out["settings"]["k"] == 3
    assert out["drafts"] == [[1, 2, 3], [7, 7, 7]]
    if flavour == "0.23":  # the other vLLM calling convention: propose(k, sampled, ...)
        assert out["drafts_other_vllm"] == [[2, 3, 4], [7, 7, 7]]
    assert out["plain"] == "original ngram drafter"


def test_history_keeps_only_requests_that_finished_by_themselves():
    """Issue 44: vLLM's runner drops a request from the batch alike whether it finished, was
    preempted or was aborted (a migration hop ends in an abort; the runner's
    ``finished_req_ids`` holds aborted requests too). The proposer reads each request's stop
    conditions from the runner's sampling parameters when it first shows up, so the history
    keeps the responses that ended by them, cut where the scheduler ended them, and nothing
    of the request that left before its end."""
    if running_stack() is None:
        pytest.skip("needs vLLM (recipe or current stack): real SamplingParams")
    out = run_scenario("tests.features.sam.wiring_scenario", "history_keeps_only_finished_requests",
                       env=CHILD_ENV, returns=KeptResponses)
    assert out.stop_token_ids == {"A": [2], "B": [], "C": [2], "D": [2, 9]}
    assert out.max_tokens == {"A": 20, "B": 3, "C": 20, "D": 20}
    assert out.kept == {"A": [[40, 41, 2]], "B": [[50, 2, 52]], "C": [], "D": []}
