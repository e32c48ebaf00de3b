"""``ascend-rl selftest``: the device-side checks every feature declares, run as a user runs them.

CI runs it on CPU in quick mode on both stacks (the accelerator run's figures are in
flashrl/README.md and int4_qat/README.md)."""

import argparse
import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from ascend_rl_plugins import selftest  # noqa: E402


def test_cpu_quick_selftest_passes_and_writes_every_row(tmp_path):
    out = tmp_path / "selftest.json"
    proc = subprocess.run([sys.executable, "-m", "ascend_rl_plugins", "selftest", "--device", "cpu", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device_type"] == "cpu" and report["quick"] is True
    rows = report["results"]
    by_feature = {r["feature"] for r in rows}
    assert {"flashrl", "int4_qat", "moe_reshard"} <= by_feature
    failed = [r for r in rows if r["ok"] is False]
    assert not failed, failed
    identity = [r for r in rows if r["check"].startswith("bit identity")]
    refusals = [r for r in rows if r["check"].startswith("refuses")]
    assert len(identity) >= 12 and all(r["ok"] for r in identity)
    # each against an independent CPU reference, named in the row (flashrl/test_device_checks.py)
    assert all(r["detail"].startswith("vs ") and "on the CPU" in r["detail"] for r in identity), identity
    assert len(refusals) == 12 and all(r["ok"] for r in refusals)
    assert "ascend-rl selftest on" in proc.stdout


def _args(**kw):
    base = dict(device="cpu", quick=True, feature=None, json=None, strict=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_a_mismatch_or_a_crashing_check_exits_nonzero(monkeypatch, capsys):
    def mismatching(ctx):
        return [selftest.CheckResult("fake", "bit identity", False, "differs")]

    def crashing(ctx):
        raise RuntimeError("no kernel")
    monkeypatch.setattr(selftest, "feature_checks", lambda: [("fake", mismatching)])
    assert selftest.main(_args()) == 1
    assert "fake/bit identity" in capsys.readouterr().err
    monkeypatch.setattr(selftest, "feature_checks", lambda: [("fake", crashing)])
    assert selftest.main(_args()) == 1
    assert "fake/selftest_checks" in capsys.readouterr().err


def test_speed_targets_fail_the_run_only_when_strict(monkeypatch):
    def slow(ctx):
        return [selftest.CheckResult("fake", "speed", True, "", {"ms": 1.0}, ">= 2x", False)]
    monkeypatch.setattr(selftest, "feature_checks", lambda: [("fake", slow)])
    assert selftest.main(_args()) == 0
    assert selftest.main(_args(strict=True)) == 1


def test_an_unknown_feature_exits_2_naming_the_accepted_features(capsys):
    assert selftest.main(_args(feature=["flashrl_typo"])) == 2
    err = capsys.readouterr().err
    assert "'flashrl_typo'" in err and "flashrl, int4_qat, moe_reshard" in err, err
    proc = subprocess.run([sys.executable, "-m", "ascend_rl_plugins", "selftest", "--device", "cpu", "--feature",
                           "flashrl_typo"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "'flashrl_typo'" in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    with pytest.raises(ValueError, match="flashrl_typo"):
        selftest.run(None, quick=True, only=("flashrl", "flashrl_typo"))   # before any check runs
