"""mindspeed_builder_include: MindSpeed's op builders compile with ``-include cstring``.

MindSpeed cannot be installed here. Behaviour: against the op-builder double
(tests/doubles/mindspeed_double, on ``sys.path`` of a forked test process only), whose
signatures are compared with MindSpeed's source. Statically, against MindSpeed 028de58 (or
``$MINDSPEED_SRC``): the targets resolve with the parameters the patches rely on, and every
builder that overrides ``cxx_args`` either extends ``super().cxx_args()`` or is patched itself.
"""

from __future__ import annotations

import ast
import os

import pytest

from ascend_rl_plugins.features import mindspeed_builder_include as feature
from tests.doubles import mindspeed_double_check as ms
from tests.support.stacks import mindspeed_source

INCLUDE = ["-include", "cstring"]


def _patched_classes() -> set[tuple[str, str]]:
    """(module, class) whose cxx_args this feature patches."""
    return {(p.module, p.qualname.rsplit(".", 1)[0]) for p in feature.FEATURE.patches}


@pytest.mark.forked
def test_every_builder_compiles_with_the_include_once(monkeypatch):
    monkeypatch.syspath_prepend(ms.DOUBLE_ROOT)
    from ascend_rl_plugins.patching.core import REGISTRY
    REGISTRY.activate(only=feature.FEATURE.patches)
    assert {p.name: p.outcome.state for p in feature.FEATURE.patches} == {
        "mindspeed_builder_include.builder_cxx_args": "pending",
        "mindspeed_builder_include.adaptive_recomputing_cxx_args": "pending"}  # waits for MindSpeed's import
    from mindspeed.op_builder import AdaptiveRecomputingPluggableAllocatorBuilder, FusedAdamWV2OpBuilder
    from mindspeed.op_builder import builder
    assert all(p.outcome.state == "applied" for p in feature.FEATURE.patches)

    extending, from_scratch = FusedAdamWV2OpBuilder(), AdaptiveRecomputingPluggableAllocatorBuilder()
    for b in (extending, from_scratch):
        args = b.cxx_args()
        at = args.index("-include")
        assert args[at:at + 2] == INCLUDE and args.count("cstring") == 1, args
    assert extending.cxx_args()[-1] == "-Wno-narrowing"  # the subclass's own flags follow the base's
    extending.load()
    assert builder.LOAD_CALLS[-1]["extra_cflags"] == extending.cxx_args()  # what reaches the compiler

    for p in feature.FEATURE.patches:
        REGISTRY.revert(p)
    assert "cstring" not in " ".join(from_scratch.cxx_args()) and "cstring" not in " ".join(extending.cxx_args())


def test_include_is_added_only_when_missing():
    assert feature.with_include(["-O2"]) == ["-O2", "-include", "cstring"]
    already = ["-O2", "-include", "cstring"]
    assert feature.with_include(already) == already
    one_string = ["-O2", "-include cstring"]  # how the recipe's patch wrote it
    assert feature.with_include(one_string) == one_string
    assert feature.with_include(["-O2", " -include cstring "]) == ["-O2", " -include cstring "]


def test_targets_resolve_in_mindspeed_with_their_parameters():
    from ascend_rl_plugins.patching import static
    root = mindspeed_source()
    for p in feature.FEATURE.patches:
        r = static.resolve_static(p.target, [root])
        assert r.found, f"{p.target}: {r.why}"
        assert set(p.params) <= {x.lstrip("*") for x in r.params}, (p.target, r.params)


def test_every_cxx_args_override_extends_the_base_or_is_patched():
    """Walks every ``mindspeed`` module: a class defining ``cxx_args`` must call
    ``super().cxx_args()`` (or ``super(Cls, self).cxx_args()``) or be patched by this feature
    (in 028de58 only AdaptiveRecomputingPluggableAllocatorBuilder builds its list from scratch)."""
    root = mindspeed_source()
    patched = _patched_classes()
    overriding, uncovered = [], []
    for dirpath, _, files in os.walk(os.path.join(root, "mindspeed")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                fn = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "cxx_args"), None)
                if fn is None:
                    continue
                overriding.append(cls.name)
                extends = any(isinstance(c, ast.Call) and ast.unparse(c.func).startswith("super(")
                              and ast.unparse(c.func).endswith(".cxx_args") for c in ast.walk(fn))
                if not extends and (module, cls.name) not in patched and cls.name != "MindSpeedOpBuilder":
                    uncovered.append(f"{module}.{cls.name}")
    assert len(overriding) > 10 and "AdaptiveRecomputingPluggableAllocatorBuilder" in overriding
    assert not uncovered, f"cxx_args overrides that neither extend the base nor are patched: {uncovered}"


def test_base_cxx_args_still_lacks_the_include():
    """The patch is still needed on MindSpeed 028de58 (remove_when)."""
    body = ast.unparse(ms.definition(mindspeed_source(), "mindspeed.op_builder.builder", "MindSpeedOpBuilder.cxx_args"))
    assert "cstring" not in body


def test_double_mirrors_mindspeeds_signatures():
    bad = ms.mismatches(mindspeed_source(), [
        ("mindspeed.op_builder.builder", "MindSpeedOpBuilder.__init__"),
        ("mindspeed.op_builder.builder", "MindSpeedOpBuilder.cxx_args"),
        ("mindspeed.op_builder.builder", "MindSpeedOpBuilder.load"),
        ("mindspeed.op_builder.adaptive_recomputing_builder", "AdaptiveRecomputingPluggableAllocatorBuilder.cxx_args"),
        ("mindspeed.op_builder.fused_adamw_v2_builder", "FusedAdamWV2OpBuilder.cxx_args")])
    assert not bad, bad


def test_doctor_checks_a_directory_holding_mindspeed():
    """``ascend-rl doctor --stack DIR`` with DIR holding an installed ``mindspeed`` (its
    dist-info): version, range and targets are read there. The reference copy has no
    dist-info, so its version is unknown and doctor says n/a, as in both reference stacks."""
    from ascend_rl_plugins.doctor import evaluate
    for p in feature.FEATURE.patches:
        row = evaluate(p, [ms.DOUBLE_ROOT])
        assert (row.version, row.version_state, row.resolves, row.verdict) == ("0.12.1", "ok", True, "will apply"), row
        assert evaluate(p, [mindspeed_source()]).version_state == "absent"
