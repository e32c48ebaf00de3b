"""``Feature(requires=...)`` and ``Feature.required``: how a feature reads another feature's
switch without importing that feature's modules (tests/test_import_graph.py forbids the import)."""

import pytest

from ascend_rl_plugins.patching import Feature, PatchError, Verified

pytestmark = pytest.mark.stack_independent   # the framework and two feature modules: no stack needed


def test_a_required_feature_is_loaded_and_its_switch_read():
    from ascend_rl_plugins.features import rollout_engine_options, sam
    assert rollout_engine_options.FEATURE.requires == ("sam",)
    assert rollout_engine_options.FEATURE.required("sam") is sam.FEATURE
    assert rollout_engine_options.FEATURE.required("sam").flag is sam.ENABLE


def test_only_a_declared_feature_can_be_required():
    from ascend_rl_plugins.features import rollout_engine_options
    with pytest.raises(PatchError, match=r"'flashrl' is not declared in its requires= \('sam',\)"):
        rollout_engine_options.FEATURE.required("flashrl")


@pytest.mark.parametrize("requires", [("requires_demo",), ("Not-A-Name",), (3,)])
def test_requires_takes_other_features_names(requires):
    with pytest.raises(PatchError, match="requires= takes other features' names"):
        Feature("requires_demo", "x", verified=Verified(), requires=requires)
