"""Cost model: loading and validation, the padding rule, and the terms of the formula."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ascend_rl_plugins.features.hdp.cost_model import (
    DEFAULT_PATH, CostModel, pad_multiple, padded_length)

MODEL = CostModel(linear_per_token=2e-5, attention_per_token_pair=3e-9,
                  kv_bytes_per_token=4e5, link_bytes_per_s=5e10, ring_step_latency=1e-4,
                  per_micro_batch_overhead=0.01)


def test_default_is_loaded_and_says_it_is_uncalibrated():
    model = CostModel.load(None)
    assert model == CostModel.load(DEFAULT_PATH)
    assert "UNCALIBRATED" in model.comment
    for name in ("linear_per_token", "attention_per_token_pair", "kv_bytes_per_token",
                 "link_bytes_per_s"):
        assert getattr(model, name) > 0


def test_round_trip_through_a_file(tmp_path):
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(MODEL.to_dict()))
    assert CostModel.load(str(path)) == MODEL


@pytest.mark.parametrize("content, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({**MODEL.to_dict(), "flops": 1}), r"unknown field\(s\) \['flops'\]"),
    (json.dumps({"linear_per_token": 1.0}), r"missing field\(s\).*attention_per_token_pair"),
    (json.dumps({**MODEL.to_dict(), "linear_per_token": -1}), "linear_per_token=-1"),
    (json.dumps({**MODEL.to_dict(), "link_bytes_per_s": 0}), "link_bytes_per_s=0"),
    (json.dumps({**MODEL.to_dict(), "ring_step_latency": "fast"}), "ring_step_latency='fast'"),
    (json.dumps({**MODEL.to_dict(), "per_micro_batch_overhead": True}),
     "per_micro_batch_overhead=True"),
])
def test_bad_files_name_the_field_and_what_is_accepted(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        CostModel.load(str(path))
    assert str(path) in str(info.value)


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        CostModel.load(str(tmp_path / "absent.json"))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 100000), st.integers(1, 16), st.sampled_from([1, 2, 4, 8]))
def test_padding_is_verls_align_size(length, group_size, tp):
    padded = int(padded_length(length, group_size, tp))
    multiple = 2 * group_size * tp if group_size > 1 else tp
    assert pad_multiple(group_size, tp) == multiple
    assert padded % multiple == 0 and length <= padded < length + multiple


def test_single_rank_time_is_linear_plus_causal_attention():
    length = 1000
    expected = MODEL.linear_per_token * 1000 + MODEL.attention_per_token_pair * 1000 ** 2 / 2
    assert math.isclose(MODEL.sequence_time(length, 1, tp=1), expected, rel_tol=1e-12)


def test_ring_communication_is_hidden_behind_long_chunks_only():
    no_comm = CostModel(**{**MODEL.to_dict(), "kv_bytes_per_token": 0.0,
                           "ring_step_latency": 0.0})
    # long sequence: every step's attention outlasts the transfer of the chunk's K/V
    assert MODEL.sequence_time(64000, 4, tp=1) == no_comm.sequence_time(64000, 4, tp=1)
    # short sequence: the ring steps are exposed, g - 1 of them
    short = MODEL.sequence_time(512, 4, tp=1) - no_comm.sequence_time(512, 4, tp=1)
    n = 512 / 4
    step = MODEL.ring_step_latency + MODEL.kv_bytes_per_token * n / MODEL.link_bytes_per_s
    attention_step = MODEL.attention_per_token_pair * 512 ** 2 / (2 * 4) / 4
    assert math.isclose(short, 3 * (step - attention_step), rel_tol=1e-9)


def test_splitting_divides_compute_but_pays_padding():
    t1 = MODEL.sequence_time(8000, 1, tp=4)
    t4 = MODEL.sequence_time(8000, 4, tp=4)
    assert t4 < t1 / 2  # long enough to profit from the split
    # the group's total rank-seconds never beat one rank's (no super-linear speedup)
    for length in (100, 1000, 8000, 32000):
        for g in (2, 4, 8):
            assert g * MODEL.sequence_time(length, g, tp=4) >= \
                MODEL.sequence_time(length, 1, tp=4) * (1 - 1e-12)


# Round numbers, so the examples below can be priced by hand.
HAND = CostModel(linear_per_token=1e-6, attention_per_token_pair=1e-9, kv_bytes_per_token=1000.0,
                 link_bytes_per_s=1e9, ring_step_latency=1e-3, per_micro_batch_overhead=0.05)


def test_a_padded_pack_priced_by_hand():
    # g = 2, tp = 2: every sequence padded to a multiple of 2*g*tp = 8
    #   1001 -> 1008, 13 -> 16, 3 -> 8; per rank n = 504 + 8 + 4 = 516 tokens
    # linear:    1e-6 * 516                                        = 0.000516
    # attention: 1e-9 * (1008**2 + 16**2 + 8**2) / (2*2)
    #          = 1e-9 * (1016064 + 256 + 64) / 4 = 1e-9 * 254096   = 0.000254096
    # ring: g - 1 = 1 step, ONE message for the pack: 1e-3 latency + 1000 B * 516 / 1e9 B/s
    #       = 0.001516, minus that step's attention 0.000254096 / 2 = 0.000127048
    #       exposed                                                = 0.001388952
    # total                                                        = 0.002159048
    assert math.isclose(HAND.group_time([1001, 13, 3], 2, tp=2), 0.002159048, rel_tol=1e-12)
    # priced per sequence, each pays its own latency (the two short ones one step each) and
    # hides its transfer behind its own attention only:
    #   1001: 0.000504 + 0.000254016 + (0.001504 - 0.000127008) = 0.002135008
    #     13: 0.000008 + 0.000000064 + (0.001008 - 0.000000032) = 0.001016032
    #      3: 0.000004 + 0.000000016 + (0.001004 - 0.000000008) = 0.001008008
    assert math.isclose(HAND.group_time([1001, 13, 3], 2, tp=2, ring="sequence"), 0.004159048,
                        rel_tol=1e-12)
    # g = 1, tp = 2: padded to tp only, 5 -> 6: 1e-6 * 6 + 1e-9 * 6**2 / 2 = 0.000006018
    assert math.isclose(HAND.group_time([5], 1, tp=2), 0.000006018, rel_tol=1e-12)
    # the micro-batch: its slowest group plus 0.05 s of overhead
    assert math.isclose(HAND.micro_batch_time([([1001, 13, 3], 2), ([5], 1), ([7], 1)], tp=2),
                        0.052159048, rel_tol=1e-12)


def test_a_long_sequence_hides_the_short_ones_transfer_by_hand():
    # g = 2, tp = 1 (multiple 4): 40000 and 100 tokens, n = 20000 + 50 = 20050 per rank
    # linear 1e-6 * 20050 = 0.02005; attention 1e-9 * (40000**2 + 100**2) / 4 = 0.4000025
    # the step's transfer 1e-3 + 1000 * 20050 / 1e9 = 0.02105 < its attention 0.20000125:
    # nothing exposed, total 0.4200525
    assert math.isclose(HAND.group_time([40000, 100], 2, tp=1), 0.4200525, rel_tol=1e-12)
    # per sequence the long one alone is 0.02 + 0.4 (nothing exposed) and the short one's
    # step is exposed on its own: 0.00005 + 0.0000025 + (0.00105 - 0.00000125) = 0.00110125
    assert math.isclose(HAND.group_time([40000, 100], 2, tp=1, ring="sequence"),
                        0.42110125, rel_tol=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 40000), min_size=1, max_size=20), st.integers(1, 8),
       st.sampled_from([1, 4]), st.integers(1, 40000))
def test_pack_pricing_against_per_sequence_pricing(lengths, group_size, tp, extra):
    pack = MODEL.group_time(lengths, group_size, tp=tp)
    parts = [MODEL.sequence_time(x, group_size, tp=tp) for x in lengths]
    # per-sequence pricing is the sum of the sequences alone, and never cheaper than the pack
    per_sequence = MODEL.group_time(lengths, group_size, tp=tp, ring="sequence")
    assert math.isclose(per_sequence, math.fsum(parts), rel_tol=1e-9)
    assert pack <= per_sequence * (1 + 1e-12)
    # a pack of one is the sequence alone; no pack is faster than its slowest member alone
    assert math.isclose(MODEL.group_time(lengths[:1], group_size, tp=tp), parts[0],
                        rel_tol=1e-12)
    assert pack >= max(parts) * (1 - 1e-12)
    # adding a sequence never makes a pack faster; on one rank there is no ring at all
    assert MODEL.group_time(lengths + [extra], group_size, tp=tp) >= pack * (1 - 1e-12)
    if group_size == 1:
        assert math.isclose(pack, per_sequence, rel_tol=1e-9)
    vector = MODEL.sequence_times(np.array(lengths), group_size, tp=tp)
    assert np.allclose(vector, parts, rtol=1e-12)
    with pytest.raises(ValueError, match="ring='ring'"):
        MODEL.group_time(lengths, group_size, tp=tp, ring="ring")


def test_micro_batch_time_is_the_slowest_group_plus_overhead():
    groups = [([8000], 2), ([500, 700], 1), ([300], 1)]
    expected = max(MODEL.group_time(ls, g, tp=1) for ls, g in groups) + 0.01
    assert math.isclose(MODEL.micro_batch_time(groups, tp=1), expected, rel_tol=1e-12)
    assert MODEL.group_time([], 4, tp=1) == 0.0
    with pytest.raises(ValueError, match="group_size=0"):
        MODEL.group_time([10], 0, tp=1)


def test_from_architecture_scales_with_the_parallel_layout():
    base = dict(active_params=22e9, num_layers=94, num_q_heads=64, qk_head_dim=128,
                v_head_dim=128, num_kv_heads=4, pp=4, matmul_flops_per_s=2e14,
                attention_flops_per_s=1.5e14, link_bytes_per_s=5e10,
                step_latency_per_layer=5e-6, per_micro_batch_overhead=0.02)
    tp4 = CostModel.from_architecture(tp=4, **base)
    tp8 = CostModel.from_architecture(tp=8, **base)
    assert math.isclose(tp8.linear_per_token * 2, tp4.linear_per_token)
    assert math.isclose(tp8.attention_per_token_pair * 2, tp4.attention_per_token_pair)
    assert math.isclose(tp8.kv_bytes_per_token * 2, tp4.kv_bytes_per_token)
    # MLA-like K/V per head make ring traffic far larger than GQA's 4 KV heads
    mla = CostModel.from_architecture(**{**base, "num_kv_heads": 64, "qk_head_dim": 192},
                                      tp=4)
    assert mla.kv_bytes_per_token > 10 * tp4.kv_bytes_per_token
    # the shipped default is this derivation (Qwen3-235B-like at TP4 PP4)
    default = CostModel.load(None)
    for name in ("linear_per_token", "attention_per_token_pair", "kv_bytes_per_token",
                 "ring_step_latency", "per_micro_batch_overhead"):
        assert math.isclose(getattr(default, name), getattr(tp4, name), rel_tol=1e-9), name


def test_ring_numbers_per_group_size_replace_the_defaults_for_that_size():
    per_size = CostModel(**{**HAND.to_dict(), "ring_by_group_size": {
        "2": {"ring_step_latency": 0.002, "link_bytes_per_s": 2e9}}})
    assert per_size.ring(2) == (0.002, 2e9) and per_size.ring(3) == (1e-3, 1e9)
    # g = 2, tp = 2, the padded pack of test_a_padded_pack_priced_by_hand: the step is now
    # 0.002 + 1000 * 516 / 2e9 = 0.002258, minus 0.000127048 = 0.002130952 exposed
    assert math.isclose(per_size.group_time([1001, 13, 3], 2, tp=2),
                        0.000516 + 0.000254096 + 0.002130952, rel_tol=1e-12)
    assert per_size.group_time([1001, 13, 3], 3, tp=2) == HAND.group_time([1001, 13, 3], 3, tp=2)
    assert CostModel.from_dict(per_size.to_dict()) == per_size


@pytest.mark.parametrize("entry, match", [
    ({"1": {"ring_step_latency": 0.0, "link_bytes_per_s": 1.0}}, "group size >= 2"),
    ({"2": {"ring_step_latency": 0.0}}, "exactly ring_step_latency and link_bytes_per_s"),
    ({"2": {"ring_step_latency": 0.0, "link_bytes_per_s": 0}}, "link_bytes_per_s=0"),
])
def test_bad_ring_numbers_are_refused_by_name(entry, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**{**HAND.to_dict(), "ring_by_group_size": entry})
