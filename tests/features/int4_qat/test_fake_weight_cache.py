"""int4_qat's step cache (``ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE=step``): the fake-quantized
weight is made once per optimizer step and reused, with the same results as making it in every
forward.

Real: Megatron-Core GPTModel (EP2 GroupedMLP, scope all: dense linears and grouped experts) on
2 gloo processes, trained as Megatron's mixed-precision optimizers train (fp32 main weights
stepped by a torch optimizer, copied into the bf16 weights through ``.data``); unit level: the
straight-through function on a plain tensor.
"""

from __future__ import annotations

import pytest

from tests.support.child import run_group
from tests.support.stacks import require_installed

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0", "NUMBA_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ranks():
    require_installed("torch", "numba", "megatron-core")
    return run_group("tests.features.int4_qat.scenario", "step_cache", 2, 32, env=ENV, timeout=900)


def test_two_optimizer_steps_with_the_cache_equal_them_without(ranks):
    for r in ranks:
        on = r["on"]
        assert on["losses_equal"] == [True] * 6 and on["params_equal"], r
        first, second = on["steps"]
        # each step: every in-scope weight fake-quantized once (misses), then reused (hits) ...
        assert first["misses"] > 0 and first["hits"] == 2 * first["misses"], first
        assert second["misses"] == 2 * first["misses"] and second["hits"] == 2 * first["hits"], second
        # ... and nothing kept through the optimizer step
        assert first["cached_after_step"] == 0 and second["cached_after_step"] == 0, on["steps"]
        assert all(s == {"hits": 0, "misses": 0, "cached": 0, "cached_after_step": 0} for s in r["off"]), r["off"]


def test_without_the_optimizer_hook_the_second_step_would_use_stale_weights(ranks):
    """Megatron copies the stepped main weights in through ``.data``, which changes neither the
    weights' storage nor their version counters: the optimizer-step hook is what drops the
    first step's fake weights. Without it the first step is still exact and the second is not."""
    for r in ranks:
        stale = r["on, no optimizer hook"]
        assert stale["losses_equal"][:3] == [True] * 3, stale
        assert not any(stale["losses_equal"][3:]), stale
        assert not stale["params_equal"], stale


def _unit_setup(flag_env, mode):
    torch = pytest.importorskip("torch")
    from ascend_rl_plugins.features.int4_qat import fake_weight_cache
    flag_env(ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE=mode)
    fake_weight_cache.reset()
    return torch, fake_weight_cache


def test_a_write_that_changes_the_weight_is_seen(flag_env):
    torch, cache = _unit_setup(flag_env, "step")
    from ascend_rl_plugins.quant import int4
    from ascend_rl_plugins.features.int4_qat.fake_quant import straight_through
    spec = int4.Int4Spec(32, "ct")
    w = torch.nn.Parameter((torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 0.1).to(torch.bfloat16))

    def fq():
        return straight_through(w, lambda t: int4.fake_quantize(t, spec), ("linear", spec))
    a, b = fq(), fq()
    assert torch.equal(a, int4.fake_quantize(w.detach(), spec)) and a.data_ptr() == b.data_ptr()
    assert cache.CACHE.stats.hits == 1 and cache.CACHE.stats.misses == 1
    with torch.no_grad():
        w.mul_(2)                                   # in place: the version counter moves
    assert torch.equal(fq(), int4.fake_quantize(w.detach(), spec))
    w.data = w.data.clone() * 3                     # a new storage (offload and reload do this)
    assert torch.equal(fq(), int4.fake_quantize(w.detach(), spec))
    assert cache.CACHE.stats.misses == 3
    with torch.no_grad():                           # no-grad forwards (reference / old log-probs) never cache
        fq()
    assert cache.CACHE.stats.misses == 3 and cache.CACHE.stats.hits == 1
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0).step()   # any optimizer step drops all
    assert cache.CACHE.cached_count() == 0
    fq().float().sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.ones_like(w.grad))   # straight through
    cache.reset()


def test_off_computes_every_time(flag_env):
    torch, cache = _unit_setup(flag_env, "off")
    from ascend_rl_plugins.quant import int4
    from ascend_rl_plugins.features.int4_qat.fake_quant import straight_through
    spec = int4.Int4Spec(32, "ct")
    w = torch.nn.Parameter(torch.randn(4, 32).to(torch.bfloat16))
    a = straight_through(w, lambda t: int4.fake_quantize(t, spec), ("linear", spec))
    b = straight_through(w, lambda t: int4.fake_quantize(t, spec), ("linear", spec))
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert cache.CACHE.stats.misses == 0 and cache.CACHE.cached_count() == 0


def test_the_flag_is_validated(flag_env):
    from ascend_rl_plugins import flags
    flag_env(ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE="always")
    with pytest.raises(flags.FlagError, match=r"ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE='always'.*'off', 'step'"):
        flags.validate_all()
