"""HDP on MindSpeed: static checks against MindSpeed 028de58, and the patches against the double.

MindSpeed cannot be installed here (it needs torch_npu and CANN). Statically: the two targets
exist with the parameters the patches rely on; the ``cp_para`` keys the sub-ring rewrite sets
are the ones MindSpeed's ring attention reads; MindSpeed's attention calls the entry with the
packed params in the position the patch reads; MindSpeed's own RoPE reaches Megatron's
``_apply_rotary_pos_emb_thd`` through the module (so ``hdp.rope_thd`` covers it); stock
``RingP2P`` still lacks the odd-ring pairing. Behaviour against the double, on 4 gloo
processes (mindspeed_scenario.py), is asserted in test_runtime_parity.py (one group run).
"""

from __future__ import annotations

import os
import re
import pytest

from ascend_rl_plugins.features import hdp as feature
from ascend_rl_plugins.features.hdp.mindspeed import sub_ring_cp_para
from ascend_rl_plugins.features.hdp.layout import HdpLayout
from tests.doubles import mindspeed_double_check as ms
from tests.support.stacks import mindspeed_source

RING_MODULE = "mindspeed.core.context_parallel.ring_context_parallel.ring_context_parallel"
UTILS_MODULE = "mindspeed.core.context_parallel.utils"


def _read(root, module):
    with open(os.path.join(root, *module.split(".")) + ".py", encoding="utf-8") as fh:
        return fh.read()


@pytest.fixture(scope="module")
def source():
    root = mindspeed_source()
    if not os.path.isdir(os.path.join(root, "mindspeed")):
        pytest.skip(f"MindSpeed source not found at {root}")
    return root


def test_targets_exist_with_the_signatures_the_patches_and_the_double_use(source):
    assert ms.signature(source, RING_MODULE, "ringattn_context_parallel") == [
        "q", "k", "v", "n", "cp_para", "softmax_scale=None", "attn_mask=None", "dropout_p=0.0",
        "packed_seq_params=None", "shapes=None"]
    assert ms.signature(source, UTILS_MODULE, "RingP2P.__init__") == [
        "self", "ring_global_ranks", "group", "group_for_send_recv_overlap=None", "is_backward=False"]
    assert ms.mismatches(source, [(RING_MODULE, "ringattn_context_parallel"), (UTILS_MODULE, "RingP2P.__init__"),
                                  (UTILS_MODULE, "RingP2P.wait")]) == []
    names = {p.name: p for p in feature.FEATURE.patches}
    assert names["hdp.mindspeed_ring_cp_para"].target == f"{RING_MODULE}:ringattn_context_parallel"
    assert names["hdp.mindspeed_odd_ring"].target == f"{UTILS_MODULE}:RingP2P.__init__"


def test_the_cp_para_keys_the_rewrite_sets_are_what_mindspeed_reads(source):
    text = _read(source, RING_MODULE)
    for key in ("rank", "cp_size", "cp_global_ranks", "cp_outer_ranks", "cp_dkv_outer_ranks", "cp_inner_ranks"):
        assert re.search(rf"cp_para(\.get\(|\[)[\"']{key}[\"']", text), key
    # the outer ring is built from cp_outer_ranks over cp_group; the packed lengths are divided by cp_size
    assert "RingP2P(cp_config.cp_outer_ranks, cp_config.cp_group" in text
    assert "cu_seqlens_q_padded // cp_config.cp_size" in text


def test_mindspeed_attention_passes_the_packed_params_where_the_patch_reads_them(source):
    text = _read(source, "mindspeed.core.context_parallel.dot_product_attention")
    call = re.search(r"ringattn_context_parallel\(query, key, value, n_head, cp_para, scale, attention_mask,\s*"
                     r"self\.attention_dropout\.p,\s*packed_seq_params\)", text)
    assert call, "MindSpeed's call of ringattn_context_parallel changed"


def test_mindspeed_rope_reaches_the_patched_megatron_function(source):
    text = _read(source, "mindspeed.core.models.common.embeddings.rotary_pos_embedding")
    assert "ru._apply_rotary_pos_emb_thd(" in text  # looked up on the module at call time


def test_stock_ring_p2p_still_lacks_the_odd_ring_pairing(source):
    init = ms.definition(source, UTILS_MODULE, "RingP2P.__init__")
    import ast
    text = ast.unparse(init)
    assert "ring_rank % 2" not in text and "self.group_for_send_recv_overlap = group" in text


def test_the_rewrite_is_a_copy_for_the_rank_s_group():
    layout = HdpLayout((30, 7, 9), ((0, 1, 2), (3,)), (0, 1, 0), cp_rank=2)
    cp_para = {"rank": 2, "cp_size": 4, "cp_global_ranks": [8, 9, 10, 11], "cp_outer_ranks": [8, 9, 10, 11],
               "cp_inner_ranks": [8, 9, 10, 11], "cp_group": "G", "causal": True}
    got = sub_ring_cp_para(cp_para, layout)
    assert got == {"rank": 2, "cp_size": 3, "cp_global_ranks": [8, 9, 10], "cp_outer_ranks": [8, 9, 10],
                   "cp_dkv_outer_ranks": [8, 9, 10], "cp_inner_ranks": [10], "cp_group": "G", "causal": True}
    assert cp_para["cp_size"] == 4 and cp_para["cp_global_ranks"] == [8, 9, 10, 11]
    with pytest.raises(ValueError, match="not the plan's CP rank"):
        sub_ring_cp_para(dict(cp_para, rank=1), layout)


def test_the_rewritten_rank_is_the_position_in_the_group_not_the_cp_rank():
    # CP rank 3 is position 1 of the group (2, 3): MindSpeed picks the zigzag chunks and the
    # ring neighbours of ``rank`` within ``cp_global_ranks``, so it must be 1 here
    layout = HdpLayout((30, 7, 9), ((0, 1), (2, 3)), (1, 0, 0), cp_rank=3)
    cp_para = {"rank": 3, "cp_size": 4, "cp_global_ranks": [8, 9, 10, 11], "cp_outer_ranks": [8, 9, 10, 11],
               "cp_inner_ranks": [8, 9, 10, 11], "cp_group": "G"}
    got = sub_ring_cp_para(cp_para, layout)
    assert got["rank"] == 1 and got["cp_size"] == 2
    assert got["cp_global_ranks"] == got["cp_outer_ranks"] == got["cp_dkv_outer_ranks"] == [10, 11]
    assert got["cp_global_ranks"][got["rank"]] == 11  # this rank's own global rank
    assert got["cp_inner_ranks"] == [11]
