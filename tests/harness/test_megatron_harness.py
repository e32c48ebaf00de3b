"""The CPU Megatron-Core harness (tests/support/megatron.py) runs real Megatron-Core models
-- Qwen3-style MoE with SequentialMLP and GroupedMLP experts behind the alltoall token
dispatcher, and a dense GPT -- forward and backward on 2 and 4 gloo processes, and each
parallel layout computes what the 1-process model computes from the same canonical
weights: the same global loss and, shard by shard, the same gradients.

Runs on whichever Megatron-Core the interpreter has (0.12.1 on the recipe stack, 0.16.1 on
the current one). The layouts of one world size run one after the other in the same group
of processes (each rank first computes the 1-process reference itself), to pay
Megatron's import -- several seconds per process on this 2-core machine -- once per
world size.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.support.child import run_group

SCENARIOS = "tests.harness.megatron_scenarios"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

CASES = {
    2: [{"moe": "sequential", "ep": 2},                      # EP2, dense part DP2
        {"moe": "grouped", "ep": 2},                         # GroupedMLP EP2
        {"moe": "grouped", "ep": 2, "dtype": "float64"},     # the same in float64
        {"tp": 2}],                                          # dense GPT, TP2
    4: [{"moe": "sequential", "tp": 2, "ep": 2, "etp": 1},  # TP2 x EP2 (sequence parallel), DP2
        {"moe": "grouped", "tp": 2, "ep": 2, "etp": 2}],     # TP2 / EP2 / ETP2, GroupedMLP
}
# Relative to the largest |reference value|. Logits keep the model's dtype; the loss and
# gradients go through Megatron's vocab-parallel cross entropy, which computes in fp32.
LOGITS_TOLERANCE = {"float32": 2e-5, "float64": 1e-10}
TOLERANCE = 2e-5


def _megatron_version() -> str:
    try:
        version("torch")
        return version("megatron-core")
    except PackageNotFoundError:
        pytest.skip("torch and megatron-core are not installed in this interpreter (.ci/stack.sh installs them)")


def _expected_sizes(case: dict, world: int) -> dict:
    tp, ep = case.get("tp", 1), case.get("ep", 1)
    etp = case.get("etp") or tp
    return {"tp": tp, "ep": ep, "etp": etp, "dp": world // tp}


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_parallel_layouts_match_the_single_process_model(world):
    _megatron_version()
    per_rank = run_group(SCENARIOS, "check_layouts", world, CASES[world], env=ENV, timeout=600)
    assert len(per_rank) == world
    for i, case in enumerate(CASES[world]):
        results = [rank_results[i + 1] for rank_results in per_rank]
        dtype = case.get("dtype", "float32")
        tol = TOLERANCE
        for r in results:
            assert r["case"] == case
            assert r["dtype"] == f"torch.{dtype}", r
            assert r["sizes"] == _expected_sizes(case, world), r
            assert r["sequence_parallel"] == bool(case.get("moe") and case.get("tp", 1) > 1), r
            if case.get("moe"):
                assert r["experts"] == {"sequential": "SequentialMLP", "grouped": "GroupedMLP"}[case["moe"]], r
                assert r["dispatcher"] == "MoEAlltoAllTokenDispatcher", r
            assert r["grads"] == r["params"], f"parameters without a gradient: {r}"
            assert r["logits_rel_err"] <= LOGITS_TOLERANCE[dtype], f"{case}: logits off by {r['logits_rel_err']:.2e}"
            assert abs(r["loss"] - r["ref_loss"]) <= tol * abs(r["ref_loss"]), r
            assert r["grad_rel_err"] <= tol, f"{case}: gradient of {r['worst']} off by {r['grad_rel_err']:.2e}"
        assert len({r["loss"] for r in results}) == 1, f"ranks disagree on the global loss: {results}"
    shims = per_rank[0][-1]["shims"]
    assert "grouped_gemm" in shims and "cuda_device_api" in shims and "gloo_strided_scatter" in shims, shims
    if world == 4:
        assert "sequence_parallel_torch_norm" in shims and "gloo_uneven_collectives" in shims, shims


def test_torch_gloo_scatter_still_ignores_strides_so_the_shim_stays():
    """Pins torch's gloo scatter of non-contiguous inputs (pytorch/pytorch#24836, #192920): it
    reads each block's storage in order and ignores its strides, which made Megatron-Bridge's
    load of row-parallel weights wrong at TP / ETP 2 on CPU (shim 8, ``gloo_strided_scatter``,
    tests/support/megatron_shims.py). The shim delivers each rank its block. When the stock
    assertion fails, torch fixed it: drop the shim."""
    from .megatron_scenarios import ScatteredColumns
    try:
        version("torch")
    except PackageNotFoundError:
        pytest.skip("torch is not installed in this interpreter")
    for r in run_group(SCENARIOS, "scatter_column_blocks", 2, env=ENV, timeout=300, returns=ScatteredColumns):
        assert r.shimmed == r.wanted, r
        assert r.stock == r.storage_order != r.wanted, r
