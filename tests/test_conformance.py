"""Conformance: every patch's target resolves, by reading source, in every supported stack
whose version lies in the patch's declared range; and the generated README blocks (feature
status, flags, per-stack conformance) are what the declarations say."""

import os

import pytest

from ascend_rl_plugins import docs, plugin
from ascend_rl_plugins.doctor import evaluate
from ascend_rl_plugins.patching.core import REGISTRY
from tests.support import stacks as stack_support

plugin.load_features()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("stack", stack_support.STACKS)
@pytest.mark.parametrize("patch_name", sorted(REGISTRY.patches))
def test_target_resolves_where_the_range_says_it_applies(stack, patch_name):
    p = REGISTRY.patches[patch_name]
    row = evaluate(p, stack_support.roots(stack))
    if row.version_state == "ok":
        assert row.resolves, f"{p.name}: {p.target} declared for {p.dist} {p.versions} but {row.where}"


@pytest.mark.parametrize("patch_name", sorted(REGISTRY.patches))
def test_every_patch_is_documented_in_its_feature_readme(patch_name):
    p = REGISTRY.patches[patch_name]
    assert p.reason and p.remove_when, f"{p.name} needs a reason and a removal condition"
    str(p.versions)  # the range parses
    readme = os.path.join(docs.PACKAGE, "features", p.feature.name, "README.md")
    assert os.path.exists(readme), f"feature {p.feature.name} has no README.md beside its code"
    text = open(readme, encoding="utf-8").read()
    gate = p.enabled_by if p.enabled_by is not None else p.feature.flag
    if gate is not None and hasattr(gate, "name"):
        assert gate.name in text, f"flag {gate.name} of {p.name} is not documented in {readme}"
    assert f"`{p.name}`" in text, f"patch {p.name} is not listed in {readme} (conformance block)"


def test_generated_blocks_are_current():
    """Status and flag tables (no stack needed)."""
    out = docs.stale(REPO)
    assert not out, f"stale generated README blocks: {out}; run `ascend-rl docs --write`"


def test_conformance_blocks_are_current():
    stacks = {name: stack_support.roots(name) for name in stack_support.STACKS}
    out = docs.stale(REPO, stacks)
    assert not out, (f"stale conformance blocks: {out}; run "
                     f"`ascend-rl docs --write --stacks recipe current`")
