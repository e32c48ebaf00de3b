"""``ascend-rl hdp calibrate --quick``: two gloo processes on CPU time the kernels and write a cost
model the planner accepts; doctor says when the uncalibrated default is in use."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest

from ascend_rl_plugins.features import hdp
from ascend_rl_plugins.features.hdp.cost_model import CostModel
from ascend_rl_plugins.features.hdp.planner import plan
from tests.support.child import REPO

ENV_EXTRA = {"ASCEND_RL_AUTOLOAD": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def calibrate(*args, timeout=600):
    import os
    env = dict(os.environ, **ENV_EXTRA, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "ascend_rl_plugins", "hdp", "calibrate", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def test_quick_calibration_on_cpu_writes_a_model_the_planner_accepts(tmp_path):
    try:
        version("torch")
    except PackageNotFoundError:
        pytest.skip("torch is not installed in this interpreter (.ci/stack.sh installs it)")
    out = tmp_path / "model.json"
    proc = calibrate("--quick", "--nproc", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ASCEND_RL_HDP_COST_MODEL={out}" in proc.stdout
    model = CostModel.load(str(out))
    assert model.calibrated and "CALIBRATED" in model.comment and "gloo" in model.comment
    assert set(model.ring_by_group_size) == {"2"}  # every group size up to the world size
    assert 0 <= model.relative_error < 1
    for name in ("linear_per_token", "attention_per_token_pair", "link_bytes_per_s"):
        assert getattr(model, name) > 0, name
    report = json.loads((tmp_path / "model.json.report.json").read_text())
    assert report["device"] == "cpu" and report["world_size"] == 2
    assert len(report["pack_errors"]) == 4
    result = plan([900, 40, 30, 600, 25, 17], cp_size=2, max_tokens_per_rank=1024, cost_model=model)
    assert result.cost <= result.fixed_cp_cost
    assert hdp.cost_model_advice() != ""  # the default is still what the flag names


@pytest.mark.parametrize("args, match", [(("--nproc", "0"), "--nproc=0"),
                                         (("--heads", "6", "--tp", "4"), "--heads=6")])
def test_bad_arguments_are_refused_by_name(tmp_path, args, match):
    proc = calibrate("--out", str(tmp_path / "m.json"), *args, timeout=120)
    assert proc.returncode == 2 and match in proc.stderr, proc.stderr


def test_doctor_says_when_the_uncalibrated_model_is_in_use(flag_env, tmp_path):
    flag_env(ASCEND_RL_HDP="1")
    assert "not calibrated" in hdp.cost_model_advice()
    assert "not calibrated" in " ".join(hdp.FEATURE.advice())
    calibrated = CostModel(**{**CostModel.load(None).to_dict(), "calibrated": True,
                              "comment": "CALIBRATED (test)"})
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(calibrated.to_dict()))
    flag_env(ASCEND_RL_HDP_COST_MODEL=str(path))
    assert hdp.cost_model_advice() == "" and hdp.FEATURE.advice() == []
    uncalibrated = tmp_path / "mine.json"
    uncalibrated.write_text(json.dumps(CostModel.load(None).to_dict()))
    flag_env(ASCEND_RL_HDP_COST_MODEL=str(uncalibrated))
    assert f"ASCEND_RL_HDP_COST_MODEL={uncalibrated}" in hdp.cost_model_advice()


def test_a_fit_that_noise_makes_non_positive_falls_back_to_a_proportional_one():
    """Short timings on a busy machine can fall with size; the cost written is then the
    proportional fit, never zero (a zero cost would price the work as free)."""
    pytest.importorskip("numpy")
    from ascend_rl_plugins.features.hdp.calibrate import _positive_slope
    sizes = [256.0, 512.0, 1024.0]
    slope, fell_back = _positive_slope(sizes, [[1.0] * 3], [0.002 + 1e-6 * n for n in sizes])
    assert not fell_back and slope == pytest.approx(1e-6)
    slope, fell_back = _positive_slope(sizes, [[1.0] * 3], [0.009, 0.006, 0.005])   # noise: falling times
    assert fell_back and slope == pytest.approx(sum(n * t for n, t in zip(sizes, [0.009, 0.006, 0.005]))
                                                / sum(n * n for n in sizes))
    assert slope > 0


def test_the_spawned_ranks_rendezvous_port_is_already_listening_when_they_start(monkeypatch, tmp_path):
    """The port handed to locally spawned ranks must be held by a listening store from the moment
    it is chosen: a port found free (bind port 0, close) and passed on can be taken by any other
    bind or outgoing connection before rank 0 listens on it, and the calibration then dies with
    EADDRINUSE on every rank (the race the verl 0.9 backend had too, issue 44)."""
    import argparse
    import socket

    pytest.importorskip("torch")
    import torch.multiprocessing as mp

    from ascend_rl_plugins.features.hdp import calibrate as calibrate_module

    class Started(Exception):
        pass

    seen = {}

    def start_processes(fn, args, nprocs, start_method):
        port = args[1]
        with socket.socket() as s:
            seen["listening"] = s.connect_ex(("127.0.0.1", port)) == 0
        seen["nprocs"] = nprocs
        raise Started

    monkeypatch.setattr(mp, "start_processes", start_processes)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = argparse.Namespace(nproc=2, hidden=64, ffn_hidden=128, heads=4, kv_heads=2, qk_head_dim=16,
                              v_head_dim=16, layers=1, tp=1, quick=True, out=str(tmp_path / "m.json"))
    with pytest.raises(Started):
        calibrate_module.cmd_calibrate(args)
    assert seen == {"listening": True, "nprocs": 2}
