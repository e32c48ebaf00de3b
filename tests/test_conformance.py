"""Conformance: every patch's target resolves, by reading source, in every supported stack
whose version lies in the patch's declared range; and the README's table is the truth."""

import os
import re

import pytest

from ascend_rl_plugins import plugin
from ascend_rl_plugins.doctor import cache_dir, evaluate, markdown_features, markdown_table, stack_roots
from ascend_rl_plugins.patching.core import REGISTRY

STACKS = ("recipe", "current")
plugin.load_features()
README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")


def _roots(name):
    if not os.path.isdir(os.path.join(cache_dir(), "stacks", name, "src")):
        pytest.skip(f"stack {name} not built (bash .ci/stack.sh {name})")
    return stack_roots(name)[1]


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("patch_name", sorted(REGISTRY.patches))
def test_target_resolves_where_the_range_says_it_applies(stack, patch_name):
    p = REGISTRY.patches[patch_name]
    row = evaluate(p, _roots(stack))
    if row.version_state == "ok":
        assert row.resolves, f"{p.name}: {p.target} declared for {p.dist} {p.versions} but {row.where}"


@pytest.mark.parametrize("patch_name", sorted(REGISTRY.patches))
def test_every_patch_is_documented(patch_name):
    p = REGISTRY.patches[patch_name]
    assert p.reason and p.remove_when, f"{p.name} needs a reason and a removal condition"
    str(p.versions)  # the range parses
    gate = p.enabled_by if p.enabled_by is not None else p.feature.flag
    text = open(README, encoding="utf-8").read()
    if gate is not None and hasattr(gate, "name"):
        assert gate.name in text, f"flag {gate.name} of {p.name} is not documented in README.md"


def test_readme_conformance_table_is_current():
    stacks = {name: _roots(name) for name in STACKS}
    text = open(README, encoding="utf-8").read()
    m = re.search(r"<!-- conformance:begin -->\n(.*?)\n<!-- conformance:end -->", text, re.S)
    assert m, "README.md lacks the conformance table markers"
    assert m.group(1).strip() == markdown_table(stacks).strip(), (
        "README conformance table is stale: regenerate with "
        "`ascend-rl conformance recipe current` and paste it between the markers")


def test_readme_feature_table_is_current():
    text = open(README, encoding="utf-8").read()
    m = re.search(r"<!-- features:begin -->\n(.*?)\n<!-- features:end -->", text, re.S)
    assert m, "README.md lacks the feature table markers"
    assert m.group(1).strip() == markdown_features().strip(), (
        "README feature table is stale: regenerate with `ascend-rl conformance --features`")
