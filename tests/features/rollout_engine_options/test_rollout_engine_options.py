"""rollout_engine_options: speculative decoding and graph options of verl 0.6.1's vLLM rollout.

Real (recipe stack, the shared child process of tests/features/verl_vllm_compat/
verl_rollout_scenario.py): a real vLLMRollout with SAM speculative decoding from
``engine_kwargs.vllm``, drafts counted at the engine's scheduler, and as a control the same
rollout asking for logprobs as stock verl does; the real ``vLLMRollout.__init__`` with
``vllm.LLM`` replaced by a recorder in verl's module; verl's real ``validate_config`` on a
trainer config composed from verl's yaml. In-process: ``options.plan`` and
``with_engine_options`` (no vLLM). Statically: the upstream facts the patches rely on.
"""

from __future__ import annotations

import ast

import pytest

from ascend_rl_plugins.features.rollout_engine_options import options
from ascend_rl_plugins.features.rollout_engine_options.options import EngineOptionsError, Request, plan
from tests.features.upstream_source import method, module_path, parse, top_level
from tests.features.verl_vllm_compat.verl_rollout import stage

METHODS = ["draft_model", "eagle", "mtp", "ngram", "sam", "suffix"]
MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@pytest.fixture(scope="module")
def engine():
    return stage("engine")


@pytest.fixture(scope="module")
def built():
    return stage("options")


def test_speculative_decoding_drafts_in_the_real_rollout(engine):
    assert engine["spec_model"] == "sam" and engine["logprobs"] is None
    assert engine["patched"]["drafted"] > 0


def test_control_asking_for_logprobs_as_stock_verl_drafts_nothing(engine):
    assert engine["stock_logprobs"]["drafted"] == 0
    assert engine["stock_logprobs"]["shape"] == engine["patched"]["shape"]


def test_capture_sizes_reach_the_engine(built):
    assert built["capture_sizes"]["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4]}
    assert built["capture_sizes_with_mode"]["compilation_config"] == {
        "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}
    assert built["capture_sizes"]["logprobs"] == 0  # no speculative decoding: verl's sampling unchanged


def test_speculative_config_reaches_the_engine_and_logprobs_are_dropped(built):
    assert built["speculative"]["speculative_config"] == {"method": "sam", "num_speculative_tokens": 3}
    assert built["speculative"]["logprobs"] is None


def test_npugraph_ex_flag_builds_a_full_graph_with_vllm_ascend_013s_switch(built):
    assert built["npugraph_ex"]["additional_config"] == {"enable_npugraph_ex": True}
    assert built["npugraph_ex"]["compilation_config"] == {"cudagraph_mode": "FULL"}
    assert "enforce_eager=False" in built["npugraph_ex_eager_refused"]


def test_bad_options_are_refused_before_the_engine_is_built(built):
    assert "speculative_config.method='samm'" in built["bad_method_refused_at_build"]
    assert "ngram" in built["bad_method_refused_at_build"] and "sam" in built["bad_method_refused_at_build"]
    assert built["llm_calls_when_refused"] == 0


def test_trainer_config_check_refuses_in_the_driver(built):
    got = built["validate_config"]
    assert got["good_passed"]
    assert "calculate_log_probs=True" in got["bad_refused"] and "speculative_config" in got["bad_refused"]


# -- options.plan, in-process --------------------------------------------------------------

def _rollout(**kw):
    base = {"enforce_eager": True, "cudagraph_capture_sizes": None, "calculate_log_probs": False,
            "engine_kwargs": {"vllm": {}}}
    base.update(kw)
    return base


def _plan(rollout, request=Request(), version="0.13.0"):
    return plan(rollout, request, vllm_version=version, methods=METHODS, graph_modes=MODES)


@pytest.mark.parametrize("engine_kwargs, match", [
    ({"speculative_config": "sam"}, r"speculative_config must be a mapping"),
    ({"speculative_config": {"num_speculative_tokens": 3}},
     r"needs a method \(one of draft_model, .*\) or a draft model"),
    ({"speculative_config": {"method": "samm"}}, r"method='samm' is not accepted; accepted: draft_model"),
    ({"speculative_config": {"method": "sam", "num_speculative_tokens": 0}}, r"num_speculative_tokens=0 .* >= 1"),
    ({"speculative_config": {"method": "sam", "num_speculative_tokens": True}}, r"num_speculative_tokens=True"),
    ({"compilation_config": 3}, r"compilation_config must be a mapping"),
    ({"compilation_config": {"cudagraph_mode": "HALF"}}, r"cudagraph_mode='HALF' is not valid; accepted: NONE"),
    ({"compilation_config": {"cudagraph_capture_sizes": [0]}}, r"cudagraph_capture_sizes=\[0\]"),
    ({"additional_config": "npugraph"}, r"additional_config must be a mapping"),
])
def test_bad_engine_options_name_the_key_and_what_is_accepted(engine_kwargs, match):
    with pytest.raises(EngineOptionsError, match=match):
        _plan(_rollout(engine_kwargs={"vllm": engine_kwargs}))


def test_engine_kwargs_must_be_a_mapping():
    with pytest.raises(EngineOptionsError, match=r"engine_kwargs.vllm must be a mapping"):
        _plan(_rollout(engine_kwargs={"vllm": ["speculative_config"]}))


def test_sam_needs_the_sam_feature():
    with pytest.raises(EngineOptionsError, match="ASCEND_RL_SAM=1"):
        plan(_rollout(engine_kwargs={"vllm": {"speculative_config": {"method": "sam"}}}), Request(sam=False),
             methods=[m for m in METHODS if m != "sam"])


def test_speculation_with_rollout_logprobs_is_refused():
    with pytest.raises(EngineOptionsError, match="calculate_log_probs=False or remove"):
        _plan(_rollout(calculate_log_probs=True, engine_kwargs={"vllm": {"speculative_config": {"method": "ngram"}}}))


def test_capture_sizes_merge_with_compilation_config_and_conflicts_are_refused():
    p = _plan(_rollout(enforce_eager=False, cudagraph_capture_sizes=[1, 2],
                       engine_kwargs={"vllm": {"compilation_config": {"cudagraph_mode": "FULL"}}}))
    assert p.capture_sizes_merged and p.engine_kwargs["compilation_config"] == {
        "cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2]}
    assert not _plan(_rollout(cudagraph_capture_sizes=[1, 2])).capture_sizes_merged  # eager: nothing to capture
    with pytest.raises(EngineOptionsError, match=r"cudagraph_capture_sizes=\[1, 2\] and .* differ"):
        _plan(_rollout(enforce_eager=False, cudagraph_capture_sizes=[1, 2],
                       engine_kwargs={"vllm": {"compilation_config": {"cudagraph_capture_sizes": [4]}}}))
    with pytest.raises(EngineOptionsError, match=r"rollout.cudagraph_capture_sizes='4'"):
        _plan(_rollout(enforce_eager=False, cudagraph_capture_sizes="4"))


def test_npugraph_ex_switch_per_vllm_ascend_release_and_graph_mode():
    p = _plan(_rollout(enforce_eager=False), Request(npugraph_ex=True))
    assert p.engine_kwargs == {"additional_config": {"enable_npugraph_ex": True},
                               "compilation_config": {"cudagraph_mode": "FULL"}}
    p = _plan(_rollout(enforce_eager=False), Request(npugraph_ex=True, static_kernel=True), version="0.23.0")
    assert p.engine_kwargs["additional_config"] == {
        "ascend_compilation_config": {"enable_npugraph_ex": True, "enable_static_kernel": True}}
    user = {"additional_config": {"enable_npugraph_ex": True},
            "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}
    assert _plan(_rollout(enforce_eager=False, engine_kwargs={"vllm": user})).engine_kwargs == user  # no flag needed
    with pytest.raises(EngineOptionsError, match="switches npugraph_ex off unless the graph mode is one of FULL"):
        piecewise = {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}
        _plan(_rollout(enforce_eager=False, engine_kwargs={"vllm": piecewise}), Request(npugraph_ex=True))
    with pytest.raises(EngineOptionsError, match="additional_config switches npugraph_ex off"):
        switched_off = {"additional_config": {"enable_npugraph_ex": False}}
        _plan(_rollout(enforce_eager=False, engine_kwargs={"vllm": switched_off}), Request(npugraph_ex=True))
    with pytest.raises(EngineOptionsError,
                       match="NPUGRAPH_EX_ENABLE_STATIC_KERNEL.*ASCEND_RL_ROLLOUT_ENGINE_OPTIONS_NPUGRAPH_EX=1"):
        _plan(_rollout(enforce_eager=False), Request(static_kernel=True))


def test_config_copies_leave_the_callers_config_alone():
    omegaconf = pytest.importorskip("omegaconf")
    raw = _rollout(enforce_eager=False, cudagraph_capture_sizes=[1], engine_kwargs={"vllm": {"seed": None}})
    for config in (raw, omegaconf.OmegaConf.create(raw)):
        p = _plan(config)
        new = options.with_engine_options(config, p)
        assert new["engine_kwargs"]["vllm"] == {"compilation_config": {"cudagraph_capture_sizes": [1]}}
        assert new["cudagraph_capture_sizes"] is None
        assert config["cudagraph_capture_sizes"] == [1] and config["engine_kwargs"]["vllm"] == {"seed": None}


# -- the upstream facts, statically --------------------------------------------------------

def test_vllm_013_drafts_nothing_for_requests_asking_logprobs():
    fn = top_level(parse(module_path("recipe", "vllm", "vllm.v1.spec_decode.utils")), "is_spec_decode_unsupported")
    assert "sampling_params.logprobs is not None" in ast.unparse(fn)


def test_verl_06_asks_for_logprobs_and_drops_list_capture_sizes():
    spmd = parse(module_path("recipe", "verl", "verl.workers.rollout.vllm_rollout.vllm_rollout_spmd"))
    init = ast.unparse(method(spmd, "vLLMRollout", "__init__"))
    assert "logprobs=0" in init and "isinstance(cudagraph_capture_sizes, ListConfig)" in init
    assert "**engine_kwargs" in init


def test_vllm_ascend_reads_the_npugraph_ex_switch_this_writes():
    old = ast.unparse(parse(module_path("recipe", "vllm_ascend", "vllm_ascend.ascend_config")))
    assert "additional_config.get('enable_npugraph_ex', False)" in old
    new = parse(module_path("current", "vllm_ascend", "vllm_ascend.ascend_config"))
    assert "additional_config.get('ascend_compilation_config', {})" in ast.unparse(new)
    params = [a.arg for a in method(new, "AscendCompilationConfig", "__init__").args.args]
    assert {"enable_npugraph_ex", "enable_static_kernel"} <= set(params)
    assert options.npugraph_ex_switch("0.13.0+cpu", True) == {"enable_npugraph_ex": True}


def test_vllm_ascend_013_keeps_npugraph_ex_only_in_full_graph_modes():
    platform = ast.unparse(parse(module_path("recipe", "vllm_ascend", "vllm_ascend.platform")))
    assert "ascend_config.enable_npugraph_ex = False" in platform
    assert "CUDAGraphMode.FULL_DECODE_ONLY" in platform
