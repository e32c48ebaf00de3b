"""activate() and doctor answer from the same decision: what doctor says for the running
interpreter is what activation does."""

import pytest

from ascend_rl_plugins import flags
from ascend_rl_plugins.doctor import evaluate
from ascend_rl_plugins.patching import REGISTRY, Feature, Verified
from ascend_rl_plugins.patching.decision import decide

pytestmark = pytest.mark.forked


def _outcomes(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    flags.reset_cache()
    gate = flags.define("ASCEND_RL_DECISION_TEST", "bool", False, "test gate", feature="decision_test")
    f = Feature("decision_test", "test", flag=gate, verified=Verified())
    f.after("textwrap:wrap", lambda r, i, a, k: r, dist=None, reason="t", remove_when="t",
            name="decision_test.stdlib")
    f.after("textwrap:fill", lambda r, i, a, k: r, dist="no-such-dist-xyz", reason="t", remove_when="t",
            name="decision_test.absent_dist")
    f.after("textwrap:shorten", lambda r, i, a, k: r, dist="packaging", versions="<1", reason="t",
            remove_when="t", name="decision_test.old_range")
    f.after("textwrap:no_such_function", lambda r, i, a, k: r, dist=None, reason="t", remove_when="t",
            name="decision_test.gone")
    rows = {p.name: (decide(p, check_target=True), evaluate(p)) for p in f.patches}
    REGISTRY.activate(f.patches)
    return {name: (d, row, REGISTRY.patches[name].outcome) for name, (d, row) in rows.items()}


@pytest.mark.parametrize("on", ["0", "1"])
def test_doctor_verdict_and_activation_agree(monkeypatch, on):
    got = _outcomes(monkeypatch, {"ASCEND_RL_DECISION_TEST": on})
    for name, (d, row, outcome) in got.items():
        will = row.verdict == "will apply"
        assert will == d.apply, name
        if will:
            assert outcome.state == "applied", (name, outcome)
        elif name == "decision_test.gone" and on == "1":
            # doctor predicted the missing target; activation finds it out at import
            assert row.verdict.startswith("TARGET MISSING") and outcome.state == "skipped"
        else:
            assert outcome.state == "skipped" and outcome.reason == d.reason, (name, outcome, d)
    if on == "0":
        assert got["decision_test.stdlib"][2].reason == "flag off (ASCEND_RL_DECISION_TEST=off)"
    else:
        assert got["decision_test.stdlib"][2].state == "applied"
        assert got["decision_test.absent_dist"][1].verdict.startswith("n/a")
        assert got["decision_test.old_range"][1].verdict.startswith("not for this version")


def test_a_patch_for_another_version_is_a_problem_only_when_no_sibling_covers_this_one(monkeypatch):
    """Switched on explicitly, a feature whose only patch is for another version does nothing
    here: a problem. Give it a sibling behind the same switch for the installed version and
    the other-version patch is just 'not for this version'."""
    from ascend_rl_plugins.doctor import diagnose
    monkeypatch.setenv("ASCEND_RL_SIBLING_TEST", "1")
    gate = flags.define("ASCEND_RL_SIBLING_TEST", "bool", False, "test gate", feature="sibling_test")
    f = Feature("sibling_test", "test", flag=gate, verified=Verified())
    f.after("textwrap:shorten", lambda r, i, a, k: r, dist="packaging", versions="<1", reason="t",
            remove_when="t", name="sibling_test.old_version")
    # the real features' rows stay out of the way
    monkeypatch.setenv("ASCEND_RL_DISABLE", ",".join(n for n in REGISTRY.features if n != "sibling_test"))
    flags.reset_cache()

    def row():
        return next(r for r in diagnose()[0] if r.patch == "sibling_test.old_version")

    alone = row()
    assert alone.verdict.startswith("not for this version") and alone.problem, alone
    f.after("textwrap:shorten", lambda r, i, a, k: r, dist="packaging", versions=">=1", reason="t",
            remove_when="t", name="sibling_test.this_version", order=20)
    covered = row()
    assert covered.verdict.startswith("not for this version") and not covered.problem, covered
