"""rollout_progress_bar: vLLM's progress bar during verl 0.6.1's rollout, on chosen ranks only.

Real (recipe stack, the shared child process of tests/features/verl_vllm_compat/
verl_rollout_scenario.py, ASCEND_RL_ROLLOUT_PROGRESS_BAR=1, ranks 'first'): a real
vLLMRollout's ``generate_sequences`` with stderr captured; an ``LLM.generate`` call of that
same engine outside a rollout call; ``generate_sequences`` again with the process playing global
rank 1 (``torch.distributed.get_rank`` answering 1: one process cannot be two ranks).
In-process: the rank rule, the bar factory, the flag's validation. Statically: verl's call site.
"""

from __future__ import annotations

import ast
import io

import pytest

from ascend_rl_plugins import flags
from ascend_rl_plugins.features import rollout_progress_bar as feature
from tests.features.upstream_source import method, module_path, parse
from tests.features.verl_vllm_compat.verl_rollout import stage
from tests.support.stacks import roots


@pytest.fixture(scope="module")
def engine():
    return stage("engine")


def test_rollout_call_shows_a_bar_labelled_with_the_rank(engine):
    assert engine["patched"]["bar"] and engine["patched"]["bar_rank"]


def test_other_generate_calls_keep_their_own_choice(engine):
    assert engine["outside_rollout_bar"] is False


def test_a_rank_the_flag_excludes_prints_no_bar(engine):
    assert engine["rank1"]["bar"] is False
    assert engine["rank1"]["shape"] == engine["patched"]["shape"]  # and generates all the same


@pytest.mark.parametrize("mode, rank, engine_first, shows", [
    ("first", 0, True, True), ("first", 3, True, False),
    ("engines", 0, True, True), ("engines", 5, True, True), ("engines", 1, False, False),
    ("all", 7, False, True)])
def test_which_ranks_print(mode, rank, engine_first, shows):
    assert feature.shows_bar(mode, rank, engine_first) is shows


class _MeshDouble:
    """verl's rollout DeviceMesh as the rule reads it: dim names and per-dim local ranks."""

    mesh_dim_names = ("dp", "infer_tp", "infer_pp")

    def __init__(self, **local):
        self.local = local

    def __getitem__(self, dim):
        return type("Dim", (), {"get_local_rank": lambda _self, d=dim: self.local[d]})()


def test_engine_first_rank_is_tp_and_pp_rank_zero():
    rollout = type("R", (), {})()
    for tp, pp, first in ((0, 0, True), (1, 0, False), (0, 1, False)):
        rollout.device_mesh = _MeshDouble(dp=3, infer_tp=tp, infer_pp=pp)
        assert feature._engine_first_rank(rollout) is first
    rollout.device_mesh = None
    assert feature._engine_first_rank(rollout) is True


def test_bar_is_vllms_tqdm_with_the_rank_in_its_description():
    pytest.importorskip("tqdm")
    bar = feature.RankLabelledBar(3)(total=2, desc="Processed prompts", file=io.StringIO())
    assert bar.desc.startswith("rollout rank 3: Processed prompts")
    bar.close()


def test_bad_ranks_value_is_refused_naming_the_variable():
    with pytest.raises(flags.FlagError, match="ASCEND_RL_ROLLOUT_PROGRESS_BAR_RANKS.*'first', 'engines', 'all'"):
        flags.get("ASCEND_RL_ROLLOUT_PROGRESS_BAR_RANKS").parse("rank0")


def test_verl_06_rollout_generates_without_a_bar():
    """The call site the patches serve: generate_sequences -> inference_engine.generate(use_tqdm=False)."""
    body = method(parse(module_path("recipe", "verl", "verl.workers.rollout.vllm_rollout.vllm_rollout_spmd")),
                  "vLLMRollout", "generate_sequences")
    calls = [c for c in ast.walk(body)
             if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.inference_engine.generate"]
    assert [ast.unparse(k.value) for c in calls for k in c.keywords if k.arg == "use_tqdm"] == ["False"]


def test_doctor_says_it_does_not_apply_to_verl_09():
    assert feature.FEATURE.inapplicable(roots("current"))
    assert not feature.FEATURE.inapplicable(roots("recipe"))
