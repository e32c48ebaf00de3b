"""What a move carries across a hop, shared by both migrating clients (``migration_client``'s and
verl's): the per-hop token limits (``hop_limits``) and the sampling parameters that cannot move
(``check_migratable``). Issue 42's finding 6; no engine."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm", reason="migration_client imports the KV connector (vLLM)")

from ascend_rl_plugins.features.rollout_rebalance.migration_client import (  # noqa: E402
    check_migratable,
    hop_limits,
)


@pytest.mark.parametrize("max_tokens,min_tokens,received,expected", [
    (20, 10, 0, (20, 10)),     # the first hop: as asked
    (20, 10, 4, (16, 6)),      # later hops: both limits less what earlier hops produced
    (20, 10, 10, (10, 0)),
    (20, 10, 15, (5, 0)),      # never below 0 (min_tokens 10 would exceed max_tokens 5)
    (20, None, 4, (16, 0)),    # none asked: none
    (20, 0, 4, (16, 0)),
])
def test_a_hop_asks_both_token_limits_less_what_the_request_received(max_tokens, min_tokens,
                                                                     received, expected):
    assert hop_limits(max_tokens, min_tokens, received) == expected


def _movable(**given):
    """What verl's client checks: only the parameters its sampling-params dict holds."""
    return types.SimpleNamespace(**given)


@pytest.mark.parametrize("name,value", [
    ("bad_words", ["x y"]),
    ("structured_outputs", object()),
    ("guided_decoding", object()),
    ("truncate_prompt_tokens", 16),
])
def test_what_a_hop_cannot_carry_is_refused_by_name(name, value):
    check_migratable(_movable(temperature=1.0, min_tokens=8, max_tokens=64, top_p=0.9,
                              repetition_penalty=1.1))   # those move
    with pytest.raises(ValueError, match=name):
        check_migratable(_movable(temperature=1.0, **{name: value}))
    check_migratable(_movable(temperature=1.0, **{name: [] if name == "bad_words" else None}))


def test_a_seed_is_refused_when_the_temperature_is_left_to_vllms_default():
    """A sampling-params dict without ``temperature`` samples at vLLM's default, 1.0: a seed
    there restarts its generator at the destination as much as with temperature=1.0 given."""
    with pytest.raises(ValueError, match="seed"):
        check_migratable(_movable(seed=3))
    check_migratable(_movable(seed=3, temperature=0.0))


def test_vllms_own_sampling_params_defaults_move():
    from vllm import SamplingParams
    check_migratable(SamplingParams(max_tokens=16, min_tokens=4))
    with pytest.raises(ValueError, match="bad_words"):
        check_migratable(SamplingParams(max_tokens=16, bad_words=["x"]))
