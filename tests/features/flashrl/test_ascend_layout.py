"""vLLM-Ascend W8A8 layout decision, checked against the real vLLM-Ascend sources (static).

vllm_ascend cannot be imported here (no torch_npu); the rules are re-derived from its
source with ``ast`` for both versions, and the project's decision function must agree.
"""

import ast
import itertools
import os
import re

import pytest

from ascend_rl_plugins.features.flashrl.ascend_layout import require_reloadable, w8a8_layout
from ascend_rl_plugins.features.flashrl.config import ConfigError

from tests.support import stacks

STACK_OF = {"0.13.0": "recipe", "0.23.0.post1": "current"}  # vLLM-Ascend version -> stack
FILES = {
    "0.13.0": {"static": ("quantization/w8a8.py", "AscendW8A8LinearMethod"),
               "dynamic": ("quantization/w8a8_dynamic.py", "AscendW8A8DynamicLinearMethod"),
               "moe_dynamic": ("quantization/w8a8_dynamic.py", "AscendW8A8DynamicFusedMoEMethod")},
    "0.23.0.post1": {"static": ("quantization/methods/w8a8_static.py", "AscendW8A8LinearMethod"),
                     "dynamic": ("quantization/methods/w8a8_dynamic.py", "AscendW8A8DynamicLinearMethod"),
                     "moe_dynamic": ("quantization/methods/w8a8_dynamic.py", "AscendW8A8DynamicFusedMoEMethod")},
}


def _src(version):
    return stacks.source(STACK_OF[version], "vllm_ascend", "vllm_ascend")


def _method(root, rel, cls, meth="process_weights_after_loading"):
    tree = ast.parse(open(os.path.join(root, rel)).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == meth:
                    return item
    raise AssertionError(f"{cls}.{meth} not found in {rel}")


def _function(root, rel, name):
    tree = ast.parse(open(os.path.join(root, rel)).read())
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _transpose_rule(fn):
    """'always' if the weight transpose is a top-level statement, 'unless_310p' if it sits
    under an `if ... != ..._310P` test."""
    for stmt in fn.body:
        text = ast.unparse(stmt)
        if isinstance(stmt, ast.If) and "_310P" in ast.unparse(stmt.test) and "transpose" in ast.unparse(stmt.body[0]):
            assert isinstance(stmt.test, ast.Compare) and isinstance(stmt.test.ops[0], ast.NotEq)
            return "unless_310p"
        if not isinstance(stmt, ast.If) and "weight.data.transpose" in text:
            return "always"
    raise AssertionError("no weight transpose found")


def _nz_rule(fn):
    body = ast.unparse(fn)
    if "maybe_trans_nz" in body:
        return "setting"
    if "npu_format_cast" in body and "ACL_FORMAT_FRACTAL_NZ" in body:
        return "always"
    raise AssertionError("no NZ handling found")


def _env_default(root):
    m = re.search(r'os\.getenv\("VLLM_ASCEND_ENABLE_NZ",\s*([0-9]+)\)', open(os.path.join(root, "envs.py")).read())
    assert m, "VLLM_ASCEND_ENABLE_NZ default not found"
    return int(m.group(1))


def _derived_layout(version, scheme, env, additional, is_310p):
    """The layout as read from the sources."""
    root = _src(version)
    rel, cls = FILES[version][scheme]
    fn = _method(root, rel, cls)
    transposed = _transpose_rule(fn) == "always" or not is_310p
    if _nz_rule(fn) == "always":
        return transposed, True
    mode_env = int(env.get("VLLM_ASCEND_ENABLE_NZ", _env_default(root)))
    if version.startswith("0.13"):
        maybe = ast.unparse(_function(root, "utils.py", "maybe_trans_nz"))
        assert "VLLM_ASCEND_ENABLE_NZ" in maybe and "npu_format_cast" in maybe
        return transposed, mode_env != 0
    should = ast.unparse(_function(root, "utils.py", "_should_trans_nz"))
    assert "is_310p()" in should and "weight_nz_mode" in should
    cfg = open(os.path.join(root, "ascend_config.py")).read()
    assert re.search(r'"weight_nz_mode",\s*"VLLM_ASCEND_ENABLE_NZ"', cfg), "weight_nz_mode source changed"
    if is_310p:
        return transposed, True
    mode = int(additional["weight_nz_mode"]) if "weight_nz_mode" in additional else mode_env
    return transposed, mode != 0


CASES = list(itertools.product(["static", "dynamic", "moe_dynamic"],
                               [{}, {"VLLM_ASCEND_ENABLE_NZ": "0"}, {"VLLM_ASCEND_ENABLE_NZ": "1"},
                                {"VLLM_ASCEND_ENABLE_NZ": "2"}],
                               [{}, {"weight_nz_mode": 0}, {"weight_nz_mode": 1}],
                               [False, True]))


@pytest.mark.parametrize("version", sorted(STACK_OF))
def test_layout_decision_matches_vllm_ascend_sources(version):
    for scheme, env, additional, is_310p in CASES:
        got = w8a8_layout(version, scheme, env=env, additional_config=additional, is_310p=is_310p)
        want = _derived_layout(version, scheme, env, additional, is_310p)
        assert (got.transposed, got.nz) == want, (version, scheme, env, additional, is_310p, got.reason)


def test_reload_requires_the_plain_layout_with_a_clear_fix():
    require_reloadable(w8a8_layout("0.13.0", "dynamic", env={"VLLM_ASCEND_ENABLE_NZ": "0"}), "0.13.0")
    require_reloadable(w8a8_layout("0.23.0.post1", "static", env={}, additional_config={"weight_nz_mode": 0}),
                       "0.23.0.post1")
    with pytest.raises(ConfigError, match="VLLM_ASCEND_ENABLE_NZ=0"):
        require_reloadable(w8a8_layout("0.13.0", "static", env={}), "0.13.0")
    with pytest.raises(ConfigError, match="weight_nz_mode': 0"):
        require_reloadable(w8a8_layout("0.23.0.post1", "dynamic", env={}), "0.23.0.post1")
    with pytest.raises(ConfigError, match="Fused-MoE"):
        require_reloadable(w8a8_layout("0.23.0.post1", "moe_dynamic", env={"VLLM_ASCEND_ENABLE_NZ": "0"}),
                           "0.23.0.post1")
    with pytest.raises(ValueError, match="outside the versions"):
        w8a8_layout("0.11.0", "static", env={})
    with pytest.raises(ValueError, match="VLLM_ASCEND_ENABLE_NZ"):
        w8a8_layout("0.13.0", "static", env={"VLLM_ASCEND_ENABLE_NZ": "yes"})


@pytest.mark.parametrize("stack", stacks.STACKS)
def test_flashrl_patches_resolve_in_both_stacks(stack):
    from ascend_rl_plugins import doctor
    from ascend_rl_plugins.features import flashrl
    roots = stacks.roots(stack)
    rows = [doctor.evaluate(p, roots).as_dict() for p in flashrl.FEATURE.patches]
    in_range = [r for r in rows if r["version_state"] == "ok"]
    # the Ascend patches of the other version are outside (three W8A8 layout hooks each, plus the
    # 0.23-only block-FP8 refusal on the recipe stack); the verl 0.9 session hook is outside on
    # the recipe stack (verl 0.6.1 calls load_weights once per update)
    assert len(in_range) == len(rows) - (5 if stack == "recipe" else 3)
    assert all(r["resolves"] for r in in_range), [r for r in in_range if not r["resolves"]]
    verl = [r for r in rows if r["dist"] == "verl"]
    assert len(verl) == 1 and (verl[0]["version_state"] == "ok") == (stack == "current")


def test_fp8_dynamic_layout_matches_vllm_ascend_023_source():
    """vLLM-Ascend 0.23's W8A8FP8_DYNAMIC method inherits the int8 dynamic method's
    post-processing, whose NZ cast is guarded by int8 activations: FP8 weights are
    transposed and stay ND whatever the NZ setting. 0.13 has no FP8 W8A8 scheme."""
    root = _src("0.23.0.post1")
    tree = ast.parse(open(os.path.join(root, "quantization/methods/w8a8fp8_dynamic.py")).read())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "AscendW8A8FP8DynamicLinearMethod")
    assert [ast.unparse(b) for b in cls.bases] == ["AscendW8A8DynamicLinearMethod"]
    own = {i.name for i in cls.body if isinstance(i, ast.FunctionDef)}
    assert "process_weights_after_loading" not in own
    act = [ast.unparse(i) for i in cls.body if isinstance(i, ast.AnnAssign)]
    assert any("act_quant_type" in a and "float8_e4m3fn" in a for a in act), act
    parent = _method(root, "quantization/methods/w8a8_dynamic.py", "AscendW8A8DynamicLinearMethod")
    guarded = [n for n in ast.walk(parent) if isinstance(n, ast.If) and "maybe_trans_nz" in ast.unparse(n.body)
               and "act_quant_type == torch.int8" in ast.unparse(n.test)]
    assert guarded, "the NZ cast of the dynamic method is no longer guarded by int8 activations"
    assert _transpose_rule(parent) == "always"
    for env in ({}, {"VLLM_ASCEND_ENABLE_NZ": "1"}):
        got = w8a8_layout("0.23.0.post1", "fp8_dynamic", env=env, additional_config={"weight_nz_mode": 1})
        assert (got.transposed, got.nz, got.reloadable) == (True, False, True)
    with pytest.raises(ValueError, match="no FP8 W8A8"):
        w8a8_layout("0.13.0", "fp8_dynamic", env={})
    assert not os.path.exists(os.path.join(_src("0.13.0"), "quantization/w8a8fp8_dynamic.py"))
